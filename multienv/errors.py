"""Exception hierarchy, raised in the parent process; imports nothing from multienv.

Where a Gymnasium vector env raises a given type (``NoAsyncCallError``, a
``multiprocessing.TimeoutError``, ``RuntimeError`` for mismatched spaces, the env's own
exception type), multienv's error is that type too, so code written for AsyncVectorEnv
catches it.

Every error carries ``env_index`` (``None`` when no single env is to blame), so a
training script can tell which env failed without parsing messages.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable
from typing import Any, TypeVar, cast

from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError, ResetNeeded


class MultiEnvError(Exception):
    """Base class: catch this to catch every error multienv raises."""

    def __init__(self, message: str, *, env_index: int | None = None) -> None:
        """Store the message and the index of the env it concerns."""
        super().__init__(message)
        self.env_index = env_index


class MissingMainGuardError(MultiEnvError, RuntimeError):
    """The user's script starts envs at its top level, with no ``__main__`` guard.

    Every worker process imports the script to find the env factories it defines, and
    would start envs again; raised before any worker starts.
    """


class EnvFnPickleError(MultiEnvError, TypeError):
    """An ``env_fn`` cannot be pickled with cloudpickle (it captured a lock, a socket, ...).

    Raised before any worker starts, naming the env; the pickler's own error is its cause.
    """


class EnvStateError(MultiEnvError, RuntimeError):
    """The call is not allowed in the env's current state, e.g. ``step()`` before ``start()``."""


class ResetNeededError(EnvStateError, ResetNeeded):
    """``step()`` before an env's first ``reset()``; Gymnasium's ``ResetNeeded`` too."""


class NoPendingCallError(EnvStateError, NoAsyncCallError):
    """A ``*_wait()`` without its ``*_async()``; Gymnasium's ``NoAsyncCallError`` too."""

    def __init__(self, message: str, name: str) -> None:
        """Store the message and the name of the call that was expected."""
        _init_gymnasium_error(self, NoAsyncCallError, message, name)


class PendingCallError(EnvStateError, AlreadyPendingCallError):
    """A call while an ``*_async()`` is pending; Gymnasium's ``AlreadyPendingCallError`` too."""

    def __init__(self, message: str, name: str) -> None:
        """Store the message and the name of the pending call."""
        _init_gymnasium_error(self, AlreadyPendingCallError, message, name)


def _init_gymnasium_error(
    error: MultiEnvError, gymnasium_class: type[Exception], message: str, name: str
) -> None:
    """Initialise an error that is also one of Gymnasium's, whose ``__init__`` takes ``name``.

    Not through ``MultiEnvError.__init__``: its ``super().__init__(message)`` reaches
    Gymnasium's ``__init__`` without ``name`` on CPython 3.14 and later, where
    ``RuntimeError`` no longer has an ``__init__`` of its own to stop the lookup at.
    """
    gymnasium_class.__init__(error, message, name)  # sets args and name
    error.env_index = None


class WaitTimeoutError(MultiEnvError, multiprocessing.TimeoutError, TimeoutError):
    """``step_wait`` / ``reset_wait`` / ``recv`` timed out; the call stays in flight.

    Both ``multiprocessing.TimeoutError`` (what AsyncVectorEnv raises) and the builtin
    ``TimeoutError`` catch it.
    """


class SpaceMismatchError(MultiEnvError, ValueError, RuntimeError):
    """The envs of a vector do not share their spaces (AsyncVectorEnv raises RuntimeError)."""


class EnvError(MultiEnvError):
    """The env raised inside its worker, which stays alive (unless it was building the env).

    ``__cause__`` is the original exception (or a ``RemoteTraceback`` when it could not be
    sent), whose own ``__cause__`` holds the worker's formatted traceback.

    Raised by ``MultiEnv.step`` / ``step_wait``, it carries the step's other results, since
    the other envs did step: ``results`` is the usual ``(obs, rewards, terminations,
    truncations, infos)`` of the whole batch, and ``failed_env_ids`` the envs that raised
    (their entries hold the observation they were on, reward 0 and no flags). Raised by
    ``MultiEnv.reset`` / ``reset_wait``, ``results`` is the reset's ``(obs, infos)``, the
    other envs reset. From ``recv``, each env that raised gets an ``EnvError`` of its own,
    one per ``recv`` call. Otherwise both are None.
    """

    results: tuple[Any, ...] | None = None
    failed_env_ids: list[int] | None = None


def env_error_class(remote_type: type[BaseException] | None) -> type[EnvError]:
    """``EnvError``, or for a builtin exception type a subclass of both.

    ``except ValueError`` then catches an env's ValueError, as it does with Gymnasium's
    AsyncVectorEnv; ``except EnvError`` still catches every env error.
    """
    if (
        remote_type is None
        or remote_type.__module__ != "builtins"
        or not issubclass(remote_type, Exception)
        or issubclass(remote_type, MultiEnvError)
    ):
        return EnvError
    cached = _ENV_ERROR_CLASSES.get(remote_type)
    if cached is None:
        try:
            name = f"EnvError[{remote_type.__name__}]"
            cached = type(name, (EnvError, remote_type), {"__str__": Exception.__str__})
            cached("", env_index=None)  # one whose __new__ or __init__ wants more arguments
        except TypeError:  # layouts that cannot be combined (OSError and friends), or
            cached = EnvError  # types that need more than a message (UnicodeDecodeError)
        _ENV_ERROR_CLASSES[remote_type] = cached
    return cached


_ENV_ERROR_CLASSES: dict[type[BaseException], type[EnvError]] = {}


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


# What the user's code or env did, told in full by the message: multienv's own frames
# between the public call and the raise say nothing more, so they are cut (``raised_here``).
ERRORS_OF_USER_CODE = (EnvError, EnvCrashedError, MissingMainGuardError, EnvFnPickleError)

F = TypeVar("F", bound=Callable[..., Any])


def raised_here(function: F) -> F:
    """Re-raise ``ERRORS_OF_USER_CODE`` from ``function`` with its traceback cut there.

    For public calls that build envs: the caller's traceback then ends at their own line
    and this one, not at a dozen of multienv's frames. Other errors keep every frame.
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ERRORS_OF_USER_CODE as exc:
            raise exc.with_traceback(None) from exc.__cause__  # multienv's frames left out

    return cast(F, wrapper)
