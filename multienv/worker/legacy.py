"""WORKER SIDE: old-Gym-API envs as Gymnasium envs.

``env_fn`` may return an env written for Gym before 0.26 (``reset()`` returns the
observation only, ``step()`` a 4-tuple with ``done`` and ``info["TimeLimit.truncated"]``,
seeding through ``seed()``), or a Gym 0.26 env (already the 5-tuple API, but a ``gym.Env``
with ``gym`` spaces). ``adapt`` wraps either in ``LegacyEnv``, a ``gymnasium.Env``; a
Gymnasium env is returned as it is.

Shimmy's ``GymV21CompatibilityV0`` / ``GymV26CompatibilityV0`` do this too, but refuse to
run unless the ``gym`` package is installed (they import it to convert spaces), and ``gym``
is unmaintained and breaks on NumPy 2. This adapter needs no ``gym``: it recognizes Gym's
spaces by their class name and fields.
"""

from __future__ import annotations

import inspect
from typing import Any

import gymnasium as gym
import numpy as np


def adapt(env: Any) -> gym.Env[Any, Any]:
    """``env`` itself if it is a Gymnasium env, else ``LegacyEnv(env)``.

    Raises:
        TypeError: ``env`` is neither a Gymnasium env nor has ``reset``, ``step`` and spaces.
    """
    if isinstance(env, gym.Env):
        return env
    missing = [
        name
        for name in ("reset", "step", "observation_space", "action_space")
        if not hasattr(env, name)
    ]
    if missing:
        raise TypeError(
            f"env_fn returned {type(env).__name__}, which is not a gymnasium.Env and has no "
            f"{', '.join(missing)}; return a gymnasium.Env (or an old Gym env)."
        )
    return LegacyEnv(env)


def convert_space(space: Any) -> gym.Space[Any]:
    """A Gymnasium space equal to a Gym (or Gymnasium) space."""
    if isinstance(space, gym.Space):
        return space
    kind = type(space).__name__
    if kind == "Box":
        return gym.spaces.Box(space.low, space.high, space.shape, space.dtype)
    if kind == "Discrete":
        return gym.spaces.Discrete(int(space.n), start=int(getattr(space, "start", 0)))
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(np.asarray(space.nvec))
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(space.n)
    if kind == "Tuple":
        return gym.spaces.Tuple(tuple(convert_space(sub) for sub in space.spaces))
    if kind == "Dict":
        return gym.spaces.Dict({key: convert_space(sub) for key, sub in space.spaces.items()})
    raise TypeError(f"cannot convert the old Gym space {space!r} to a Gymnasium space")


class LegacyEnv(gym.Env[Any, Any]):
    """A Gymnasium env around a Gym env of the pre-0.26 or the 0.26 API.

    Pre-0.26: ``reset(seed=s)`` calls ``seed(s)`` then ``reset()``; a ``done`` step is a
    truncation when ``info["TimeLimit.truncated"]`` is true, else a termination.

    Args:
        env: The old env.
    """

    def __init__(self, env: Any) -> None:
        """Convert the spaces; find out which API ``reset`` speaks."""
        self.env = env
        self.observation_space = convert_space(env.observation_space)
        self.action_space = convert_space(env.action_space)
        self.metadata = dict(getattr(env, "metadata", None) or {})
        self.render_mode = getattr(env, "render_mode", None)
        self.spec = None
        try:
            parameters = inspect.signature(env.reset).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        self._takes_seed = "seed" in parameters

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the old env, seeding it the way its API does."""
        super().reset(seed=seed)
        if self._takes_seed:
            kwargs: dict[str, Any] = {"seed": seed}
            if options is not None:
                kwargs["options"] = options
            result = self.env.reset(**kwargs)
        else:
            if seed is not None and hasattr(self.env, "seed"):
                self.env.seed(seed)
            result = self.env.reset()
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            return result[0], result[1]
        return result, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Step the old env; a 4-tuple's ``done`` becomes ``terminated`` or ``truncated``."""
        result = self.env.step(action)
        if len(result) == 5:
            obs, reward, terminated, truncated, info = result
            return obs, reward, bool(terminated), bool(truncated), info
        obs, reward, done, info = result
        info = dict(info)
        truncated = bool(done) and bool(info.pop("TimeLimit.truncated", False))
        return obs, reward, bool(done) and not truncated, truncated, info

    def render(self) -> Any:
        """The old env's ``render()`` (pre-0.26 envs take a mode: ``rgb_array`` is asked)."""
        try:
            return self.env.render()
        except TypeError:
            return self.env.render(mode="rgb_array")

    def close(self) -> None:
        """Close the old env."""
        self.env.close()

    def __getattr__(self, name: str) -> Any:
        """Attributes of the old env (``call`` / ``get_attr`` reach them)."""
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)
