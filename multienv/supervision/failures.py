"""PARENT SIDE, backend-neutral: what a worker's failures become in the parent.

``RestartLedger`` keeps one worker's deaths against its ``RestartPolicy``: how long to back
off before the next respawn, the failure log, and the ``EnvCrashLoopError`` (or
``EnvCrashedError`` under ``RestartPolicy.never()``) once the budget is spent.
``remote_error`` turns an exception raised by env code in the worker into the ``EnvError``
the caller sees, with the worker's traceback chained.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

import gymnasium as gym

from multienv.errors import EnvCrashedError, EnvCrashLoopError, EnvError, env_error_class
from multienv.restart import RestartPolicy
from multienv.supervision.log_limit import failure_log
from multienv.wire.protocol import Command, RemoteFailure, RemoteTraceback

logger = logging.getLogger(__name__)

_EARLY_EXIT_HINT = (
    "\nA worker that exits before multienv's worker code runs in it, for example while it "
    "imports your script, writes to this process's stderr instead: look above. If your "
    'script creates envs at its top level, move that under `if __name__ == "__main__":`.'
)


class RestartLedger:
    """One worker's deaths, counted against its ``RestartPolicy``.

    Args:
        policy: The restart budget.
        env_indices: The vector's index of each of the worker's envs (the supervisor's list,
            which a vector renumbers), for messages.
    """

    def __init__(self, policy: RestartPolicy, env_indices: Sequence[int]) -> None:
        """No death yet."""
        self.policy = policy
        self._env_indices = env_indices
        self._restart_times: list[float] = []
        self._consecutive = 0  # respawns since the last successful call
        self._deaths = 0  # over the worker's whole life, for the failure log
        self._has_completed_a_call = False  # ever, by any of its workers

    @property
    def deaths_in_a_row(self) -> int:
        """Deaths since the last call that succeeded (a crash loop forming from 2 on)."""
        return self._consecutive

    def note_success(self) -> None:
        """A call succeeded: the next death starts a new run of respawns (no backoff)."""
        self._consecutive = 0
        self._has_completed_a_call = True

    def record_death(
        self, pid: int | None, cause: str, stderr_tail: Callable[[], tuple[str, ...]]
    ) -> float | EnvCrashedError:
        """Count a death: the seconds to back off before respawning, or the error to raise."""
        now = time.monotonic()
        policy = self.policy
        delay = policy.next_delay(self._restart_times, now, self._consecutive)
        if delay is None:
            return self._crash_error(pid, cause, stderr_tail())
        self._restart_times = [*policy.recent(self._restart_times, now), now]
        self._consecutive += 1
        self._deaths += 1
        what = "timed out and was killed" if cause == "timeout" else f"died ({cause})"
        failure_log.report(
            env_index=self._env_indices[0],
            failure_number=self._deaths,
            cause=cause,
            message=f"{envs_text(self._env_indices)}: worker pid {pid} {what}; respawning "
            f"({len(self._restart_times)}/{policy.max_restarts} in {policy.window_s:g} s)",
            deaths_in_a_row=self._consecutive,
        )
        return delay

    def _crash_error(self, pid: int | None, cause: str, tail: tuple[str, ...]) -> EnvCrashedError:
        policy = self.policy
        stderr_text = "\n".join(tail) if tail else "(nothing)"
        if not tail and cause.startswith("exit code"):
            stderr_text += _EARLY_EXIT_HINT
        env_index = self._env_indices[0]
        hosted = "" if len(self._env_indices) == 1 else f" hosting {envs_text(self._env_indices)}"
        if policy.is_never:
            return EnvCrashedError(
                f"env {env_index}: worker (pid {pid}){hosted} died ({cause}) and "
                "RestartPolicy.never() is set; its last stderr lines follow. Fix the crash, or "
                f"allow respawns: restart_policy=RestartPolicy() in MultiEnv.\n{stderr_text}",
                env_index=env_index,
            )
        deaths = len(policy.recent(self._restart_times, time.monotonic())) + 1
        budget = (
            f"{deaths} times in {policy.window_s:g} s (RestartPolicy "
            f"max_restarts={policy.max_restarts}, window_s={policy.window_s:g}); "
            f"last cause {cause}"
        )
        if self._has_completed_a_call:
            advice = (
                "its last stderr lines follow. Fix the crash, or allow more respawns: "
                f"restart_policy=RestartPolicy(max_restarts={max(20, 4 * policy.max_restarts)}"
                f", window_s={policy.window_s:g}) in MultiEnv (from multienv import "
                "RestartPolicy)."
            )
        else:  # a bug in the env or its setup, which no budget outlives
            advice = (
                "no call to it ever completed: it fails on every start, and more respawns "
                "will not mend that. Fix the crash; its last stderr lines follow."
            )
        error = EnvCrashLoopError(
            f"env {env_index}: worker{hosted} died {budget}; {advice}\n{stderr_text}",
            env_index=env_index,
            restarts=deaths,
            cause=cause,
            stderr_tail=tail,
        )
        # One line: the caller gets the error, which says the rest once.
        logger.error(
            "%s: restart budget spent (%d deaths in %g s, last cause %s): %s raised",
            envs_text(self._env_indices),
            deaths,
            policy.window_s,
            cause,
            type(error).__name__,
        )
        return error


def remote_error(
    failure: RemoteFailure, name: str, env_index: int, pid: int | None, advice: str
) -> EnvError:
    """The ``EnvError`` for an exception env code raised in the worker, traceback chained.

    Args:
        failure: The exception, as the worker packaged it.
        name: The call that raised (``step``, ``reset``, ...).
        env_index: The env that raised.
        pid: The worker's process id.
        advice: What the caller can do now.
    """
    remote = RemoteTraceback(failure.traceback)
    cause: BaseException = failure.exception if failure.exception is not None else remote
    if cause is not remote:
        cause.__cause__ = remote
    error_class = env_error_class(
        type(failure.exception) if failure.exception is not None else None
    )
    call = "env_fn" if name == "initialize" else f"{name}()"
    error = error_class(
        f"env {env_index}: {call} raised {failure.type_name} in its worker (pid {pid}): "
        f"{failure.message}; the env's traceback is chained to this error (its __cause__). "
        f"{advice}",
        env_index=env_index,
    )
    error.__cause__ = cause
    return error


def call_advice(command: Command) -> str:
    """What an ``EnvError`` of a call on a live worker advises, by the call."""
    if command is Command.MEASURE:  # the probe of envs_per_worker="auto"
        return (
            "envs_per_worker='auto' times env 0's reset and its steps of random actions "
            "(action_space.sample()); give an int envs_per_worker instead."
        )
    return "The worker is still alive."


def registration_hint(failure: RemoteFailure) -> str:
    """Advice for an env id the worker does not know but this process does; else "".

    Workers import the user's script without running its ``__main__`` block, so an id
    registered there (``gym.register``, ``gym.register_envs(ale_py)``) exists only here.
    """
    exc = failure.exception
    if not isinstance(exc, gym.error.UnregisteredEnv):
        return ""
    text = str(exc)
    specs = list(gym.registry.values())
    namespace = re.search(r"Namespace (\S+) not found", text)
    name = re.search(r"Environment `([^`]+)` doesn't exist", text)
    version = re.search(r"version `v(\d+)` for environment `([^`]+)`", text)
    if namespace:
        known = any(spec.namespace == namespace[1] for spec in specs)
    elif name:
        known = any(spec.name == name[1] for spec in specs)
    elif version:
        known = any(s.name == version[2] and s.version == int(version[1]) for s in specs)
    else:
        known = False
    if not known:
        return ""
    return (
        " The env id is registered in this process but not in the worker, which imports "
        'your script without running its `if __name__ == "__main__":` block: register it '
        "at module level, or inside env_fn (e.g. `gym.register_envs(ale_py)` next to the "
        "imports)."
    )


def envs_text(env_indices: Sequence[int]) -> str:
    """``env 3`` or ``envs 3-5``: a worker's envs, for messages."""
    first, last = env_indices[0], env_indices[-1]
    return f"env {first}" if len(env_indices) == 1 else f"envs {first}-{last}"
