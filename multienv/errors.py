"""Exception hierarchy, raised in the parent process; imports nothing from multienv.

Every error carries ``env_index`` (``None`` when no single env is to blame), so a
training script can tell which env failed without parsing messages.
"""

from __future__ import annotations

from typing import Any


class MultiEnvError(Exception):
    """Base class: catch this to catch every error multienv raises."""

    def __init__(self, message: str, *, env_index: int | None = None) -> None:
        """Store the message and the index of the env it concerns."""
        super().__init__(message)
        self.env_index = env_index


class EnvStateError(MultiEnvError, RuntimeError):
    """The call is not allowed in the env's current state, e.g. ``step()`` before ``start()``."""


class EnvError(MultiEnvError):
    """The env raised inside its worker, which stays alive (unless it was building the env).

    ``__cause__`` is the original exception (or a ``RemoteTraceback`` when it could not be
    sent), whose own ``__cause__`` holds the worker's formatted traceback.

    Raised by ``MultiEnv.step`` / ``step_wait``, it carries the step's other results, since
    the other envs did step: ``results`` is the usual ``(obs, rewards, terminations,
    truncations, infos)`` of the whole batch, and ``failed_env_ids`` the envs that raised
    (their entries hold the observation they were on, reward 0 and no flags). Otherwise
    both are None.
    """

    results: tuple[Any, Any, Any, Any, dict[str, Any]] | None = None
    failed_env_ids: list[int] | None = None


class EnvCrashedError(MultiEnvError):
    """The worker died and respawning is off (``RestartPolicy.never()``)."""


class EnvCrashLoopError(EnvCrashedError):
    """The worker kept dying and the ``RestartPolicy`` budget is spent.

    Attributes:
        restarts: How many times the worker died inside the policy window.
        cause: The last cause of death, e.g. ``"SIGSEGV"``, ``"exit code 1"`` or ``"timeout"``.
        stderr_tail: The last lines the dead worker wrote to stderr.
    """

    def __init__(
        self,
        message: str,
        *,
        env_index: int | None = None,
        restarts: int = 0,
        cause: str = "",
        stderr_tail: tuple[str, ...] = (),
    ) -> None:
        """Store the message and the crash details."""
        super().__init__(message, env_index=env_index)
        self.restarts = restarts
        self.cause = cause
        self.stderr_tail = stderr_tail
