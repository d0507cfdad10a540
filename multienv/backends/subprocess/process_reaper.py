"""PARENT SIDE, subprocess backend: stopping worker processes, now or in the background.

``stop_process`` is the one bounded stop of a worker: CLOSE, wait, terminate, kill, reap,
close its pipe. ``reaper`` stops retired workers (a recycle's old ones) on a thread of its
own, so that the step that swaps a worker never waits for the old one to exit.
"""

from __future__ import annotations

import queue
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from multienv.backends.subprocess.stderr_relay import StderrPipe
from multienv.wire.framing import encode, write_message
from multienv.wire.protocol import Command, Request

PIPE_ERRORS = (EOFError, BrokenPipeError, ConnectionResetError)
RETIRE_TIMEOUT_S = 5.0  # a retired worker may take this long to close its envs


def stop_process(
    process: BaseProcess,
    conn: Connection,
    stderr: StderrPipe | None,
    timeout_s: float,
    requests: Connection | None = None,
) -> None:
    """Ask a worker to close its envs and exit; kill it after ``timeout_s``; reap it.

    ``requests``: the pipe its requests travel on once it is attached, else ``conn``.
    """
    try:
        if process.exitcode is None:
            target = conn if requests is None else requests
            write_message(target.fileno(), encode(Request(Command.CLOSE, -1)))
    except (*PIPE_ERRORS, OSError, ValueError):
        pass
    try:
        process.join(max(0.0, timeout_s))
        if process.exitcode is None:
            process.terminate()
            process.join(1.0)
        if process.exitcode is None:
            process.kill()
            process.join(5.0)
    finally:
        conn.close()
        if requests is not None:
            requests.close()
        if stderr is not None and not sys.is_finalizing():
            # Its EOF arrives once the worker's fd 2 is closed, and the relay thread reads
            # it; while the interpreter finalizes, that daemon thread is frozen.
            stderr.join(1.0)
        if process.exitcode is not None:
            process.close()


def kill_now(process: BaseProcess) -> None:
    """SIGKILL a worker unless it has ended; no wait, no reaping, no lock (``abandon``)."""
    try:
        if process.exitcode is None:
            process.kill()
    except (OSError, ValueError, AttributeError):
        pass  # gone, closed, or never started: nothing to kill


class Reaper:
    """One thread that stops retired workers one after another, so that a swap never waits.

    Retiring a worker is a queue put; the thread starts with the first one.
    """

    def __init__(self) -> None:
        """Nothing runs until the first retirement."""
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def stop(
        self,
        process: BaseProcess,
        conn: Connection,
        stderr: StderrPipe | None,
        requests: Connection | None = None,
    ) -> threading.Event:
        """Queue a worker to be stopped (CLOSE, then killed after a while); set when gone."""
        gone = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="multienv-reaper", daemon=True
                )
                self._thread.start()
        self._queue.put((process, conn, stderr, requests, gone))
        return gone

    def _run(self) -> None:
        while True:
            process, conn, stderr, requests, gone = self._queue.get()
            try:
                stop_process(process, conn, stderr, RETIRE_TIMEOUT_S, requests)
            finally:
                gone.set()


reaper = Reaper()  # one per parent process: it only ever holds workers being stopped
