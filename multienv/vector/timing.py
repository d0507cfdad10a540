"""VECTOR API: where the caller's time goes: waiting for the envs, or between calls.

A training loop alternates two things: calls into the vector (``step``, ``recv``,
``reset``...), during which the caller waits for the envs, and its own work between them
(the policy, the learner). ``CallClock`` adds up the first, always on: two clock reads per
call, except on the healthy step, whose data plane times it already (from its wake-ups to
its results, summed in ``LatencyRing.total_s``) for one addition more.
``MultiEnv.timing()`` reports it against the wall time, with each worker's step latencies
and the time its restarts and recycles took, so that one question has a number: is this
run env-bound or policy-bound, and which workers are slow?
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from multienv.supervision.worker_stats import LatencyRing

F = TypeVar("F", bound=Callable[..., Any])
_now = time.perf_counter


def clocked(method: F) -> F:
    """Add each call's duration to its vector's clock (``self._clock``, a ``CallClock``)."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = _now()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._clock.in_calls_s += _now() - began

    return cast(F, timed)


class CallClock:
    """The caller's time inside the vector's calls, since it was built or last reported.

    Attributes:
        in_calls_s: Seconds spent in the vector's calls this window; each call adds its own.
    """

    def __init__(self, steps: LatencyRing) -> None:
        """The window starts now; ``steps``: the vector's data-plane step latencies."""
        self.in_calls_s = 0.0
        self._steps = steps
        self._steps_s = steps.total_s  # their sum when the window started
        self._since = time.perf_counter()
        self._counts: dict[int, tuple[int, int, float, float]] = {}  # by worker, at the start

    def report(
        self,
        supervisors: Sequence[Any],
        env_ids: Sequence[Sequence[int]],
        reset: bool,
        batch_times: Sequence[np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """The window's split, each worker's latencies and losses; a new window if ``reset``.

        Args:
            supervisors: The vector's workers' supervisors, by worker index.
            env_ids: Each worker's envs in the vector.
            reset: Start a new window now.
            batch_times: Each worker's own time on its latest batches, when it keeps them
                (in shared memory); None when none does.
        """
        now = time.perf_counter()
        wall_s = now - self._since
        in_calls_s = min(self.in_calls_s + self._steps.total_s - self._steps_s, wall_s)
        workers: list[dict[str, Any]] = []
        for number, (supervisor, ids) in enumerate(zip(supervisors, env_ids, strict=True)):
            stats = supervisor.stats
            latencies = stats.latencies()
            p50, p99 = _percentiles(latencies)
            own = batch_times[number] if batch_times is not None else np.empty(0)
            own_p50, own_p99 = _percentiles(own)
            counts = (stats.restarts, stats.recycles, stats.restart_s, stats.recycle_s)
            before = self._counts.get(number, (0, 0, 0.0, 0.0))
            workers.append(
                {
                    "worker": number,
                    "env_ids": list(ids),
                    "step_p50_s": float(p50),
                    "step_p99_s": float(p99),
                    "batch_p50_s": float(own_p50),
                    "batch_p99_s": float(own_p99),
                    "restarts": counts[0] - before[0],
                    "recycles": counts[1] - before[1],
                    "lost_s": counts[2] + counts[3] - before[2] - before[3],
                }
            )
            if reset:
                self._counts[number] = counts
        key = (
            "batch_p50_s"
            if any(not math.isnan(w["batch_p50_s"]) for w in workers)
            else ("step_p50_s")
        )
        timed = [w for w in workers if not math.isnan(w[key])]
        by_p50 = sorted(timed, key=lambda w: -float(w[key]))
        report = {
            "wall_s": wall_s,
            "env_s": in_calls_s,
            "policy_s": wall_s - in_calls_s,
            "env_bound": in_calls_s / wall_s if wall_s > 0 else math.nan,
            "restarts": sum(w["restarts"] for w in workers),
            "recycles": sum(w["recycles"] for w in workers),
            "lost_s": sum(w["lost_s"] for w in workers),
            "slowest_workers": [w["worker"] for w in by_p50[:3]],
            "workers": workers,
        }
        if reset:
            self._since = now
            self.in_calls_s = 0.0
            self._steps_s = self._steps.total_s
        return report


def _percentiles(times: np.ndarray) -> tuple[float, float]:
    """The median and the 99th percentile of ``times``; NaN for none."""
    if not times.size:
        return math.nan, math.nan
    p50, p99 = np.percentile(times, [50, 99])
    return float(p50), float(p99)
