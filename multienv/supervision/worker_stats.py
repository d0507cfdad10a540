"""PARENT SIDE: the counters of one worker's envs, and their only writer.

The supervisor reports what happened (a batch came back, a planned step was committed, a
worker died or was recycled); ``WorkerStats`` turns that into counts. ``MultiEnv.stats()``
and the proxies' ``steps``/``restarts``/... properties only read them.

A vector that plans its steps counts them for all envs at once: its ``VectorCounters``
holds every env's steps and episodes, and each worker's counters become views of its part.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from multienv.wire.protocol import Batch, BatchResult

_LATENCY_WINDOW = 1000  # batches kept for the latency percentiles


class WorkerStats:
    """Steps, episodes, latencies, restarts and recycles of one worker hosting k envs.

    Steps and episodes are per env (by position); a restart or a recycle replaces the whole
    worker, so each of its envs counts it.

    Args:
        num_envs: How many envs the worker hosts.
    """

    def __init__(self, num_envs: int) -> None:
        """Start from zero."""
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.episodes = np.zeros(num_envs, dtype=np.int64)
        self.step_latencies_s: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self.vector: VectorCounters | None = None  # whose views steps and episodes are
        self.restarts = 0
        self.recycles = 0
        self.restart_s = 0.0  # time spent respawning after deaths (``WorkerLife.respawn``)
        self.recycle_s = 0.0  # time spent swapping in fresh workers (``Recycler``)
        self.last_failure: str | None = None
        self._born_at = (0, 0)  # steps and episodes counted when the current worker started

    def note_batch(
        self, batch: Batch, result: BatchResult, elapsed_s: float, failed: Sequence[int]
    ) -> None:
        """Count the steps of a batch that came back; ``failed`` items did not step."""
        if self.vector is not None:
            self.vector.flush()
        if len(batch.positions) == 1:  # one env (send/recv at k=1): scalars are faster
            if not failed and not batch.is_reset[0]:
                position = batch.positions[0]
                self.steps[position] += 1
                if result.terminated[0] or result.truncated[0]:
                    self.episodes[position] += 1
                self.step_latencies_s.append(elapsed_s)
            return
        done = result.terminated | result.truncated
        if batch.is_whole and not failed and not np.count_nonzero(batch.is_reset):
            self.steps += 1  # the common case: every env of the worker stepped
            if np.count_nonzero(done):
                self.episodes[done] += 1
            self.step_latencies_s.append(elapsed_s)
            return
        is_step = ~batch.is_reset
        is_step[list(failed)] = False
        if np.count_nonzero(is_step):
            positions = np.asarray(batch.positions)  # distinct in a batch, so += counts
            self.steps[positions[is_step]] += 1
            self.episodes[positions[is_step & done]] += 1
            self.step_latencies_s.append(elapsed_s)

    def latencies(self) -> np.ndarray:
        """The recent round trips of the worker's steps, in seconds: its own and the vector's."""
        own = np.asarray(self.step_latencies_s, dtype=np.float64)
        if self.vector is None:
            return own
        return np.concatenate([own, self.vector.latencies.recent()])

    def flush(self) -> None:
        """Bring steps and episodes up to date (a vector's data plane counts them lazily)."""
        if self.vector is not None:
            self.vector.flush()

    def row(self, position: int) -> dict[str, Any]:
        """What ``MultiEnv.stats()`` reports for the env at ``position``."""
        self.flush()
        latencies = self.latencies()
        p50, p99 = np.percentile(latencies, [50, 99]) if latencies.size else (np.nan, np.nan)
        return {
            "steps": int(self.steps[position]),
            "episodes": int(self.episodes[position]),
            "restarts": self.restarts,
            "recycles": self.recycles,
            "last_failure": self.last_failure,
            "step_latency_p50_s": float(p50),
            "step_latency_p99_s": float(p99),
        }

    def note_latency(self, elapsed_s: float) -> None:
        """A planned step came back clean; its counts are the vector's (``VectorCounters``)."""
        self.step_latencies_s.append(elapsed_s)

    def note_failure(self, cause: str) -> None:
        """The worker died (or was killed) with this cause."""
        self.last_failure = cause

    def note_restart(self) -> None:
        """A new worker replaces the dead one."""
        self.restarts += 1

    def note_recycle(self) -> None:
        """A fresh worker replaced this one at an episode boundary."""
        self.recycles += 1

    def note_spawn(self) -> None:
        """A new worker starts: budgets count from here."""
        self.flush()
        self._born_at = (int(self.steps.sum()), int(self.episodes.sum()))

    def since_spawn(self) -> tuple[int, int]:
        """Steps and episodes of the current worker's envs since it started."""
        self.flush()
        if len(self.steps) == 1:
            steps, episodes = int(self.steps[0]), int(self.episodes[0])
        else:
            steps, episodes = int(self.steps.sum()), int(self.episodes.sum())
        return steps - self._born_at[0], episodes - self._born_at[1]


class LatencyRing:
    """The latest round trips of a vector's data-plane steps, one per step for all workers.

    A list, not an array: keeping one is a list store (``values[count % size] = ...``), which
    costs a tenth of a numpy item store on every step.

    Args:
        size: How many are kept.
    """

    def __init__(self, size: int = _LATENCY_WINDOW) -> None:
        """Start empty."""
        self.total_s = 0.0  # the data plane's step latencies, summed (``MultiEnv.timing``)
        self.values = [0.0] * size
        self.size = size
        self.count = 0

    def recent(self) -> np.ndarray:
        """The round trips kept, in no order."""
        return np.asarray(self.values[: min(self.count, self.size)], dtype=np.float64)


class VectorCounters:
    """Every env's steps and episodes in one array each, for a vector that plans its steps.

    Args:
        num_envs: How many envs the vector has.
    """

    def __init__(self, num_envs: int) -> None:
        """Start from zero; ``adopt`` takes each worker's counts over."""
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.episodes = np.zeros(num_envs, dtype=np.int64)
        self.latencies = LatencyRing()
        # Writes the counts a data plane holds back into steps and episodes (``flush``).
        self.pending: Callable[[], None] | None = None

    def flush(self) -> None:
        """Bring steps and episodes up to date; before they are read."""
        if self.pending is not None:
            self.pending()

    def adopt(self, stats: WorkerStats, index: slice) -> None:
        """Make a worker's counters views of envs ``index`` of the vector's, keeping counts."""
        self.steps[index], self.episodes[index] = stats.steps, stats.episodes
        stats.steps, stats.episodes = self.steps[index], self.episodes[index]
        stats.vector = self

    def note_planned(
        self, index: slice | np.ndarray, is_reset: np.ndarray, done: np.ndarray
    ) -> None:
        """Count envs ``index`` of a planned step that came back clean (``done``: ended)."""
        stepped = ~is_reset
        self.steps[index] += stepped
        self.episodes[index] += stepped & done

    def note_batches(self, ids: np.ndarray, is_reset: np.ndarray | None, done: np.ndarray) -> None:
        """Count several planned batches that came back clean, at once.

        ``ids``: their envs, an env as often as it came; ``is_reset``: whether each reset
        instead of stepping (None: none did); ``done``: whether each ended.
        """
        if is_reset is not None:
            stepped = ~is_reset
            ids, done = ids[stepped], done[stepped]
        size = len(self.steps)
        self.steps += np.bincount(ids, minlength=size)
        self.episodes += np.bincount(ids[done], minlength=size)

    def note_window(self, ended: np.ndarray, resets_due: np.ndarray | None) -> None:
        """Count a window of planned steps of every env that all came back clean.

        ``ended``: per step of the window and env, whether the step ended its episode.
        ``resets_due``: under next-step autoreset, the envs that reset (instead of
        stepping) in the window's first step; it becomes those due after the window. None:
        no step of the window resets an env. An env steps in every step but those in which
        it resets: under next-step autoreset, those that follow a step that ended its
        episode. So its steps are the window's length, less the ends of its steps but the
        last, plus the resets due at its start.
        """
        ends = ended.sum(axis=0, dtype=np.int64)
        self.episodes += ends
        if resets_due is None:
            self.steps += len(ended)
            return
        self.steps += len(ended) - ends + ended[-1] - resets_due
        resets_due[:] = ended[-1]

    def note_steps(self, done: np.ndarray) -> None:
        """Count a planned step in which every env stepped and came back clean."""
        self.steps += 1
        self.episodes += done
