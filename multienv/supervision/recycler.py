"""PARENT SIDE, backend-neutral: one worker's recycling, consulted around each of its batches.

``RecyclePolicy`` (``multienv.recycle``) says when a worker is due; the ``Recycler`` of a
worker acts on it at the right moment, with no truncation and no spliced episode:

- before a batch (``before``): read the worker's memory when due; kill it at once over the
  hard cap (a death, cause ``"rss"``); start a standby worker when a budget is near; swap
  to it when the batch resets every env of the worker (the episode boundary). Until then,
  steps ask each env whose episode they end for its ``np_random``, so the swap takes the
  generators from those steps instead of a round trip. Under same-step autoreset a due
  worker's episodes end unreset, so the swap can follow the step that ends the last one;
- after a batch (``after``): keep those generators, hand the held resets back to the
  vector, and flag the resets a recycle started (``info["multienv"]["recycled"]``).

The fresh env takes the old one's ``np_random`` at its first reset, so a recycled run draws
the same random numbers as an undisturbed one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import numpy as np

from multienv.errors import EnvError
from multienv.recycle import RecyclePolicy
from multienv.supervision.handles import WorkerHandle
from multienv.supervision.worker_stats import WorkerStats
from multienv.wire.protocol import Batch, BatchResult, Command, Outcome

logger = logging.getLogger(__name__)


class RecycleHost(Protocol):
    """What a ``Recycler`` needs of its worker's supervisor."""

    handle: WorkerHandle
    stats: WorkerStats

    @property
    def num_envs(self) -> int:
        """How many envs the worker hosts."""

    def has_lost_episodes(self) -> bool:
        """Whether a death cut an episode that the caller has not been told of yet."""

    def kill_for(self, cause: str) -> None:
        """Kill the worker now and respawn it: a death with this cause."""

    def replace_worker(self) -> None:
        """Retire the worker and hand over to a new one (the standby, when ready)."""

    def request(self, position: int, command: Command, payload: Any, steps: int = 0) -> Any:
        """Run one call on one env."""

    def envs_text(self) -> str:
        """``env 3`` or ``envs 3-5``, for messages."""


class Recycler:
    """When and how one worker is replaced, at an episode boundary of all of its envs.

    Args:
        policy: The budgets and memory caps.
        host: The worker's supervisor.
    """

    def __init__(self, policy: RecyclePolicy, host: RecycleHost) -> None:
        """Nothing is due yet."""
        self.policy = policy
        self._host = host
        self._reason: str | None = None  # the limit the worker has reached
        self._recycled: dict[int, str] = {}  # positions whose next reset a recycle started
        self._rngs: dict[int, Any] = {}  # their old envs' np_random, for those resets
        self._end_rngs: dict[int, Any] = {}  # np_random as the last step ended the episode
        self._is_holding_autoreset = False  # the batch in flight was sent without it
        self._rss_mb: float | None = None
        self._next_rss_check = 0.0
        self._has_standby = False  # a replacement was started for the current worker

    def on_spawn(self) -> None:
        """A new worker started: its budgets and memory are counted afresh."""
        self._reason = None
        self._rss_mb = None
        self._next_rss_check = 0.0
        self._has_standby = False
        self._end_rngs.clear()

    def forget_end_rngs(self) -> None:
        """A call may have drawn from the generators kept at the ends of episodes."""
        self._end_rngs.clear()

    def is_busy(self) -> bool:
        """Whether the next batch needs the recycler's attention (so it cannot be planned)."""
        return self._watch() or self._has_standby

    def _watch(self) -> bool:
        """Read the worker's memory when due and check its budgets; True if action is due.

        Runs before every step of a recycling worker, so it avoids NumPy where it can.
        """
        policy = self.policy
        if self._reason is not None:
            return True
        if policy.reads_memory:
            now = time.monotonic()
            if now >= self._next_rss_check:
                self._next_rss_check = now + policy.check_every_s
                self._rss_mb = self._host.handle.rss_mb()
            if policy.is_over_hard_cap(self._rss_mb):
                return True
        steps, episodes = self._host.stats.since_spawn()
        self._reason = policy.reason(steps, episodes, self._rss_mb)
        if not self._has_standby and (
            self._reason is not None or policy.is_near(steps, episodes, self._rss_mb)
        ):
            self._host.handle.prestart()
            self._has_standby = True
        return self._reason is not None

    def before(self, batch: Batch) -> Batch:
        """Before a batch: kill for memory, or swap at a boundary; return the batch to send."""
        host, policy = self._host, self.policy
        self._is_holding_autoreset = False  # a death may have left it set
        if not self._watch():
            if self._rngs:
                batch = self._with_rngs(batch)
            return self._keeping_rngs(batch) if self._has_standby else batch
        if policy.is_over_hard_cap(self._rss_mb):
            logger.warning(
                "%s: worker pid %s holds %.0f MiB, over hard_rss_mb=%g; killing it",
                host.envs_text(),
                host.handle.pid,
                self._rss_mb,
                policy.hard_rss_mb,
            )
            host.kill_for("rss")
            return batch
        reason = self._reason
        assert reason is not None
        is_boundary = len(batch.positions) == host.num_envs and bool(np.all(batch.is_reset))
        if is_boundary and not host.has_lost_episodes():
            self._swap(reason)
            return self._with_rngs(batch)
        if batch.autoreset:  # same-step: let episodes end unreset, so the swap can follow
            self._is_holding_autoreset = True
            batch = dataclasses.replace(batch, autoreset=False)
        return self._keeping_rngs(batch)

    def after(self, batch: Batch, result: BatchResult) -> None:
        """After a batch: flag the resets a recycle started; hand held same-step resets back."""
        host = self._host
        if batch.keep_np_randoms:
            for item, extra in result.extras.items():
                if extra.np_random is not None:
                    self._end_rngs[batch.positions[item]] = extra.np_random
        if self._is_holding_autoreset:
            # Sent without same-step autoreset: the vector resets each ended episode (as
            # after a crash); when every env of the worker ended, the swap comes first.
            self._is_holding_autoreset = False
            done = result.terminated | result.truncated
            failed = [item for item, extra in result.extras.items() if extra.failure is not None]
            for item in np.flatnonzero(done).tolist():
                extra = result.extras.setdefault(item, Outcome())
                if extra.failure is None:
                    extra.reset = None
            reason = self._reason
            if (
                reason is not None
                and len(batch.positions) == host.num_envs
                and bool(np.all(done))
                and not failed
                and not host.has_lost_episodes()
            ):
                self._swap(reason)
            return
        if not self._recycled:
            return
        for item, position in enumerate(batch.positions):
            if batch.is_reset[item] and position in self._recycled:
                reason = self._recycled.pop(position)
                extra = result.extras.setdefault(item, Outcome())
                extra.info = {**extra.info, "multienv": {"recycled": True, "reason": reason}}

    def _keeping_rngs(self, batch: Batch) -> Batch:
        """The batch, asking each env whose episode it ends for its ``np_random``.

        Sent while a replacement waits, so that a swap at the boundary takes the generators
        from the step that ended the episodes instead of fetching them in a round trip. A
        same-step autoreset would draw from the generator first, so those batches do not ask.
        """
        for position in batch.positions:
            self._end_rngs.pop(position, None)  # the env runs again: its generator moves on
        if batch.autoreset:
            return batch
        return dataclasses.replace(batch, keep_np_randoms=True)

    def _with_rngs(self, batch: Batch) -> Batch:
        """The batch, its resets carrying the np_random of the envs a recycle replaced."""
        rngs = [
            self._rngs.pop(position, None) if batch.is_reset[item] else None
            for item, position in enumerate(batch.positions)
        ]
        if not any(rng is not None for rng in rngs):
            return batch
        return dataclasses.replace(batch, np_randoms=rngs)

    def _swap(self, reason: str) -> None:
        """Replace the worker by its (pre-started) successor; every env is at a boundary."""
        host = self._host
        began = time.perf_counter()
        old_pid = host.handle.pid
        kept, self._end_rngs = self._end_rngs, {}
        rngs = [
            kept[position] if position in kept else self._get_rng(position)
            for position in range(host.num_envs)
        ]
        host.replace_worker()
        self._rngs = {position: rng for position, rng in enumerate(rngs) if rng is not None}
        host.stats.note_recycle()
        host.stats.recycle_s += time.perf_counter() - began
        self._recycled = dict.fromkeys(range(host.num_envs), reason)
        logger.info(
            "%s: recycled worker pid %s (%s) for pid %s in %.1f ms",
            host.envs_text(),
            old_pid,
            reason,
            host.handle.pid,
            1e3 * (time.perf_counter() - began),
        )

    def _get_rng(self, position: int) -> Any:
        """The env's ``np_random``, so its next episodes draw as the old env's would."""
        try:
            return self._host.request(position, Command.GET_ATTR, "np_random")
        except EnvError:  # no np_random (an old-API env, say): the fresh env keeps its own
            return None
