"""The wire between parent and worker: commands, replies and remote errors; stdlib only.

Every request is a tuple ``(int(Command), payload)``; every reply is a tuple
``(int(Status), payload)``, except on the shared-memory fast path below, where a step is a
four-byte request and a four-byte record on a shared "done" pipe. Each message
is framed with a 4-byte length
(``write_message`` / ``MessageReader``, straight on the socket's fd, so a small message costs
one system call each way) and pickled with plain ``pickle`` (``encode``/``decode``):
multiprocessing's own ``send`` builds a ForkingPickler per message and its ``recv_bytes``
reads twice, which together cost more than a CartPole step.

A worker sends one unsolicited reply when it starts: ``(OK, EnvDescription)`` once the env
is built, or ``(ERROR, RemoteFailure)`` if ``env_fn`` raised.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import pickle
import struct
from typing import Any


class Command(enum.IntEnum):
    """What the parent asks a worker to do."""

    RESET = 1  # payload: (seed, options, slot)
    STEP = 2  # payload: (action, autoreset, slot); autoreset: reset a finished episode at once
    RENDER = 3  # payload: None
    CALL = 4  # payload: (name, args, kwargs)
    GET_ATTR = 5  # payload: name
    SET_ATTR = 6  # payload: (name, value)
    CLOSE = 7  # payload: None; the worker closes the env, replies and exits
    ATTACH = 8  # payload: (BatchLayout, env_index); the memory file's and done pipe's fds follow


# Shared-memory fast path. A request whose first byte is below 0x80 is one of these raw
# messages, not a pickle (every pickle of protocol 2 or later starts with 0x80). Its
# observation, reward and flags travel in shared memory. The worker does not answer on its
# own pipe but writes a DONE record to a done pipe it shares with the other envs that one
# parent thread collects, so that thread collects many replies with one read. ``seq`` (1 to
# 255) tells a late record of a killed worker from the answer to the current request.
FAST_STEP = 0x01  # bytes([FAST_STEP, slot, autoreset, seq]); the action is in shared memory
FAST_RESET = 0x02  # bytes([FAST_RESET, slot, seq]); a reset with no seed and no options
DONE_RECORD = struct.Struct("<HBB")  # env_index, seq, DONE_OK or DONE_REPLY; atomic in a pipe
DONE_OK = 0  # everything is in shared memory
DONE_REPLY = 1  # a framed reply follows on the worker's own pipe (an info dict, an error)


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


_HEADER = struct.Struct("!I")


def frame(payload: bytes) -> bytes:
    """The bytes that carry ``payload`` on the wire: its length, then itself."""
    return _HEADER.pack(len(payload)) + payload


def write_message(fd: int, payload: bytes) -> None:
    """Write one message, however many writes it takes."""
    write_frame(fd, frame(payload))


def write_frame(fd: int, data: bytes) -> None:
    """Write bytes that ``frame()`` made; a small message takes one write."""
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


class MessageReader:
    """Reads framed messages from a socket fd; raises EOFError when the other end is gone.

    Args:
        fd: The socket to read; its owner closes it.
    """

    def __init__(self, fd: int) -> None:
        """Start with nothing buffered."""
        self._fd = fd
        self._buffer = b""

    def read(self) -> bytes:
        """Block until one whole message is in, and return its payload."""
        buffer = self._buffer
        while len(buffer) < _HEADER.size:
            buffer += self._read_some(65536)
        end = _HEADER.size + _HEADER.unpack_from(buffer)[0]
        if len(buffer) < end:
            parts, have = [buffer], len(buffer)
            while have < end:
                parts.append(self._read_some(end - have))
                have += len(parts[-1])
            buffer = b"".join(parts)
        self._buffer = buffer[end:]
        return buffer[_HEADER.size : end]

    def _read_some(self, size: int) -> bytes:
        chunk = os.read(self._fd, size)
        if not chunk:
            raise EOFError("the other end of the pipe closed")
        return chunk


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
