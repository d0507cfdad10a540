"""PARENT SIDE: keeps repeated worker-failure WARNING lines from burying a long run's output.

A chaos run, or a week-long run with a flaky env, respawns workers thousands of times; one
WARNING line each would drown the program's own progress output. ``FailureLog`` logs the
first ``first_per_env`` failures of each worker one by one (so the first failure of every env
is always seen, with its cause), then counts the rest and logs one summary line, at most
every ``summary_every_s`` seconds, with the counts by cause. Failures that follow each other
with no successful call in between (a crash loop forming) are logged one by one up to
``first_per_env`` in a row, then at the 4th, 8th, 16th... in a row, so that a crash loop
of 20 respawns is 6 lines; the crash-loop error itself is raised to the caller, and one
line about it logged at ERROR by the restart ledger, never counted here.

One ``FailureLog`` serves the whole parent process (``failure_log``); every supervisor and
handle reports to it. It is pure apart from the logger, with the clock injected.

Example:
    >>> import logging
    >>> now = [0.0]
    >>> log = FailureLog(logging.getLogger("demo"), first_per_env=2, clock=lambda: now[0])
    >>> def die(number):
    ...     return log.report(env_index=0, failure_number=number, cause="SIGKILL", message="died")
    >>> [die(number) for number in range(1, 5)]
    [True, True, False, False]
    >>> log.counts_by_cause()
    {'SIGKILL': 2}
    >>> now[0] = 61.0  # the next failure after a minute also logs the summary line
    >>> die(5), log.counts_by_cause()
    (True, {})
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable

_FIRST_PER_ENV = 3
_SUMMARY_EVERY_S = 60.0


class FailureLog:
    """Logs the first failures of each env, then one summary line per interval.

    Args:
        logger: Where the lines go (WARNING level).
        first_per_env: Failures of one env logged one by one before counting starts.
        summary_every_s: Least seconds between two summary lines.
        clock: Monotonic clock, injected for tests.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        first_per_env: int = _FIRST_PER_ENV,
        summary_every_s: float = _SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create an empty log; the first summary interval starts now."""
        self._logger = logger
        self._first_per_env = first_per_env
        self._summary_every_s = summary_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: collections.Counter[str] = collections.Counter()  # by cause, not yet told
        self._held_envs: set[int] = set()
        self._since = clock()

    def report(
        self,
        *,
        env_index: int,
        failure_number: int,
        cause: str,
        message: str,
        deaths_in_a_row: int = 1,
    ) -> bool:
        """Log one failure, or count it for the next summary line; True if a line was logged.

        Args:
            env_index: The first env of the failed worker, for the summary line.
            failure_number: How many times this worker has failed, this time included.
            cause: Short cause, e.g. ``"SIGKILL"`` or ``"timeout"``, for the summary counts.
            message: The full line to log when this failure is logged one by one.
            deaths_in_a_row: Failures of this worker since its last successful call, this
                one included: from 2 on, a crash loop may be forming, whose failures are
                logged one by one up to ``first_per_env`` in a row, then at each power of 2.
        """
        first = self._first_per_env
        in_a_row = deaths_in_a_row
        is_loop_logged = in_a_row > 1 and (in_a_row <= first or in_a_row & (in_a_row - 1) == 0)
        with self._lock:
            if is_loop_logged or failure_number <= first:
                if in_a_row == first:
                    after = 1 << first.bit_length()  # the next power of 2
                    message += (
                        f" (a crash loop: its next failures are logged at {after}, "
                        f"{2 * after}, {4 * after}... in a row)"
                    )
                elif failure_number == first:
                    message += (
                        f" (this worker's later failures are counted and logged once every "
                        f"{self._summary_every_s:g} s; a crash loop as it forms)"
                    )
                self._logger.warning("%s", message)
                self._summarize_if_due()
                return True
            self._held[cause] += 1
            self._held_envs.add(env_index)
            return self._summarize_if_due()

    def counts_by_cause(self) -> dict[str, int]:
        """Failures counted since the last summary line, by cause."""
        with self._lock:
            return dict(self._held)

    def flush(self) -> None:
        """Log the summary line now if any failure is waiting for one (e.g. at close)."""
        with self._lock:
            self._summarize()

    def _summarize_if_due(self) -> bool:
        if self._clock() - self._since < self._summary_every_s:
            return False
        return self._summarize()

    def _summarize(self) -> bool:
        now = self._clock()
        if not self._held:
            self._since = now
            return False
        by_cause = ", ".join(f"{cause} {count:,}" for cause, count in self._held.most_common())
        envs = sorted(self._held_envs)
        self._logger.warning(
            "%s more worker failures in the last %.0f s, each respawned: %s; envs %s",
            f"{sum(self._held.values()):,}",
            now - self._since,
            by_cause,
            _ranges(envs),
        )
        self._held.clear()
        self._held_envs.clear()
        self._since = now
        return True


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


failure_log = FailureLog(logging.getLogger("multienv"))


class NamedLastResort(logging.Handler):
    """Python's last-resort output for multienv's records, with the name and level in front.

    With no handler configured, Python prints a WARNING as its bare message, which reads as
    if the user's own code had printed it. This handler, on the ``multienv`` logger, prints
    ``multienv WARNING: <message>`` to stderr instead, and only then: once the program (or
    a framework) configures a handler on the way up, it prints nothing and theirs decides.
    """

    def __init__(self) -> None:
        """WARNING and above, as Python's own last resort."""
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("multienv %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        """Print the record if nothing else would handle it."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        stream = sys.stderr
        if stream is None:
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - as logging.StreamHandler: report, never raise
            self.handleError(record)


logging.getLogger("multienv").addHandler(NamedLastResort())
