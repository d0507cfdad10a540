"""PARENT SIDE, subprocess backend: one thread forwards every worker's stderr to ours.

A worker's fd 2 is the write end of a pipe whose read end the parent hands to ``relay``.
One thread per process reads all those pipes (``selectors``), writes what it reads to the
parent's own stderr, and keeps each worker's last lines for crash reports
(``StderrPipe.tail``). It starts with the first worker. One thread per worker used to do
this: starting 16 of them took 9-13 ms of a later vector's start-up, a fifth of it.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections import deque
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


class StderrPipe:
    """One worker's stderr pipe, read by the relay thread.

    Args:
        conn: The read end of the pipe; the relay closes it at EOF.
        tail_lines: How many of the last lines to keep.
    """

    def __init__(self, conn: Connection, tail_lines: int) -> None:
        """Keep the pipe; ``relay`` registers it."""
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._conn = conn
        self._partial = b""
        self._is_closed = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` s until the pipe is read to its end (the worker's fd 2 closed)."""
        self._is_closed.wait(timeout)

    def _read(self) -> bool:
        """Forward what the pipe holds; False at EOF (then ``_close`` it)."""
        try:
            chunk = os.read(self._conn.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            return False
        try:
            os.write(2, chunk)
        except OSError:
            pass  # our own stderr is gone; keep collecting the tail
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self.tail.extend(line.decode(errors="replace") for line in lines)
        return True

    def _close(self) -> None:
        if self._partial:
            self.tail.append(self._partial.decode(errors="replace"))
            self._partial = b""
        self._conn.close()
        self._is_closed.set()


class _Relay:
    """The thread and its selector; new pipes reach it through a wake-up pipe."""

    def __init__(self) -> None:
        """Start the thread."""
        self.pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the thread all the same
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[StderrPipe] = []
        threading.Thread(target=self._run, name="multienv-stderr", daemon=True).start()

    def add(self, pipe: StderrPipe) -> None:
        with self._lock:
            self._new.append(pipe)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        selector = self._selector
        while True:
            for key, _ in selector.select():
                pipe: StderrPipe | None = key.data
                if pipe is None:
                    os.read(self._wake_r, 4096)
                    with self._lock:
                        new, self._new = self._new, []
                    for added in new:
                        selector.register(added._conn.fileno(), selectors.EVENT_READ, added)
                elif not pipe._read():
                    selector.unregister(key.fd)
                    pipe._close()


_lock = threading.Lock()
_relay: _Relay | None = None


def relay(conn: Connection, tail_lines: int) -> StderrPipe:
    """Forward the stderr pipe ``conn`` (its read end) to ours until EOF; keep its last lines."""
    global _relay  # noqa: PLW0603 - one relay thread per process
    pipe = StderrPipe(conn, tail_lines)
    with _lock:
        # A forked child inherits the object but not the thread, and shares the selector.
        if _relay is None or _relay.pid != os.getpid():
            _relay = _Relay()
        _relay.add(pipe)
    return pipe
