"""PARENT SIDE, subprocess backend: starting a worker process, now or ahead as a standby.

``WorkerRecipe.launch`` starts one worker process (from the module server by default) with
a pipe for calls and one for its stderr, which ``stderr_relay`` forwards to ours while
keeping the last lines for crash reports. A ``Standby`` is a recycle's replacement worker,
launched, built and attached to the vector's shared memory on a thread of its own, so that
taking it over costs the step no wait. ``attach`` gives a worker its vector's shared
memory (``send_attach`` sends its first half ahead).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle
from typing import Any

from multienv.backends.subprocess import stderr_relay
from multienv.backends.subprocess.forking import forkserver, module_server
from multienv.backends.subprocess.forking.module_server_process import WorkerArgs
from multienv.backends.subprocess.process_reaper import PIPE_ERRORS, kill_now, stop_process
from multienv.backends.subprocess.stderr_relay import StderrPipe
from multienv.supervision.handles import Death
from multienv.wire import framing
from multienv.wire.framing import MessageReader, decode, encode
from multienv.wire.protocol import Command, OwnerWatch, Reply, Request, worker_main
from multienv.wire.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)

_STDERR_TAIL_LINES = 20  # the env's own last lines; a crash dump is kept apart, cut
_STANDBY_READY_S = 60.0  # a standby worker slower than this to build its envs is replaced
_STANDBY_LAUNCH_S = 10.0  # stop() waits this long for a standby's launch to finish

# What ``attach`` sends a worker: the ATTACH payload, the memory fd, its slice's done pipe
# fds (``done_pipes.DoneChannels.worker_fds``), its pid.
LinkPayload = tuple[Any, int, tuple[int, int, int], int]


@dataclasses.dataclass
class Launched:
    """A started worker process, with the parent's ends of its pipes.

    ``requests``: the pipe its requests travel on once attached (``attach``), else None.
    """

    process: BaseProcess
    conn: Connection
    reader: MessageReader
    stderr: StderrPipe
    requests: Connection | None = None

    def kill(self) -> None:
        """Stop a worker no one took over, at once: CLOSE, then kill, then reap."""
        stop_process(self.process, self.conn, self.stderr, 0.0, self.requests)


@dataclasses.dataclass(frozen=True)
class WorkerRecipe:
    """What starting one worker process takes.

    Attributes:
        context: The multiprocessing context to start the process with.
        env_fn_bytes: The cloudpickled factories of the worker's envs, by position.
        env_index: The index of the worker's first env, for names and messages.
        daemon: Start the worker as a daemon process.
        settings: Threads and CPU pinning for the worker process.
        is_probe: A worker that builds env 0 only to report the modules it imports: they
            start the module server at once, before the vector's workers are launched.
    """

    context: BaseContext
    env_fn_bytes: Sequence[bytes]
    env_index: int
    daemon: bool = True
    settings: WorkerSettings = dataclasses.field(default_factory=WorkerSettings)
    is_probe: bool = False

    def launch(self, *, is_quiet: bool = False) -> Launched:
        """Start the process (from the module server when it can); relay its stderr.

        ``is_quiet``: keep its stderr for the crash report without forwarding it, unless
        ``MULTIENV_WORKER_STDERR`` asks for every line.
        """
        parent_conn, child_conn = self.context.Pipe()
        stderr_read, stderr_write = self.context.Pipe(duplex=False)
        try:
            process = self._start(child_conn, stderr_write)
        finally:
            child_conn.close()
            stderr_write.close()
        stderr = stderr_relay.relay(stderr_read, _STDERR_TAIL_LINES, is_quiet=is_quiet)
        logger.info("env %d: started worker pid %d", self.env_index, process.pid)
        return Launched(process, parent_conn, MessageReader(parent_conn.fileno()), stderr)

    def _start(self, child_conn: Connection, stderr_write: Connection) -> Any:
        """Fork the worker from the module server if it can, else start it from the context."""
        name = f"multienv-worker-{self.env_index}"
        is_forkserver = self.context.get_start_method() == "forkserver"
        # Daemon workers only: a served worker cannot start processes of its own.
        server = module_server.for_launch() if self.daemon and is_forkserver else None
        if server is not None:
            args = WorkerArgs(
                list(self.env_fn_bytes),
                self.env_index,
                os.getpid(),
                self.settings,
                os.getcwd(),
                self.is_probe,
                dict(os.environ),
            )
            try:
                served = server.launch(child_conn, stderr_write, args, name)
                if served is not None:
                    return served
            except OSError as exc:  # the server died: the forkserver still works
                logger.warning("env %d: module server failed (%s); forkserver", self.env_index, exc)
        if is_forkserver:
            forkserver.ensure_running()  # multiprocessing's, started only when needed
        process = self.context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(
                child_conn,
                stderr_write,
                list(self.env_fn_bytes),
                self.env_index,
                os.getpid(),
                OwnerWatch.PDEATHSIG_AND_THREAD if is_forkserver else OwnerWatch.THREAD,
                self.settings,
            ),
            name=name,
            daemon=self.daemon,
        )
        process.start()
        return process


class Standby:
    """A recycle's replacement worker, started ahead by its waiter thread.

    The thread launches the process (a fork from the module server takes milliseconds, too
    long for the step that asks for it), waits for its envs and attaches it to the vector's
    shared memory, so that taking it over costs no wait.

    Args:
        recipe: How to start the worker.
        link_payload: What to attach the worker (by pid) to; None when not linked.
        is_closing: Set once the owner closes: the standby is then stopped, not used.
    """

    def __init__(
        self,
        recipe: WorkerRecipe,
        link_payload: Callable[[int], LinkPayload | None],
        is_closing: threading.Event,
    ) -> None:
        """Start the waiter thread."""
        self._recipe = recipe
        self._link_payload = link_payload
        self._is_closing = is_closing
        self._launched: Launched | None = None
        self._ready: Reply | None = None  # the worker's first reply; None if dead or slow
        self._is_abandoned = False  # abandon(): the waiter kills what it launches
        self._waiter = threading.Thread(
            target=self._run, name=f"multienv-standby-{recipe.env_index}", daemon=True
        )
        self._waiter.start()

    def take(self) -> tuple[Launched, Reply] | None:
        """The worker and its first reply, once ready; None (and it is stopped) if it failed."""
        self._waiter.join()  # at once if its envs are built: it started ahead
        launched, ready = self._launched, self._ready
        if launched is None:
            return None
        # Dead or stuck before it was ready, or died since: the taker starts afresh.
        if ready is None or launched.process.exitcode is not None:
            launched.kill()
            return None
        return launched, ready

    def stop(self) -> None:
        """Stop the standby, whatever it is doing."""
        launched = self._launched
        if launched is not None:  # closing its pipe also ends the waiter's wait
            launched.kill()
        self._waiter.join(_STANDBY_LAUNCH_S)
        if launched is None and self._launched is not None:  # it was being launched
            self._launched.kill()

    def abandon(self) -> None:
        """Kill the standby now if it was launched, else once it is; no wait (``abandon``)."""
        self._is_abandoned = True
        launched = self._launched
        if launched is not None:
            kill_now(launched.process)

    def _run(self) -> None:
        """Launch the worker, wait for its envs, attach it to the vector."""
        try:
            launched = self._recipe.launch()
        except Exception:
            logger.debug(
                "env %d: the standby worker did not start", self._recipe.env_index, exc_info=True
            )
            return
        self._launched = launched
        if self._is_abandoned:
            launched.kill()
            return
        if self._is_closing.is_set():
            return  # stop() stops it
        link = self._link_payload(launched.process.pid or 0)
        self._ready = _await_ready(launched, time.monotonic() + _STANDBY_READY_S, link)


def _await_ready(launched: Launched, deadline: float, link: LinkPayload | None) -> Reply | None:
    """A standby's first reply, unless it dies or ``deadline`` passes (then None).

    A worker of a vector with shared memory is attached to it here too (``link``).
    """
    fd, sentinel = launched.conn.fileno(), launched.process.sentinel
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(sentinel, select.POLLIN)

    def receive() -> Reply | Death:
        try:
            fds = [ready_fd for ready_fd, _ in poller.poll(poll_ms(deadline, time.monotonic()))]
            if fd in fds:
                reply: Reply = decode(launched.reader.read())
                return reply
        except (*PIPE_ERRORS, OSError, ValueError):  # dead, or stop() closed the pipe
            pass
        return Death("standby")  # died, or too slow: the taker starts a fresh worker

    ready = receive()
    if isinstance(ready, Death):
        return None
    if link is not None and ready.failure is None:
        attached = attach(launched.conn, link, receive)
        if isinstance(attached, Death):
            return None
        launched.requests = attached
    return ready


def send_attach(fd: int, link: LinkPayload) -> None:
    """The first half of ``attach``: the command, which the worker acks before the fds come.

    ``fd``: where the worker reads its requests (its pipe of requests once attached).
    """
    try:
        framing.write_message(fd, encode(Request(Command.ATTACH, -1, link[0])))
    except PIPE_ERRORS:
        pass  # the worker is dead; the next receive sees its sentinel


def attach(
    conn: Connection,
    link: LinkPayload,
    receive: Callable[[], Reply | Death],
    is_sent: bool = False,
    request_fd: int | None = None,
) -> Death | Connection:
    """Attach a worker to its vector's shared memory: the command, then the fds, each acked.

    The fds are the memory file, its slice's done pipes, and the read end of a new pipe
    for its requests: from the last ack on, the worker reads requests there, not on
    ``conn`` (a pipe's write and read cost two thirds of a socket's, on every step's
    wake-up), and ``conn`` carries its replies and fds. Returns that pipe's write end.

    ``is_sent``: the command was sent already (``send_attach``); wait for its ack.
    ``request_fd``: where the worker reads requests now; ``conn`` when None.
    """
    _, memory_fd, done_fds, pid = link
    if not is_sent:
        send_attach(conn.fileno() if request_fd is None else request_fd, link)
    reply = receive()
    if isinstance(reply, Death):
        return reply
    request_read, request_write = os.pipe()
    try:
        send_handle(conn, memory_fd, pid)
        for fd in (*done_fds, request_read):
            send_handle(conn, fd, pid)
    except (*PIPE_ERRORS, OSError):
        pass  # the worker is dead, or a standby's pipe was closed by stop(); receive() tells
    finally:
        os.close(request_read)
    requests = Connection(request_write, readable=False)
    reply = receive()
    if isinstance(reply, Death):
        requests.close()
        return reply
    return requests


def poll_ms(deadline: float | None, now: float) -> int | None:
    """The ``poll()`` timeout that ends at ``deadline`` (monotonic seconds); None waits forever."""
    return None if deadline is None else max(0, math.ceil((deadline - now) * 1000))
