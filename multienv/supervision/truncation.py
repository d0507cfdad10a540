"""PARENT SIDE, backend-neutral: the episodes a worker's death cut, and what the caller saw.

A death ends every episode of the worker. Each env stepped in the dying batch comes back at
once as a flagged truncation; the worker's other envs are *lost* until their next step,
which returns the same truncation without stepping (a reset clears it). A truncation carries
the last observation the caller saw for that env, as the failure table says
(docs/failures.rst): kept here when observations are pickled, read from the vector's shared
memory otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.vector.utils import batch_space, create_empty_array, iterate

from multienv.wire.protocol import Batch, BatchResult, Outcome


class CutEpisodes:
    """One worker's lost episodes and the observations its caller saw last.

    Args:
        num_envs: How many envs the worker hosts.
        shared_obs: The observation an env is on in shared memory (None when not shared).
        space_of: An env's observation space, for the zeros of an env never seen.
    """

    def __init__(
        self,
        num_envs: int,
        shared_obs: Callable[[int], Any],
        space_of: Callable[[int], gym.Space[Any]],
    ) -> None:
        """Nothing lost, nothing seen."""
        self._lost: dict[int, str] = {}  # positions whose episode a death cut, not yet told
        self._last_obs: list[Any] = [None] * num_envs  # when not in shared memory
        self._shared_obs = shared_obs
        self._space_of = space_of

    def has_lost(self) -> bool:
        """Whether a death cut an episode that the caller has not been told of yet."""
        return bool(self._lost)

    def lose_all(self, cause: str) -> None:
        """Every env of the worker lost its episode; each is told on its next step."""
        for position in range(len(self._last_obs)):
            self._lost[position] = cause

    def restored(self, position: int) -> None:
        """A state was restored into that env: its episode goes on from there."""
        self._lost.pop(position, None)

    def forget_obs(self) -> None:
        """The observations now live elsewhere (the worker joined a vector's shared memory)."""
        self._last_obs = [None] * len(self._last_obs)

    def split(self, batch: Batch) -> tuple[Batch, list[int] | None, dict[int, str]]:
        """What of ``batch`` to send: the batch, the items sent (None: all), the lost items.

        A reset clears its env's loss; a step of a lost env is not sent.
        """
        if not self._lost:
            return batch, None, {}
        lost: dict[int, str] = {}
        for item, position in enumerate(batch.positions):
            if batch.is_reset[item]:
                self._lost.pop(position, None)
            elif position in self._lost:
                lost[item] = self._lost.pop(position)
        if not lost:
            return batch, None, {}
        sent_items = [item for item in range(len(batch.positions)) if item not in lost]
        return batch.subset(sent_items), sent_items, lost

    def note_obs(
        self, batch: Batch, result: BatchResult, lost: dict[int, str], failed: Sequence[int]
    ) -> None:
        """Keep the observations the caller sees now (when they are not shared)."""
        if result.obs is not None:
            for item, position in enumerate(batch.positions):
                if item not in lost and item not in failed:
                    self._last_obs[position] = result.obs[item]

    def last_obs(self, position: int) -> Any:
        """The observation the caller last saw for the env at ``position``."""
        obs = self._last_obs[position]
        if obs is None:
            obs = self._shared_obs(position)
        if obs is None:  # nothing seen yet: zeros of the observation's shape
            space = self._space_of(position)
            obs = next(iter(iterate(batch_space(space, 1), create_empty_array(space, 1))))
        return obs

    def truncate(
        self, result: BatchResult, batch: Batch, item: int, cause: str, restarts: int
    ) -> None:
        """Make ``item`` of ``result`` the flagged truncation a death gives a step."""
        position = batch.positions[item]
        self._lost.pop(position, None)
        result.rewards[item] = 0.0
        result.terminated[item] = False
        result.truncated[item] = True
        info = {"multienv": {"restarted": True, "cause": cause, "restarts": restarts}}
        result.extras[item] = Outcome(info=info)
        if result.obs is not None:
            result.obs[item] = self.last_obs(position)
