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
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
from gymnasium.error import ClosedEnvironmentError

from multienv.errors import ERRORS_OF_USER_CODE
from multienv.supervision.handles import SharedMemoryLink
from multienv.supervision.worker_stats import LatencyRing

if TYPE_CHECKING:
    from multienv.vector.fan_out import WorkerGroup

F = TypeVar("F", bound=Callable[..., Any])
_now = time.perf_counter
# A worker is named among the slowest when its median is this much over the median worker's
# (and by this many seconds at least): not for 0.01 ms of scheduling noise.
_SLOW = 1.25
_SLOW_BY_S = 0.1e-3


def clocked(method: F) -> F:
    """Add each call's duration to its vector's clock (``self._clock``, a ``CallClock``).

    An error of the user's code or env (``ERRORS_OF_USER_CODE``) leaves with its traceback
    cut here, as ``raised_here`` cuts it: a crash loop's went through some 80 of multienv's
    frames, one respawn and replay after another, which say nothing the message does not.
    """

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = _now()
        try:
            return method(self, *args, **kwargs)
        except ERRORS_OF_USER_CODE as exc:
            raise exc.with_traceback(None) from exc.__cause__  # multienv's frames left out
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
        # By worker, at the start: restarts, recycles, their seconds, and steps.
        self._counts: dict[int, tuple[int, int, float, float, int]] = {}

    def report(
        self,
        supervisors: Sequence[Any],
        env_ids: Sequence[Sequence[int]],
        reset: bool,
        batch_times: Sequence[np.ndarray] | None = None,
    ) -> TimingReport:
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
        stepped = set(range(len(supervisors)))
        for number, (supervisor, ids) in enumerate(zip(supervisors, env_ids, strict=True)):
            stats = supervisor.stats
            latencies = stats.latencies()
            p50, p99 = _percentiles(latencies)
            own = batch_times[number] if batch_times is not None else np.empty(0)
            own_p50, own_p99 = _percentiles(own)
            stats.flush()
            counts = (
                stats.restarts,
                stats.recycles,
                stats.restart_s,
                stats.recycle_s,
                int(stats.steps.sum()),
            )
            before = self._counts.get(number, (0, 0, 0.0, 0.0, 0))
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
            if counts[4] == before[4]:  # no step in the window: its latencies are older
                stepped.discard(number)
            if reset:
                self._counts[number] = counts
        key = (
            "batch_p50_s"
            if any(not math.isnan(w["batch_p50_s"]) for w in workers)
            else ("step_p50_s")
        )
        timed = [w for w in workers if w["worker"] in stepped and not math.isnan(w[key])]
        typical = float(np.median([w[key] for w in timed])) if timed else math.nan
        slow = [w for w in timed if w[key] >= _SLOW * typical and w[key] - typical >= _SLOW_BY_S]
        by_p50 = sorted(slow, key=lambda w: -float(w[key]))
        report = TimingReport(
            wall_s=wall_s,
            env_s=in_calls_s,
            policy_s=wall_s - in_calls_s,
            env_bound=in_calls_s / wall_s if wall_s > 0 else math.nan,
            restarts=sum(w["restarts"] for w in workers),
            recycles=sum(w["recycles"] for w in workers),
            lost_s=sum(w["lost_s"] for w in workers),
            slowest_workers=[w["worker"] for w in by_p50[:3]],
            workers=workers,
        )
        if reset:
            self._since = now
            self.in_calls_s = 0.0
            self._steps_s = self._steps.total_s
        return report


class TimingApi:
    """The methods that report a vector's steps and time; ``MultiEnv`` inherits them."""

    if TYPE_CHECKING:  # what they use of the vector
        closed: bool
        envs: list[Any]
        _groups: list[WorkerGroup]
        _link: Any
        _clock: CallClock

    def stats(self) -> list[dict[str, Any]]:
        """Per env: steps, episodes, restarts, recycles, last failure cause, latency p50/p99 (s).

        ``steps`` counts the env's own steps (its ``step`` calls, the transitions it made):
        under next-step autoreset (the default) the ``step()`` after an env's episode ended
        resets that env instead, and is not counted, so ``steps + episodes`` is the number of
        ``step()`` calls (one fewer while the last one ended an episode); under same-step
        autoreset, ``steps`` is the number of ``step()`` calls. The latency is the round
        trip of the step's batch to the env's worker. It can be read after ``close()`` too:
        a run's final counts.
        """
        return [
            {"env_index": env_index, **proxy.supervisor.stats.row(proxy.position)}
            for env_index, proxy in enumerate(self.envs)
        ]

    def timing(self, reset: bool = True) -> TimingReport:
        """Where the caller's time went since the vector was built or the last ``timing()``.

        Always on: each call that waits for the envs (``step``, ``reset``, ``send``,
        ``recv`` and their async halves) adds its own duration, with two clock reads.

        Example:
            >>> import gymnasium as gym, numpy as np
            >>> from multienv import MultiEnv
            >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 2) as envs:
            ...     _ = envs.reset(seed=0)
            ...     _ = envs.step(np.zeros(2, dtype=np.int64))
            ...     split = envs.timing()
            >>> 0.0 <= split["env_bound"] <= 1.0, len(split["workers"])
            (True, 2)

        Args:
            reset: Start a new window now (the default); False reads the window so far.

        Returns:
            ``wall_s`` (the window), ``env_s`` (the caller's time in the vector's calls),
            ``policy_s`` (the rest: the caller's own work between calls), ``env_bound``
            (``env_s / wall_s``), the ``restarts`` and ``recycles`` of the window and
            ``lost_s``, the time they took; ``slowest_workers`` (up to 3, slowest first, of
            the workers that stepped in the window and whose own median batch time, else
            median step latency, is at least 1.25x the median worker's and 0.1 ms over it:
            none when they are alike); and ``workers``: per worker,
            its ``env_ids``; ``step_p50_s`` and ``step_p99_s``, over its recent steps (a
            vector's one-pass steps share one latency for all its workers);
            ``batch_p50_s`` and ``batch_p99_s``, the worker's own time on its latest
            batches in shared memory, without the round trip (NaN where there are none);
            and its ``restarts``, ``recycles`` and ``lost_s``. A dict, whose ``str`` is a
            two-line summary: ``print(envs.timing())``.
        """
        if self.closed:  # its workers' batch times went with the shared memory
            raise ClosedEnvironmentError("MultiEnv.timing() called after close().")
        groups = self._groups
        link = self._link if isinstance(self._link, SharedMemoryLink) else None
        times = None if link is None else [link.batch_times(n) for n in range(len(groups))]
        return self._clock.report(
            [group.supervisor for group in groups],
            [group.env_ids for group in groups],
            reset,
            times,
        )


class TimingReport(dict[str, Any]):
    """``timing()``'s report: a dict, whose ``str`` is a short summary to print."""

    def __str__(self) -> str:
        """Two lines: where the time went, and the slowest workers' own batch times."""
        line = (
            f"{self['wall_s']:.2f} s: {self['env_bound']:.0%} in the vector's calls "
            f"({self['env_s']:.2f} s), {self['policy_s']:.2f} s in yours; "
            f"{_counted(self['restarts'], 'restart')}, {_counted(self['recycles'], 'recycle')} "
            f"({self['lost_s']:.2f} s lost)"
        )
        slowest = []
        for number in self["slowest_workers"]:
            worker = self["workers"][number]
            p50 = worker["batch_p50_s"]
            if math.isnan(p50):
                p50 = worker["step_p50_s"]
            slowest.append(f"worker {number} (envs {worker['env_ids']}) {p50 * 1e3:.2f} ms")
        if slowest:
            line += "\nslowest workers, median batch: " + ", ".join(slowest)
        return line


def _counted(count: int, noun: str) -> str:
    """``1 restart``, ``2 restarts``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _percentiles(times: np.ndarray) -> tuple[float, float]:
    """The median and the 99th percentile of ``times``; NaN for none."""
    if not times.size:
        return math.nan, math.nan
    p50, p99 = np.percentile(times, [50, 99])
    return float(p50), float(p99)
