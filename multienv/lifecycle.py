"""PARENT SIDE: the lifecycle of one worker and its envs, as one enum and its legal moves.

Owned here so that the supervisor (the only writer) and the env proxies (readers) share one
definition; the supervisor's ``_set_state`` checks every move against ``TRANSITIONS``.
"""

from __future__ import annotations

import enum


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
