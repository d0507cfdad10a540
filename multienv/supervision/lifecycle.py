"""PARENT SIDE: the lifecycle of one worker and its envs: the states, and the way to ready.

``EnvState`` and its legal moves are owned here so that the supervisor and the env proxies
(readers) share one definition. ``WorkerLife`` is the only writer of a worker's state: it
spawns the worker, waits for its envs, and after a death respawns it under the
``RestartPolicy`` budget until one is ready, or moves to ``BROKEN``.
"""

from __future__ import annotations

import copy
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gymnasium.error import ClosedEnvironmentError

from multienv.errors import EnvCrashedError, EnvError, EnvStateError
from multienv.supervision.failures import RestartLedger, envs_text, registration_hint, remote_error
from multienv.supervision.handles import Death

if TYPE_CHECKING:
    from multienv.supervision.handles import WorkerHandle
    from multienv.supervision.worker_stats import WorkerStats
    from multienv.wire.protocol import EnvDescription, RemoteFailure

logger = logging.getLogger(__name__)


class EnvState(enum.Enum):
    """Lifecycle of one worker and its envs; legal moves are listed in TRANSITIONS."""

    CREATED = "created"  # object exists, no process yet
    STARTED = "started"  # worker alive, envs not built yet
    READY = "ready"  # initialize() succeeded; reset/step/call allowed
    BROKEN = "broken"  # restart budget spent; calls raise EnvCrashLoopError
    CLOSED = "closed"  # terminal; calls raise ClosedEnvironmentError


TRANSITIONS: dict[EnvState, frozenset[EnvState]] = {
    EnvState.CREATED: frozenset({EnvState.STARTED, EnvState.CLOSED}),
    # Any move back to STARTED is a respawn.
    EnvState.STARTED: frozenset(
        {EnvState.STARTED, EnvState.READY, EnvState.BROKEN, EnvState.CLOSED}
    ),
    EnvState.READY: frozenset({EnvState.STARTED, EnvState.BROKEN, EnvState.CLOSED}),
    EnvState.BROKEN: frozenset({EnvState.CLOSED}),
    EnvState.CLOSED: frozenset(),
}

# What to do when a call comes in the wrong state, by the state it came in.
HINTS: dict[EnvState, str] = {
    EnvState.CREATED: "call start() and initialize() first, or use create_subprocess_envs()",
    EnvState.STARTED: "call initialize() first",
    EnvState.READY: "{name}() may be called only once",
}


class WorkerLife:
    """One worker's state, and its way from spawn to ready: deaths respawn it under the budget.

    The supervisor decides what a death means for the call in flight; this class only gets a
    worker ready again (or gives up, ``BROKEN``). It is the only writer of the state.

    Args:
        handle: The transport to the worker.
        env_indices: The index of each of the worker's envs, by position, for messages.
        ledger: The restart budget and its log.
        stats: The worker's counters.
        init_timeout: Seconds the worker may take to build its envs.
        restart_on_error: An ``env_fn`` that raises is a death, not an ``EnvError``.
        on_spawn: Called after every spawn (the recycler's clock).
    """

    def __init__(
        self,
        handle: WorkerHandle,
        env_indices: list[int],
        ledger: RestartLedger,
        stats: WorkerStats,
        *,
        init_timeout: float | None,
        restart_on_error: bool,
        on_spawn: Callable[[], None],
    ) -> None:
        """No worker yet: the state is ``CREATED``."""
        self._handle = handle
        self._env_indices = env_indices
        self._ledger = ledger
        self._stats = stats
        self._init_timeout = init_timeout
        self._restart_on_error = restart_on_error
        self._on_spawn = on_spawn
        self.state = EnvState.CREATED  # written by set_state() only
        self.descriptions: list[EnvDescription] = []  # of the envs, once the worker is ready
        self.is_closing = threading.Event()
        self.is_abandoned = False  # abandon(): like is_closing, set without the Event's lock
        self._init_deadline: float | None = None
        self._broken_error: EnvCrashedError | None = None

    def require(self, wanted: EnvState, name: str, env_index: int) -> None:
        """Raise the error that explains why ``name()`` is not allowed now, if it is not."""
        state = self.state
        if state is wanted:
            return
        if state is EnvState.CLOSED:
            raise ClosedEnvironmentError(
                f"env {env_index}: {name}() called after close(); create a new env."
            )
        if state is EnvState.BROKEN and self._broken_error is not None:
            raise copy.copy(self._broken_error)
        hint = HINTS[state].format(name=name)
        raise EnvStateError(
            f"env {env_index}: {name}() called in state {state.name}; {hint}.",
            env_index=env_index,
        )

    def spawn(self, *, is_quiet: bool = False) -> None:
        """Launch a worker, which starts building its envs; returns without waiting.

        ``is_quiet``: it replaces a worker of a crash loop (see ``WorkerHandle.spawn``).
        """
        if self.is_abandoned:  # dropped while a thread was respawning it
            raise ClosedEnvironmentError(f"{self.envs_text()}: closed during a respawn.")
        self._handle.spawn(is_quiet=is_quiet)
        self._stats.note_spawn()
        self._on_spawn()
        self._init_deadline = (
            None if self._init_timeout is None else time.monotonic() + self._init_timeout
        )
        self.set_state(EnvState.STARTED)

    def become_ready(self) -> None:
        """Wait for the spawned worker's envs; respawn it until one is ready."""
        cause = self._handshake()
        if cause is None:
            self.set_state(EnvState.READY)
        else:
            self.respawn(cause)

    def respawn(self, cause: str) -> None:
        """Replace a dead worker, under the restart budget, until one is ready.

        Raises:
            EnvCrashLoopError: The budget is spent (``EnvCrashedError`` if it allows none).
        """
        began = time.perf_counter()
        try:
            while True:
                if self.is_closing.is_set() or self.is_abandoned:  # seen dying as it is closed
                    raise ClosedEnvironmentError(f"{self.envs_text()}: closed during a respawn.")
                self._bury(cause)
                # From the third worker of a crash loop on, its output (the same each time,
                # most likely) is kept for EnvCrashLoopError, not forwarded.
                self.spawn(is_quiet=self._ledger.deaths_in_a_row >= 2)
                next_cause = self._handshake()
                if next_cause is None:
                    self.set_state(EnvState.READY)
                    return
                cause = next_cause
        finally:
            self._stats.restart_s += time.perf_counter() - began

    def envs_text(self) -> str:
        """``env 3`` or ``envs 3-5``: the worker's envs, for messages."""
        return envs_text(self._env_indices)

    def set_state(self, new: EnvState, *, is_logged: bool = True) -> None:
        """Move to ``new``, which must be a legal move from the current state.

        ``is_logged=False`` for ``abandon``, which may not take the logging module's locks.
        """
        if new not in TRANSITIONS[self.state]:
            raise EnvStateError(
                f"{self.envs_text()}: illegal state move {self.state.name} -> {new.name}",
                env_index=self._env_indices[0],
            )
        if is_logged:
            logger.debug("%s: %s -> %s", self.envs_text(), self.state.name, new.name)
        self.state = new

    def abandon(self) -> bool:
        """Kill the worker now and move to ``CLOSED``, with no lock, log or wait; idempotent.

        For a worker whose vector or proxy was dropped without ``close()``: it runs from the
        garbage collector or at exit, in whatever thread that is. Returns whether there was
        anything to close.
        """
        if self.state is EnvState.CLOSED:
            return False
        self.is_abandoned = True
        self._handle.abandon()
        self.set_state(EnvState.CLOSED, is_logged=False)
        return True

    def _handshake(self) -> str | None:
        """Wait for the worker's envs; return a cause of death, or None when ready."""
        reply = self._handle.handshake(self._init_deadline)
        if isinstance(reply, Death):
            return reply.cause
        if reply.failure is not None:
            if self._restart_on_error:
                return f"error: {reply.failure.type_name}"
            advice = "The worker has exited; fix env_fn and build the envs again."
            advice += registration_hint(reply.failure)
            raise self.env_error(reply.failure, "initialize", reply.failure.position, advice)
        self.descriptions = reply.value
        return None

    def env_error(
        self,
        failure: RemoteFailure,
        name: str,
        position: int | None,
        advice: str = "The worker is still alive.",
    ) -> EnvError:
        """The ``EnvError`` for a failure in the worker, with its traceback chained."""
        env_index = self._env_indices[position if position is not None else 0]
        return remote_error(failure, name, env_index, self._handle.pid, advice)

    def _bury(self, cause: str) -> None:
        """Reap the dead worker, then wait out the backoff or raise if the budget is spent."""
        pid = self._handle.pid
        self._handle.kill()
        self._stats.note_failure(cause)
        delay = self._ledger.record_death(pid, cause, self._handle.stderr_tail)
        if isinstance(delay, EnvCrashedError):
            self._broken_error = delay
            self.set_state(EnvState.BROKEN)
            raise delay
        self._stats.note_restart()
        if delay and (self.is_closing.wait(delay) or self.is_abandoned):
            raise ClosedEnvironmentError(f"{self.envs_text()}: closed during a respawn.")
