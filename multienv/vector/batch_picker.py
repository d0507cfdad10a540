"""VECTOR API: ``recv(batch_size="auto")``: the loop picks its batch, by timing both.

A loop that keeps every env in flight and returns a batch of them at a time trades two
things. Whole batches (every env in flight) leave the envs idle while the policy runs, as
``step()`` does. Smaller batches let the other envs step while the policy runs on one
batch, but call the policy more often, and on a few cores the parent's extra passes take
CPU from the envs. Which wins depends on the policy's time per call against the envs'
time per batch, and no model of the machine predicted it well enough (``bench_actor.py``:
half batches ran 0.59x to 1.3x ``step()`` on 2 cores, by latency and env). So the picker
times both in the caller's own loop:

- it times whole batches and half batches (whole workers, so the batch stays on the parts
  plane) in turns, ``ROUNDS`` windows of each, interleaved so that a neighbour's load or
  the policy's warm-up weighs on both alike; a window lasts ``MEASURE_CALLS`` calls and
  ``MEASURE_S`` at least, its first ``SETTLE_CALLS`` not counted (the pipeline refills);
- it keeps half batches only when they returned ``MARGIN`` more env steps per second than
  whole ones did over all their windows: whole batches are ``step()``'s loop, the safe side
  of a tie;
- it holds that choice, and measures both again when the caller's time between calls
  (the policy, ``recv`` returning to ``recv`` called) has moved by ``DRIFT`` either way since
  the last measurement, or ``REMEASURE_S`` after it.

A window's rate is env steps returned over the wall time from the first counted call's
return to the last's, so the policy, ``send`` and the envs' waits are all in it: what the
caller's loop gets. ``MultiEnv.auto_batch`` says what was picked and why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

MEASURE_CALLS = 6  # counted calls in a window, at least
MEASURE_S = 0.08  # and this long, at least
ROUNDS = 3  # windows of each batch, in turns
SETTLE_CALLS = 2  # calls after a change of batch that a window does not count
MARGIN = 1.03  # half batches are kept when their rate is this much over whole ones'
DRIFT = 1.5  # the caller's time between calls moved this much: measure both again
REMEASURE_S = 30.0  # and measure both again this long after the last measurement


@dataclasses.dataclass(frozen=True)
class AutoBatch:
    """What ``recv(batch_size="auto")`` picked and why (``MultiEnv.auto_batch``).

    Attributes:
        batch_size: The batch it returns now, in envs (of those in flight then).
        in_flight: The envs in flight when it picked.
        whole_rate: Env steps per second the loop ran with whole batches; None until timed.
        half_rate: The same with half batches; None until timed.
        policy_s: The caller's median time between a ``recv`` returning and the next call.
        reason: The choice and why, in words.
    """

    batch_size: int
    in_flight: int
    whole_rate: float | None
    half_rate: float | None
    policy_s: float | None
    reason: str

    def __str__(self) -> str:
        """The reason."""
        return self.reason


class BatchPicker:
    """Times whole and half batches in the caller's loop and holds the faster (the module).

    Args:
        worker_size: Envs per worker: a half batch is whole workers.
        clock: Seconds, as ``time.perf_counter`` (which the tests replace).
    """

    def __init__(self, worker_size: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """Nothing timed: whole batches first."""
        self._clock = clock
        self._worker_size = max(1, worker_size)
        self._is_half = False
        self._phase = "measure"  # windows of each in turns; then "hold"
        self._windows = 0  # windows measured in this phase
        self._totals = {False: [0, 0.0], True: [0, 0.0]}  # by is_half: steps, seconds
        self._calls = 0  # calls in this window, the settling ones included
        self._steps = 0  # env steps returned by the window's counted calls
        self._began = 0.0  # when the window's first counted call returned
        self._returned_at: float | None = None  # when the last call returned
        self._outside: list[float] = []  # the window's times between calls
        self._rates: dict[bool, float] = {}
        self._policy_s: float | None = None  # the median outside time the choice rests on
        self._measured_at = 0.0
        self._in_flight = 0
        self.report: AutoBatch | None = None

    def size(self, in_flight: int) -> int:
        """The batch for this call, with ``in_flight`` envs in flight; notes when it began."""
        now = self._clock()
        if self._returned_at is not None:
            self._outside.append(now - self._returned_at)
        self._in_flight = in_flight
        return self._half(in_flight) if self._is_half else in_flight

    def wants_whole(self) -> bool:
        """Whether the next batch is every env in flight (a ``send`` of all may step them)."""
        return not self._is_half

    def _half(self, in_flight: int) -> int:
        """Half the envs in flight, in whole workers; all of them if that is one worker."""
        k = self._worker_size
        return max(k, in_flight // 2 // k * k) if in_flight > k else in_flight

    def returned(self, num_steps: int) -> None:
        """A call returned ``num_steps`` env steps: count them, and pick when a window ends."""
        now = self._clock()
        self._returned_at = now
        self._calls += 1
        if self._calls <= SETTLE_CALLS:
            self._began, self._steps = now, 0
            if self._calls == SETTLE_CALLS:
                self._outside.clear()
            return
        self._steps += num_steps
        elapsed = now - self._began
        if self._calls - SETTLE_CALLS < MEASURE_CALLS or elapsed < MEASURE_S:
            return
        outside = sorted(self._outside)
        policy_s = outside[len(outside) // 2] if outside else 0.0
        if self._phase == "hold":
            self._check_drift(policy_s, now)
            return
        total = self._totals[self._is_half]
        total[0] += self._steps
        total[1] += elapsed
        self._windows += 1
        if self._windows == 1:
            self._policy_s = policy_s
            if self._half(self._in_flight) >= self._in_flight:
                self._decide(now, "one worker's envs are in flight: half a batch is all")
                return
        if self._windows < 2 * ROUNDS:
            self._is_half = not self._is_half
            self._new_window()
            return
        for is_half, (steps, seconds) in self._totals.items():
            self._rates[is_half] = steps / seconds
        whole, half = self._rates[False], self._rates[True]
        self._is_half = half > MARGIN * whole
        faster = "half" if self._is_half else "whole"
        self._decide(
            now,
            f"{faster} batches ran faster in this loop: {half:,.0f} env steps/s with half "
            f"batches, {whole:,.0f} with whole ones, the caller {policy_s * 1e3:.2f} ms "
            "between calls",
        )

    def _check_drift(self, policy_s: float, now: float) -> None:
        """In a held choice's window: measure both again if the caller's time moved."""
        chosen = self._policy_s or 0.0
        moved = policy_s > DRIFT * chosen + 50e-6 or chosen > DRIFT * policy_s + 50e-6
        if moved or now - self._measured_at >= REMEASURE_S:
            logger.debug(
                "recv(batch_size='auto'): the caller's time between calls went from %.3g to "
                "%.3g ms; measuring whole and half batches again",
                chosen * 1e3,
                policy_s * 1e3,
            )
            self._measure()
        self._new_window()

    def _measure(self) -> None:
        """Time both batches again, whole ones first."""
        self._phase, self._is_half, self._windows = "measure", False, 0
        self._totals = {False: [0, 0.0], True: [0, 0.0]}
        self._rates.clear()

    def _decide(self, now: float, why: str) -> None:
        """Hold the batch picked now, and say why."""
        size = self._half(self._in_flight) if self._is_half else self._in_flight
        before = self.report
        self.report = AutoBatch(
            size,
            self._in_flight,
            self._rates.get(False),
            self._rates.get(True),
            self._policy_s,
            f"{size} of {self._in_flight} envs in flight: {why}",
        )
        if before is None or before.batch_size != size:
            logger.info("recv(batch_size='auto'): %s", self.report.reason)
        self._phase, self._measured_at = "hold", now
        self._new_window()

    def current(self) -> AutoBatch:
        """What is picked now; while the first windows are timed, whole batches, so saying."""
        if self.report is not None:
            return self.report
        size = self._half(self._in_flight) if self._is_half else self._in_flight
        return AutoBatch(
            size,
            self._in_flight,
            self._rates.get(False),
            None,
            None,
            f"{size} of {self._in_flight} envs in flight: timing whole and half batches",
        )

    def _new_window(self) -> None:
        self._calls, self._steps = 0, 0
        self._outside.clear()
