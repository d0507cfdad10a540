"""Stable-Baselines3: ``MultiEnvVecEnv``, a ``VecEnv`` that behaves like ``SubprocVecEnv``.

Needs ``pip install "multienv[sb3]"``; ``import multienv`` does not import this module (nor
SB3, nor torch). It wraps a ``MultiEnv`` in same-step autoreset mode and speaks SB3's
``VecEnv`` API: ``reset()`` returns the observations only (the infos go to
``reset_infos``), seeds and options set through ``seed()`` / ``set_options()`` are used at
the next reset, and ``step_wait()`` returns ``(obs, rewards, dones, infos)`` with
``infos[i]["terminal_observation"]`` and ``infos[i]["TimeLimit.truncated"]`` as SB3's
workers set them.

A worker crash reaches SB3 as ``dones[i] = True`` with ``TimeLimit.truncated = True`` and
the last observation as ``terminal_observation``, so SB3's algorithms bootstrap it rather
than treat it as a real termination; ``infos[i]["multienv"]`` carries the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array
from stable_baselines3.common.vec_env.base_vec_env import (
    VecEnv,
    VecEnvIndices,
    VecEnvObs,
    VecEnvStepReturn,
)

from multienv.vector.multi_env import MultiEnv

_FINAL_KEYS = ("final_obs", "final_info")


class MultiEnvVecEnv(VecEnv):
    """A Stable-Baselines3 ``VecEnv`` on multienv's crash-proof workers.

    Args:
        env_fns: Env factories (as for ``SubprocVecEnv``), or a ``MultiEnv`` built with
            ``autoreset_mode="SameStep"``.
        start_method: As ``SubprocVecEnv`` takes it: ``"forkserver"``, ``"spawn"`` or
            ``"fork"`` (an unknown name raises the same ValueError); None uses multienv's
            default (its own forkserver on Linux).
        **options: ``MultiEnv`` options (``envs_per_worker``, ``step_timeout``,
            ``restart_policy``, ``backend``, ...).
    """

    def __init__(
        self,
        env_fns: Iterable[Callable[[], gym.Env[Any, Any]]] | MultiEnv,
        start_method: str | None = None,
        **options: Any,
    ) -> None:
        """Start the workers (or adopt the MultiEnv)."""
        if isinstance(env_fns, MultiEnv):
            if start_method is not None or options:
                raise TypeError("options apply only when MultiEnvVecEnv builds the MultiEnv")
            if env_fns.autoreset_mode is not AutoresetMode.SAME_STEP:
                raise ValueError(
                    "MultiEnvVecEnv needs a MultiEnv with autoreset_mode='SameStep' (SB3 resets "
                    f"an env in the step that ends it), got {env_fns.autoreset_mode.value!r}."
                )
            self.vec = env_fns
        else:
            if start_method is not None:
                options["context"] = start_method
            self.vec = MultiEnv(list(env_fns), autoreset_mode=AutoresetMode.SAME_STEP, **options)
        self.waiting = False
        self.closed = False
        super().__init__(
            self.vec.num_envs, self.vec.single_observation_space, self.vec.single_action_space
        )

    # ----------------------------------------------------------------- VecEnv API

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds and options set since the last reset."""
        seeds = list(self._seeds)
        options = [dict(option) if option else None for option in self._options]
        obs, infos = self.vec.reset(
            seed=seeds if any(s is not None for s in seeds) else None,
            options=options if any(options) else None,
        )
        self.reset_infos = [_unbatch(infos, i) for i in range(self.num_envs)]
        self._reset_seeds()
        self._reset_options()
        return obs  # type: ignore[no-any-return]

    def step_async(self, actions: np.ndarray) -> None:
        """Start stepping every env.

        ``actions`` takes every form ``SubprocVecEnv`` takes: a batch in the action space's
        own layout (an array; for Dict and Tuple spaces, a dict or tuple of batches), or a
        list with one action per env.
        """
        self.vec.step_async(_batched(actions, self.action_space, self.num_envs))
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        """Wait for the step: ``(obs, rewards, dones, infos)``, SB3's same-step autoreset."""
        obs, rewards, terminated, truncated, infos = self.vec.step_wait()
        self.waiting = False
        dones = terminated | truncated
        final_obs = infos.get("final_obs")
        final_info = infos.get("final_info", {})
        top = {key: value for key, value in infos.items() if key.lstrip("_") not in _FINAL_KEYS}
        step_infos: list[dict[str, Any]] = []
        for i in range(self.num_envs):
            if dones[i]:
                info = _unbatch(final_info, i)
                self.reset_infos[i] = _unbatch(top, i)
                if "multienv" in self.reset_infos[i]:
                    info["multienv"] = self.reset_infos[i].pop("multienv")
                assert final_obs is not None
                info["terminal_observation"] = final_obs[i]
            else:
                info = _unbatch(top, i)
            info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            step_infos.append(info)
        return obs, rewards, dones, step_infos

    def close(self) -> None:
        """Stop the workers; idempotent."""
        if self.closed:
            return
        self.vec.close()
        self.closed = True

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's ``render()`` (``render_mode="rgb_array"``)."""
        if self.render_mode != "rgb_array":
            return [None] * self.num_envs
        return list(self.vec.render())

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute of the chosen envs (searched through their wrappers)."""
        return [self.vec.envs[i].get_attr(attr_name) for i in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set the attribute on the chosen envs."""
        for i in self._get_indices(indices):
            self.vec.envs[i].set_attr(attr_name, value)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Call the method on the chosen envs."""
        return [
            self.vec.envs[i].call(method_name, *method_args, **method_kwargs)
            for i in self._get_indices(indices)
        ]

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether each chosen env is wrapped in ``wrapper_class``, checked in its worker."""
        return [self.vec.envs[i].is_wrapped(wrapper_class) for i in self._get_indices(indices)]

    def stats(self) -> list[dict[str, Any]]:
        """Multienv's per-env stats (steps, episodes, restarts, latency)."""
        return self.vec.stats()

    @property
    def envs(self) -> list[Any]:
        """The env proxies, in env-index order (``envs[i].pid`` is env i's worker)."""
        return self.vec.envs


def _batched(actions: Any, space: gym.Space[Any], num_envs: int) -> Any:
    """Dict or Tuple actions given one per env (a list, as SB3 passes them), as one batch."""
    if isinstance(space, gym.spaces.Dict):
        is_per_env = not isinstance(actions, Mapping)
    elif isinstance(space, gym.spaces.Tuple):
        is_per_env = isinstance(actions, list) or (
            isinstance(actions, np.ndarray) and actions.dtype == object
        )
    else:
        return actions
    if not is_per_env:
        return actions
    items = list(actions)
    if len(items) != num_envs:
        raise ValueError(f"expected {num_envs} actions (one per env), got {len(items)}.")
    for env_index, action in enumerate(items):  # the layout only: values pass as given
        if isinstance(space, gym.spaces.Dict):
            fits = isinstance(action, Mapping) and set(action) == set(space.spaces)
        else:
            fits = isinstance(action, Sequence) and len(action) == len(space.spaces)
        if not fits:
            raise ValueError(
                f"env {env_index}: action {action!r} does not have the layout of {space!r}."
            )
    out = create_empty_array(space, n=num_envs)
    assert out is not None  # None only for spaces of no fixed layout, not Dict or Tuple
    return concatenate(space, items, out)


def _unbatch(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """Env i's info from Gymnasium's batched infos (``key`` arrays plus ``_key`` masks)."""
    info: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        if mask is not None and not mask[i]:
            continue
        info[key] = _unbatch(value, i) if isinstance(value, dict) else _item(value[i])
    return info


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
