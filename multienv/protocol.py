"""The wire between parent and worker: commands, replies and remote errors; stdlib only.

Every request is a tuple ``(int(Command), payload)``; every reply is a tuple
``(int(Status), payload)``. Both are framed with ``Connection.send_bytes`` and plain
``pickle`` (``encode``/``decode``): multiprocessing's own ``send`` builds a ForkingPickler
per message and enum members pickle by class lookup, which together cost more than a
CartPole step. A worker sends one unsolicited reply when it starts: ``(OK,
EnvDescription)`` once the env is built, or ``(ERROR, RemoteFailure)`` if ``env_fn`` raised.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import pickle
from typing import Any


class Command(enum.IntEnum):
    """What the parent asks a worker to do."""

    RESET = 1  # payload: (seed, options)
    STEP = 2  # payload: (action, autoreset); with autoreset the worker resets a finished episode
    RENDER = 3  # payload: None
    CALL = 4  # payload: (name, args, kwargs)
    GET_ATTR = 5  # payload: name
    SET_ATTR = 6  # payload: (name, value)
    CLOSE = 7  # payload: None; the worker closes the env, replies and exits


class Status(enum.IntEnum):
    """Whether a request succeeded."""

    OK = 0
    ERROR = 1


@dataclasses.dataclass(frozen=True)
class EnvDescription:
    """What ``initialize()`` caches from the worker, so the parent never builds a throwaway env."""

    observation_space: Any
    action_space: Any
    metadata: dict[str, Any]
    render_mode: str | None
    spec: Any


@dataclasses.dataclass(frozen=True)
class RemoteFailure:
    """An exception raised by env code in the worker.

    Attributes:
        type_name: Qualified name of the exception type, e.g. ``"ValueError"``.
        message: ``str(exc)``.
        traceback: The worker's formatted traceback.
        exception: The exception itself when it could be pickled, else None.
    """

    type_name: str
    message: str
    traceback: str
    exception: BaseException | None


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of the re-raised exception."""

    def __init__(self, traceback_text: str) -> None:
        """Store the traceback text."""
        super().__init__(traceback_text)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        """Show the traceback as the worker printed it."""
        return "\n\nworker traceback:\n" + self.traceback_text


encode = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
decode = pickle.loads

WORKER_MODULE = "multienv.worker"


def worker_main(*args: Any) -> None:
    """Process target: import the worker module in the child and run its loop.

    The proxy names the worker through this function, so ``subprocess_env`` and ``worker``
    never import each other.
    """
    import importlib

    importlib.import_module(WORKER_MODULE).run_worker(*args)
