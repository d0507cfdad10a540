"""PARENT SIDE, subprocess backend: one thread forwards every worker's stderr to ours.

A worker's fd 2 is the write end of a pipe whose read end the parent hands to ``relay``.
One thread per process reads all those pipes (``selectors``), writes what it reads to the
parent's own stderr, and keeps each worker's last lines for crash reports
(``StderrPipe.tail``). It starts with the first worker. One thread per worker used to do
this: starting 16 of them took 9-13 ms of a later vector's start-up, a fifth of it.

It forwards whole lines, so that the output of workers writing at once never interleaves
within a line. A worker's crash dump (``faulthandler``'s, from ``Fatal Python error:`` to
the pipe's end) is written as one block when the worker is gone, and only the first
``_DUMPS_SHOWN`` of the process are, each cut to its first line and the frames of the code
that crashed (see below): a crash loop of many workers would otherwise bury its
``EnvCrashLoopError`` (which carries the worker's last lines anyway) under hundreds of
dumps. A worker that replaces one of a crash loop (the third in a row and later) forwards
nothing: what it says is most likely what the two before it said, and its last lines come
with the error. ``MULTIENV_WORKER_STDERR`` chooses, read when each worker starts:
``limited`` (the default, as above), ``all`` (every line, every dump in full, from every
worker), ``off`` (nothing forwarded; the last lines are still kept), or a file path
(everything appended to that file instead of stderr).

The last lines kept for a crash report (``StderrPipe.last_lines``) are the env's own
lines, then the dump cut to its first line and the frames of the code that crashed: the
whole dump grew from some 20 lines to 60 and more on CPython 3.14 (a C stack, the
extension modules), which pushed what the env printed out of any tail of fixed length.
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import threading
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger(__name__)

_DUMP_START = b"Fatal Python error: "  # faulthandler's first line
_DUMPS_SHOWN = 3  # crash dumps forwarded per process by default; the others held back
_DUMP_LINES = 200  # lines of a dump kept to forward whole (the setting "all" keeps all)
_DUMP_FRAMES = 6  # frames of the crashed thread kept in last_lines, outside multienv
# The crashed thread's Python stack: "Stack (most recent call first):" (one thread) or
# "Current thread 0x7f... (most recent call first):", never the C stack of CPython 3.14.
_STACK_HEADER = re.compile(r"^(Stack|Current thread 0x[0-9a-fA-F]+)\b.*most recent call first")
_FRAME = '  File "'
# multienv's own files, by the path its workers print (abspath: a symlink is not resolved)
_MULTIENV_FILES = f"{_FRAME}{Path(os.path.abspath(__file__)).parents[2]}{os.sep}"
SETTING = "MULTIENV_WORKER_STDERR"


class StderrPipe:
    """One worker's stderr pipe, read by the relay thread.

    Args:
        conn: The read end of the pipe; the relay closes it at EOF.
        tail_lines: How many of the last lines to keep.
    """

    def __init__(self, conn: Connection, tail_lines: int, is_quiet: bool = False) -> None:
        """Keep the pipe; ``relay`` registers it."""
        self.tail: deque[str] = deque(maxlen=tail_lines)  # the env's own, outside a dump
        self._conn = conn
        self._partial = b""
        self._dump: list[bytes] | None = None  # a crash dump being read, whole lines
        self._dump_summary: list[str] = []  # its first line and the crashed code's frames
        self._stack = "before"  # where the dump's reading is: before, in or after the stack
        self._setting = os.environ.get(SETTING, "limited").strip() or "limited"
        if is_quiet and self._setting == "limited":
            self._setting = "off"
        self._is_closed = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` s until the pipe is read to its end (the worker's fd 2 closed)."""
        self._is_closed.wait(timeout)

    def last_lines(self) -> tuple[str, ...]:
        """The worker's last lines for a crash report: its own, then its crash dump, cut.

        The dump keeps its first line (``Fatal Python error: Segmentation fault``) and the
        innermost frames of the crashed thread that are not multienv's own.
        """
        return (*self.tail, *self._dump_summary)

    def _read(self) -> bool:
        """Forward what the pipe holds, by whole lines; False at EOF (then ``_close`` it)."""
        try:
            chunk = os.read(self._conn.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            return False
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._forward(lines)
        return True

    def _forward(self, lines: list[bytes]) -> None:
        """Write these whole lines out, holding a crash dump back until the pipe's end."""
        out = []
        for line in lines:
            if self._dump is None and line.startswith(_DUMP_START):
                self._dump = []
            if self._dump is None:
                self.tail.append(line.decode(errors="replace"))
                out.append(line + b"\n")
                continue
            self._summarise(line.decode(errors="replace"))
            if len(self._dump) <= _DUMP_LINES or self._setting == "all":
                self._dump.append(line)
        if out:
            _write(self._setting, b"".join(out))

    def _summarise(self, line: str) -> None:
        """Keep the dump's first line and the crashed thread's frames outside multienv."""
        summary = self._dump_summary
        if not summary:
            summary.append(line)
        elif self._stack == "before":
            if _STACK_HEADER.match(line):
                self._stack = "in"
        elif self._stack == "in":
            if not line.startswith(_FRAME):
                self._stack = "after"
            elif (
                len(summary) <= _DUMP_FRAMES
                and not line.startswith(_MULTIENV_FILES)
                and not line.startswith(f"{_FRAME}<")  # "<string>", the server's -c
            ):
                summary.append(line)

    def _close(self) -> None:
        if self._partial:
            self._forward([self._partial])
            self._partial = b""
        if self._dump is not None:
            if self._setting == "limited":
                hint = f"  [crash dump cut to its frames outside multienv; {SETTING}=all shows it]"
                self._dump = [line.encode() for line in (*self._dump_summary, hint)]
            _write_dump(self._setting, self._dump)
            self._dump = None
        self._conn.close()
        self._is_closed.set()


_dumps = {"shown": 0, "held": 0}  # this process's crash dumps (one relay thread writes)


def _write_dump(setting: str, dump: list[bytes]) -> None:
    """Write one worker's crash dump as a block, if this process shows it; else count it."""
    if setting == "off":
        return
    if setting == "limited" and _dumps["shown"] >= _DUMPS_SHOWN:
        _dumps["held"] += 1
        if _dumps["held"] == 1:
            logger.warning(
                "worker crash dumps after the first %d are held back (each worker's last "
                "stderr lines still come with EnvCrashLoopError); set %s=all to see them all",
                _DUMPS_SHOWN,
                SETTING,
            )
        return
    _dumps["shown"] += 1
    _write(setting, b"".join(line + b"\n" for line in dump))


def _write(setting: str, data: bytes) -> None:
    """Forward worker output as ``setting`` says: to our stderr, nowhere, or to a file."""
    if setting == "off":
        return
    try:
        if setting in ("limited", "all"):
            os.write(2, data)
        else:
            with open(setting, "ab") as file:
                file.write(data)
    except OSError:
        pass  # our own stderr (or the file) is gone; keep collecting the tail


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


def relay(conn: Connection, tail_lines: int, *, is_quiet: bool = False) -> StderrPipe:
    """Forward the stderr pipe ``conn`` (its read end) to ours until EOF; keep its last lines.

    ``is_quiet``: keep the last lines without forwarding any, unless the setting is ``all``
    or a file (a crash loop's later workers).
    """
    global _relay  # noqa: PLW0603 - one relay thread per process
    pipe = StderrPipe(conn, tail_lines, is_quiet)
    with _lock:
        # A forked child inherits the object but not the thread, and shares the selector.
        if _relay is None or _relay.pid != os.getpid():
            _relay = _Relay()
        _relay.add(pipe)
    return pipe
