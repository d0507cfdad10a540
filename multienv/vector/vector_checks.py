"""VECTOR API: every check of a vector's input, made before anything is sent to a worker.

Bad input gets an exception that names the env index and what was expected: constructor
options, envs whose spaces differ, seeds, reset options and masks, actions, env ids. Nothing
here talks to a worker; ``proxies_for`` hands checked factories to their backend.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_differing_spaces, batch_space, iterate

from multienv.errors import EnvStateError, SpaceMismatchError
from multienv.layout import Layout, is_auto
from multienv.supervision.env_proxy import RemoteEnv
from multienv.supervision.handles import find_backend
from multienv.supervision.lifecycle import EnvState
from multienv.supervision.options import check_options
from multienv.wire.shared_memory import ARRAY_SPACES
from multienv.wire.space_bounds import lean_batch_space


def envs_given(envs: Iterable[Any] | None, env_fns: Iterable[Any] | None) -> Iterable[Any]:
    """MultiEnv's envs: its first argument, or ``env_fns=`` as AsyncVectorEnv takes them."""
    if envs is not None and env_fns is None:
        return envs
    if envs is None and env_fns is not None:
        return env_fns
    raise TypeError(
        "MultiEnv() takes its envs once: as its first argument, or as env_fns= the way "
        f"AsyncVectorEnv takes them; got envs={envs!r} and env_fns={env_fns!r}."
    )


def check_constructor(worker: Any, observation_mode: Any, max_concurrency: int | None) -> None:
    """``MultiEnv``'s own arguments, as ``AsyncVectorEnv`` checks its ones."""
    if worker is not None:
        raise ValueError(
            "MultiEnv(worker=...): multienv's workers are not a function to replace (each "
            "runs an EnvRunner under a supervisor that respawns it); wrap the env instead."
        )
    if not isinstance(observation_mode, tuple) and observation_mode not in ("same", "different"):
        raise ValueError(
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
            f"and batch observation space, actual got {observation_mode}"
        )
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency!r}.")


def check_ready(proxies: Sequence[Any]) -> None:
    """Ready proxies, each once, of a multienv backend."""
    seen: set[int] = set()
    for env_index, proxy in enumerate(proxies):
        if not isinstance(proxy, RemoteEnv):
            raise TypeError(
                f"env {env_index}: expected a SubprocessEnv (or another multienv proxy) or an "
                f"env factory, got {type(proxy).__name__}."
            )
        if id(proxy) in seen:
            raise ValueError(f"env {env_index}: the same proxy appears twice; pass each once.")
        seen.add(id(proxy))
        state = proxy.state
        if state is not EnvState.READY:
            raise EnvStateError(
                f"env {env_index}: is in state {state.name}; pass ready envs (start() and "
                "initialize() done, as create_subprocess_envs() returns them).",
                env_index=env_index,
            )


def observation_spaces(
    proxies: Sequence[Any], mode: str | tuple[gym.Space[Any], gym.Space[Any]]
) -> tuple[gym.Space[Any], gym.Space[Any], bool]:
    """The batched and single observation spaces, and whether every env has the same one.

    The envs' spaces must batch together under Gymnasium's ``observation_mode``; errors name
    the env.
    """
    first = proxies[0]
    for env_index, proxy in enumerate(proxies):
        space = proxy.observation_space
        if mode == "same" and space != first.observation_space:
            raise SpaceMismatchError(
                f"env {env_index}: observation_space {space!r} differs from env 0's "
                f"{first.observation_space!r}: the sub-environments observation spaces are "
                "not equivalent. MultiEnv(..., observation_mode='same') needs them equal. If "
                "this is intentional, use `observation_mode='different'` instead.",
                env_index=env_index,
            )
        if proxy.action_space != first.action_space:
            raise SpaceMismatchError(
                f"env {env_index}: action_space {proxy.action_space!r} differs from env 0's "
                f"{first.action_space!r}; all envs of a MultiEnv must have the same action "
                "space.",
                env_index=env_index,
            )
        single = mode[1] if isinstance(mode, tuple) else first.observation_space
        if mode != "same" and not _same_shape(space, single):
            given = "'different'" if mode == "different" else "custom space"
            raise SpaceMismatchError(
                f"MultiEnv(..., observation_mode={given}) however env {env_index}'s "
                f"observation space {space!r} does not share a common shape and dtype "
                f"with {single!r}.",
                env_index=env_index,
            )
    single = first.observation_space
    if isinstance(mode, tuple):
        return mode[0], mode[1], True
    if mode == "different":
        spaces = [proxy.observation_space for proxy in proxies]
        is_uniform = all(space == single for space in spaces)
        return batch_differing_spaces(spaces), single, is_uniform
    return lean_batch_space(single, len(proxies)), single, True


def _same_shape(space: gym.Space[Any], other: gym.Space[Any]) -> bool:
    """Whether two observation spaces share their shape and dtype (so they batch together)."""
    if isinstance(space, gym.spaces.Dict) and isinstance(other, gym.spaces.Dict):
        return space.spaces.keys() == other.spaces.keys() and all(
            _same_shape(space[key], other[key]) for key in space.spaces
        )
    if isinstance(space, gym.spaces.Tuple) and isinstance(other, gym.spaces.Tuple):
        return len(space) == len(other) and all(
            _same_shape(a, b) for a, b in zip(space, other, strict=True)
        )
    return type(space) is type(other) and space.shape == other.shape and space.dtype == other.dtype


def seeds(seed: int | Sequence[int | None] | None, num_envs: int) -> list[int | None]:
    """One seed per env (Python ints: numpy integers are converted), checked."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, int | np.integer):
        return [int(seed) + i for i in range(num_envs)]
    if isinstance(seed, str | bytes) or not isinstance(seed, Sequence | np.ndarray):
        raise TypeError(
            f"reset() seed must be None, an int or one seed per env, got {type(seed).__name__}."
        )
    items = list(seed)
    if len(items) != num_envs:
        raise ValueError(
            f"reset() got {len(items)} seeds for {num_envs} envs; pass one seed per "
            "env, a single int, or None."
        )
    for env_index, item in enumerate(items):
        if item is not None and not isinstance(item, int | np.integer):
            raise TypeError(
                f"env {env_index}: reset() seed must be an int or None, got {type(item).__name__}."
            )
    return [None if item is None else int(item) for item in items]


def options_per_env(options: Any, num_envs: int) -> tuple[list[Any], Any]:
    """Each env's reset options, and the reset mask (None: every env)."""
    n = num_envs
    if options is None:
        return [None] * n, None
    if isinstance(options, dict):
        shared = dict(options)
        mask = shared.pop("reset_mask", None)
        return [shared or None] * n, mask
    if isinstance(options, str | bytes) or not isinstance(options, Sequence):
        raise TypeError(
            f"reset() options must be a dict or a list of {n} dicts (one per env), got "
            f"{type(options).__name__}."
        )
    per_env = list(options)
    if len(per_env) != n:
        raise ValueError(
            f"reset() got options for {len(per_env)} envs, but there are {n}; pass one "
            f"dict (or None) per env, or one dict for all."
        )
    for env_index, item in enumerate(per_env):
        if item is not None and not isinstance(item, dict):
            raise TypeError(
                f"env {env_index}: reset() options must be a dict or None, got "
                f"{type(item).__name__}."
            )
        if item is not None and "reset_mask" in item:
            raise ValueError(
                f"env {env_index}: reset_mask goes in one options dict for all envs, not "
                "in a per-env list."
            )
    return per_env, None


def reset_mask(mask: Any, num_envs: int) -> np.ndarray:
    """The envs a reset resets: all when ``mask`` is None, else the checked mask."""
    if mask is None:
        return np.ones(num_envs, dtype=np.bool_)
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}."
        )
    if not mask.any():
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            f"value, got reset_mask={mask}"
        )
    return mask


def split_actions(
    actions: Any,
    env_ids: Sequence[int],
    space: gym.Space[Any],
    action_space: gym.Space[Any],
    num_envs: int,
) -> Any:
    """The actions as one array (array spaces) or list, checked; errors name the env.

    Args:
        actions: One action per env of ``env_ids``, batched.
        env_ids: The envs they are for.
        space: The single action space.
        action_space: The vector's batched action space (for all of its envs).
        num_envs: How many envs the vector has.
    """
    n = len(env_ids)
    if not isinstance(space, ARRAY_SPACES):
        batch_space_n = action_space if n == num_envs else batch_space(space, n)
        try:
            per_env = list(iterate(batch_space_n, actions))
        except Exception as exc:  # whatever iterate makes of a bad batch
            raise TypeError(
                f"expected a batch of {n} actions in {batch_space_n!r}; iterating it "
                f"raised {type(exc).__name__}: {exc}"
            ) from exc
        if len(per_env) != n:
            raise ValueError(f"expected {n} actions (one per env), got {len(per_env)}.")
        return per_env
    if isinstance(actions, np.ndarray) and actions.shape == (n, *(space.shape or ())):
        batch = actions  # the usual case; the checks below only name what is wrong
    else:
        _check_action_shapes(actions, env_ids, space)
        batch = np.asarray(actions)
    if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete) and (
        batch.dtype.kind not in "iu"  # np.issubdtype(dtype, np.integer), at a tenth the cost
    ):
        raise ValueError(f"expected integer actions for {space!r}, got dtype {batch.dtype}.")
    return batch


def _check_action_shapes(actions: Any, env_ids: Sequence[int], space: gym.Space[Any]) -> None:
    n = len(env_ids)
    try:
        count = len(actions)
    except TypeError:
        raise TypeError(
            f"expected a batch of {n} actions (one per env), got a single value of type "
            f"{type(actions).__name__} ({actions!r:.40})."
        ) from None
    if count != n:
        raise ValueError(
            f"expected {n} actions (one per env, batch shape {(n, *(space.shape or ()))}), "
            f"got {count}."
        )
    batch_shape = (n, *(space.shape or ()))
    if isinstance(actions, np.ndarray) and actions.shape != batch_shape:  # the batch's shape
        raise ValueError(
            f"the action batch has shape {actions.shape}; expected {batch_shape} (one action "
            f"of shape {space.shape} per env, single_action_space {space!r})."
        )
    for position, env_index in enumerate(env_ids):
        shape = np.shape(actions[position])
        if shape != space.shape:
            raise ValueError(
                f"env {env_index}: action has shape {shape}; expected {space.shape} "
                f"(single_action_space {space!r})."
            )


def env_ids_to_send(
    env_ids: Sequence[int] | np.ndarray | None, num_envs: int, in_flight: Collection[int]
) -> list[int]:
    """The envs ``send()`` steps: distinct, existing, none already in flight."""
    if env_ids is None:
        ids = list(range(num_envs))
    else:
        ids = [int(i) for i in np.asarray(env_ids).reshape(-1)]
    if not ids:
        raise ValueError("send() got no env_ids; pass at least one.")
    seen: set[int] = set()
    for i in ids:
        if not 0 <= i < num_envs:
            raise ValueError(f"env {i}: no such env; env_ids must be in [0, {num_envs}).")
        if i in seen:
            raise ValueError(f"env {i}: appears twice in env_ids; pass each env once.")
        if i in in_flight:
            raise EnvStateError(
                f"env {i}: already in flight; recv() it before sending it again.",
                env_index=i,
            )
        seen.add(i)
    return ids


def proxies_for(
    items: list[Any],
    backend: str,
    envs_per_worker: int | str,
    daemon: bool,
    options: dict[str, Any],
    own_options: Collection[str],
) -> tuple[list[RemoteEnv], bool, Layout | None]:
    """``MultiEnv``'s envs: the ready proxies it was given, or new ones built from factories.

    Args:
        items: Ready proxies, or env factories (not a mix).
        backend: The name of the backend that builds proxies from factories.
        envs_per_worker: How many envs each new worker hosts, or ``"auto"``: the backend
            chooses (``Backend.auto_layout``).
        daemon: Start new workers as daemons (where the backend has the option).
        options: The backend's options, for new proxies only.
        own_options: MultiEnv's own keyword options, listed when an option is unknown.

    Returns:
        The proxies; whether they were built here (then the caller closes them if it
        fails); the layout ``"auto"`` chose, else None.
    """
    if not items:
        raise ValueError("MultiEnv needs at least one env or env factory, got none.")
    is_proxy = [isinstance(item, gym.Env) for item in items]
    if all(is_proxy):
        if options or envs_per_worker != 1:
            given = sorted([*options, *(["envs_per_worker"] if envs_per_worker != 1 else [])])
            raise TypeError(
                f"MultiEnv got ready envs and options {given!r}; options apply "
                "only when MultiEnv builds the envs from factories."
            )
        check_ready(items)
        return items, False, None
    if any(is_proxy):
        first = is_proxy.index(not is_proxy[0])
        raise TypeError(
            f"env {first}: MultiEnv takes either all ready envs or all env factories, not a mix."
        )
    chosen = find_backend(backend)
    check_options("MultiEnv", options, chosen.options | set(own_options))
    if not daemon and "daemon" in chosen.options:
        options = {**options, "daemon": False}
    layout = None
    if is_auto(envs_per_worker, "MultiEnv"):
        if chosen.auto_layout is None:
            raise ValueError(
                f"envs_per_worker='auto' is not offered by the {backend!r} backend; give an int"
            )
        layout = chosen.auto_layout(items, **options)
        envs_per_worker = layout.envs_per_worker
    proxies = chosen.create_envs(items, envs_per_worker=envs_per_worker, **options)
    return proxies, True, layout
