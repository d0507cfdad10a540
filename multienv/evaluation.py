"""Unbiased evaluation: exactly ``num_episodes`` complete episodes over any vector env.

Running N envs until ``num_episodes`` episodes have ended favours short episodes: fast
envs finish several while a long one is still running, and the count is reached before
the long ones end. ``evaluate`` fixes each env's share up front (env i runs
``(num_episodes + i) // N`` episodes) and ignores whatever an env does after its share, so
every episode length is represented as often as the envs produce it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """What ``evaluate`` measured.

    Attributes:
        returns: The return of each complete episode, float64, in the order they ended.
        lengths: The length (env steps) of each, int64.
        env_ids: The env each ran in.
        crashed: Episodes cut by a worker crash (``info["multienv"]``): not counted, run
            again.
        capped: Episodes ended by ``max_steps`` (counted, with their return so far).
    """

    returns: np.ndarray
    lengths: np.ndarray
    env_ids: np.ndarray
    crashed: int = 0
    capped: int = 0

    @property
    def mean_return(self) -> float:
        """The mean of ``returns``."""
        return float(np.mean(self.returns))

    @property
    def mean_length(self) -> float:
        """The mean of ``lengths``."""
        return float(np.mean(self.lengths))


def evaluate(
    vec_env: VectorEnv[Any, Any, Any],
    policy: Callable[[Any], Any],
    num_episodes: int,
    *,
    seed: int | None = None,
    max_steps: int | None = None,
) -> EvaluationResult:
    """Run exactly ``num_episodes`` complete episodes and return their returns and lengths.

    Args:
        vec_env: Any Gymnasium ``VectorEnv`` (``MultiEnv`` first of all), in any autoreset
            mode. It is reset first.
        policy: ``policy(obs_batch) -> actions`` for the whole batch.
        num_episodes: How many episodes to count; env i runs ``(num_episodes + i) // N``.
        seed: Passed to the first ``reset``.
        max_steps: End an episode after this many steps (counted, as ``capped``), for envs
            without a time limit of their own. None: no cap.

    Raises:
        ValueError: ``num_episodes`` < 1 or ``max_steps`` < 1.

    Example:
        >>> import gymnasium as gym
        >>> import numpy as np
        >>> envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
        >>> result = evaluate(envs, lambda obs: np.zeros(len(obs), dtype=np.int64), 5, seed=0)
        >>> len(result.returns), np.bincount(result.env_ids).tolist()
        (5, [1, 2, 2])
        >>> envs.close()
    """
    if num_episodes < 1:
        raise ValueError(f"evaluate() needs num_episodes >= 1, got {num_episodes}.")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"evaluate() needs max_steps >= 1 or None, got {max_steps}.")
    n = vec_env.num_envs
    mode = AutoresetMode(vec_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
    targets = np.array([(num_episodes + i) // n for i in range(n)])
    counted = np.zeros(n, dtype=np.int64)
    returns, lengths, env_ids = [], [], []
    crashed = capped = 0
    episode_return = np.zeros(n)
    episode_length = np.zeros(n, dtype=np.int64)
    is_reset_step = np.zeros(n, dtype=np.bool_)  # NextStep: this step only resets
    obs, _ = vec_env.reset(seed=seed)
    while (counted < targets).any():
        obs, rewards, terminations, truncations, infos = vec_env.step(policy(obs))
        stepped = ~is_reset_step
        episode_return[stepped] += rewards[stepped]
        episode_length[stepped] += 1
        done = (terminations | truncations) & stepped
        crash = _crash_flags(infos, n) & done
        cap = np.zeros(n, dtype=np.bool_)
        if max_steps is not None:
            cap = stepped & ~done & (episode_length >= max_steps)
        for i in np.flatnonzero(done | cap):
            if crash[i]:
                crashed += int(counted[i] < targets[i])
            elif counted[i] < targets[i]:
                returns.append(episode_return[i])
                lengths.append(episode_length[i])
                env_ids.append(i)
                counted[i] += 1
                capped += int(cap[i])
        ended = done | cap
        episode_return[ended] = 0.0
        episode_length[ended] = 0
        if mode is AutoresetMode.NEXT_STEP:
            is_reset_step = done.copy()
        if mode is AutoresetMode.DISABLED and done.any():
            ended_now = done | cap
            obs, _ = vec_env.reset(options={"reset_mask": ended_now})
        elif cap.any():
            obs, _ = vec_env.reset(options={"reset_mask": cap})
            is_reset_step &= ~cap
    return EvaluationResult(
        np.asarray(returns, dtype=np.float64),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(env_ids, dtype=np.int64),
        crashed,
        capped,
    )


def _crash_flags(infos: dict[str, Any], n: int) -> np.ndarray:
    """Which envs' step was a worker crash's truncation (``info["multienv"]["restarted"]``).

    A recycled worker's reset also carries ``info["multienv"]``, without ``restarted``.
    """
    mask = infos.get("multienv", {}).get("_restarted")
    return np.zeros(n, dtype=np.bool_) if mask is None else np.asarray(mask, dtype=np.bool_)
