"""``make_vec``: Gymnasium's ``make_vec`` with multienv's workers behind it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

from multienv.vector.multi_env import MultiEnv


def make_vec(
    id: str | gym.envs.registration.EnvSpec,
    num_envs: int = 1,
    vectorization_mode: str | None = None,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env[Any, Any]], gym.Wrapper[Any, Any, Any, Any]]]
    | None = None,
    **kwargs: Any,
) -> MultiEnv:
    """Create a ``MultiEnv`` of ``num_envs`` copies of a registered env, as ``gym.make_vec``.

    ``gym.make_vec("CartPole-v1", 8, vectorization_mode="async")`` becomes
    ``multienv.make_vec("CartPole-v1", 8)``; the arguments mean the same.

    Args:
        id: A registered env id from any namespace (``"ALE/Pong-v5"``, or
            ``"module:Env-v0"`` to import the module that registers it), or an ``EnvSpec``.
        num_envs: How many envs.
        vectorization_mode: Accepted for the swap: ``None``, ``"async"`` and ``"sync"`` all
            give a ``MultiEnv`` (its envs always run in workers); ``"vector_entry_point"``
            is not supported.
        vector_kwargs: ``MultiEnv`` keyword arguments (``autoreset_mode``,
            ``envs_per_worker``, ``step_timeout``, ``backend``, ...).
        wrappers: Env wrappers applied in order to each env, in its worker.
        **kwargs: Passed to ``gym.make`` for each env.

    Raises:
        ValueError: ``num_envs`` < 1, or an unsupported ``vectorization_mode``.
        gymnasium.error.Error: The id is not registered (checked here, before any worker).
    """
    if vectorization_mode not in (None, "async", "sync"):
        raise ValueError(
            f"make_vec() builds a MultiEnv; vectorization_mode must be None, 'async' or 'sync', "
            f"got {vectorization_mode!r}."
        )
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"make_vec() needs num_envs >= 1, got {num_envs!r}.")
    spec = gym.spec(id) if isinstance(id, str) else id  # an unknown id raises here
    env_fn = functools.partial(_make_wrapped, spec, tuple(wrappers or ()), kwargs)
    envs = MultiEnv([env_fn] * num_envs, **(vector_kwargs or {}))
    envs.spec = spec
    return envs


def _make_wrapped(
    spec: gym.envs.registration.EnvSpec,
    wrappers: tuple[Callable[[gym.Env[Any, Any]], gym.Wrapper[Any, Any, Any, Any]], ...],
    kwargs: dict[str, Any],
) -> gym.Env[Any, Any]:
    env = gym.make(spec, **kwargs)
    for wrapper in wrappers:
        env = wrapper(env)
    return env
