"""PARENT SIDE and the MODULE SERVER: workers fork from a process that has the env's modules.

The forkserver preloads numpy, gymnasium and the user's script, but not what the env
factories import when they run (``gym.make("HalfCheetah-v5")`` imports mujoco and
Gymnasium's MuJoCo modules). Each worker then imports those into private memory: about 15
MiB per HalfCheetah worker. So the first worker of a process (or a probe that builds env 0
alone, for a vector with more workers than cores) reports the modules its envs
imported (``Reply.modules``), and the parent starts a *module server*: a process forked from
the forkserver (numpy and gymnasium already in it) that imports those modules and then
forks workers on request. Workers started after that (the rest of a vector, respawns,
recycles, later vectors) share the modules' pages and skip the imports.

It stays safe to fork from: it imports modules and builds no env; it refuses to serve
(and the parent keeps using the forkserver) if the imports started a thread. Before it
forks, it warms the worker's first-time code paths and freezes the garbage collector
(``worker.prepare_to_fork_workers``). It watches the parent's pid and exits when the parent
dies; its workers die with it (``PR_SET_PDEATHSIG``), whichever way it ends, and if it dies
while the parent lives they are respawned from the forkserver.

Wire, over a ``SOCK_SEQPACKET`` pair: the parent sends one pickled ``WorkerArgs`` with three
fds (the worker's pipe end, its stderr pipe, the write end of a status pipe); the server
answers with the child's pid, and writes the child's exit status into its status pipe
when it reaps it. The parent's ``ServedProcess`` reads that pipe, so it behaves like a
``multiprocessing.Process`` for the handle: ``sentinel``, ``exitcode``, ``join``, ``kill``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from multienv.protocol import OwnerWatch, worker_main, worker_module

logger = logging.getLogger(__name__)

_STATUS = struct.Struct("<i")  # an exit status: the code, or minus the signal
_READY = b"ready"
_REFUSED = b"refused"
_START_TIMEOUT_S = 60.0  # importing the env's modules in the server
_MAX_REQUEST = 64 * 1024  # bytes; one datagram. Larger factories start from the forkserver


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """``worker_main``'s arguments but the two pipe ends, which travel as fds."""

    env_fn_bytes: list[bytes]
    env_index: int
    parent_pid: int
    settings: Any


# ----------------------------------------------------------------- the server process


def serve(server_end: Any, modules: Sequence[str], owner_pid: int) -> None:
    """The module server: import ``modules``, then fork a worker per request until EOF.

    It exits when its owner (the parent) dies, and its workers with it: they ask for
    PR_SET_PDEATHSIG, and run no thread of their own to watch the owner.
    """
    sock: socket.socket = server_end
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C, as in workers
    try:
        owner_fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: each worker watches the owner itself
        owner_fd = -1
    for name in modules:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a module that fails is imported by each worker
            logger.debug("module server: importing %s failed", name)
    if threading.active_count() > 1:  # a thread would be copied half-way into every worker
        sock.send(_REFUSED)
        return
    worker_module().prepare_to_fork_workers()
    sock.send(_READY)
    status_fds: dict[int, int] = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock_fd = sock.fileno()
    watched = [sock_fd, wake_r] + ([owner_fd] if owner_fd >= 0 else [])
    while True:
        ready, _, _ = select.select(watched, [], [])
        if owner_fd in ready:
            return  # the owner died; PR_SET_PDEATHSIG ends the workers
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(status_fds)
        if sock_fd not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not message:
            return  # the parent closed it
        args: WorkerArgs = pickle.loads(message)
        child_fd, stderr_fd, status_fd = fds
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            server_fds = [wake_r, wake_w, status_fd, *status_fds.values()]
            if owner_fd >= 0:
                server_fds.append(owner_fd)
            _run_child(sock, server_fds, child_fd, stderr_fd, args, (server_pid, owner_fd >= 0))
        os.close(child_fd)
        os.close(stderr_fd)
        status_fds[pid] = status_fd
        sock.send(_STATUS.pack(pid))


def _reap(status_fds: dict[int, int]) -> None:
    """Write the exit status of every child that ended into its status pipe."""
    while status_fds:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                os.write(fd, _STATUS.pack(code))
            finally:
                os.close(fd)


def _watch_in_child(server_pid: int, is_watching: bool) -> OwnerWatch:
    """In the forked worker: die with the server; how it watches its owner (``OwnerWatch``).

    Without a pidfd of the owner in the server, the worker's own thread watches the owner.
    """
    if worker_module().exit_with_direct_parent(server_pid) and is_watching:
        return OwnerWatch.SERVER
    return OwnerWatch.THREAD


def _run_child(
    sock: socket.socket,
    server_fds: list[int],
    child_fd: int,
    stderr_fd: int,
    args: WorkerArgs,
    server: tuple[int, bool],
) -> None:
    """In the forked worker: drop the server's fds and signal set-up, then run the worker.

    ``server``: the server's pid, and whether it watches the owner.
    """
    code = 1
    try:
        watch = _watch_in_child(*server)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in server_fds:
            os.close(fd)
        worker_main(
            Connection(child_fd),
            Connection(stderr_fd, readable=False),
            args.env_fn_bytes,
            args.env_index,
            args.parent_pid,
            watch,
            args.settings,
        )
        code = 0
    except BaseException:  # noqa: BLE001 - reported on the worker's stderr, then the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ----------------------------------------------------------------- the parent's side


class ServedProcess:
    """A worker the module server forked, with the ``multiprocessing.Process`` calls used here.

    Args:
        pid: The worker's pid.
        status_fd: The read end of its status pipe (its sentinel).
        name: The process name, for messages.
    """

    def __init__(self, pid: int, status_fd: int, name: str) -> None:
        """Hold the status pipe, and a pidfd so that a signal never reaches a reused pid."""
        self.pid = pid
        self.name = name
        self.sentinel = status_fd
        self._exitcode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @property
    def exitcode(self) -> int | None:
        """The exit status once the worker ended (minus the signal that killed it), else None."""
        if self._exitcode is None and self.sentinel >= 0:
            if select.select([self.sentinel], [], [], 0)[0]:
                data = os.read(self.sentinel, _STATUS.size)
                # No status: the server died, and its workers with it (PR_SET_PDEATHSIG).
                self._exitcode = (
                    _STATUS.unpack(data)[0] if len(data) == _STATUS.size else -signal.SIGKILL
                )
        return self._exitcode

    def is_alive(self) -> bool:
        """Whether the worker has not ended yet."""
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the worker to end."""
        if self.exitcode is None and self.sentinel >= 0:
            select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        """SIGKILL the worker, unless it ended."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the worker, unless it ended."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        if self.exitcode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Release the status pipe and the pidfd."""
        for fd in (self.sentinel, self._pidfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.sentinel, self._pidfd = -1, None


class ModuleServer:
    """The parent's end of a running module server.

    Args:
        context: The forkserver context the server is forked from.
        modules: The module names it imports.
    """

    def __init__(self, context: BaseContext, modules: Sequence[str]) -> None:
        """Start the server and wait until it has imported the modules.

        Raises:
            OSError: It died, refused to serve, or took too long.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._process = context.Process(  # type: ignore[attr-defined]
            target=serve,
            args=(theirs, list(modules), os.getpid()),
            name="multienv-modules",
            daemon=True,
        )
        try:
            self._process.start()
        finally:
            theirs.close()
        ours.settimeout(_START_TIMEOUT_S)
        try:
            answer = ours.recv(64)
        except OSError:
            answer = b""
        ours.settimeout(None)
        if answer != _READY:
            self.close()
            raise OSError(f"the module server did not start ({answer!r})")
        self.modules = tuple(modules)
        atexit.register(ours.close)  # the server exits at EOF

    def launch(
        self, child_conn: Connection, stderr_write: Connection, args: WorkerArgs, name: str
    ) -> ServedProcess | None:
        """Fork a worker from the server; its pipe ends are duplicated into it.

        Returns None, sending nothing, when the pickled factories are too large for one
        request (the caller starts the worker from the forkserver).

        Raises:
            OSError: The server is gone (the caller falls back to the forkserver).
        """
        request = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        if len(request) > _MAX_REQUEST:
            return None
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                socket.send_fds(
                    self._sock, [request], [child_conn.fileno(), stderr_write.fileno(), status_w]
                )
                answer = self._sock.recv(_STATUS.size)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        if len(answer) != _STATUS.size:
            os.close(status_r)
            raise OSError("the module server is gone")
        return ServedProcess(_STATUS.unpack(answer)[0], status_r, name)

    def is_alive(self) -> bool:
        """Whether the server process still runs."""
        return bool(self._process.is_alive())

    def close(self) -> None:
        """Stop the server (its workers exit with it)."""
        self._sock.close()
        self._process.join(1.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(1.0)


@dataclasses.dataclass
class _ProcessState:
    """This process's module server: what the first report asked for, and the server."""

    pid: int = -1  # the process it belongs to (a forked child starts afresh)
    learned: tuple[BaseContext, list[str]] | None = None
    server: ModuleServer | None = None
    tried: bool = False


_lock = threading.Lock()
_state = _ProcessState()


def _here() -> _ProcessState:
    """The state of this process, forgetting the one of a process it was forked from."""
    if _state.pid != os.getpid():
        _state.pid, _state.learned, _state.server, _state.tried = os.getpid(), None, None, False
    return _state


def running() -> ModuleServer | None:
    """This process's module server, if it runs."""
    with _lock:
        server = _here().server
    return server if server is not None and server.is_alive() else None


def has_tried() -> bool:
    """Whether this process started (or tried to start) its module server."""
    with _lock:
        return _here().tried


def learn(context: BaseContext, modules: Sequence[str] | None, wait: bool) -> None:
    """A worker reported the modules its envs imported; the first report in a process counts.

    Only for workers started from the forkserver. ``wait``: start the server now (the first
    worker of a vector whose other workers wait for it). Otherwise it starts with the next
    worker launched (a respawn, a recycle, a later vector), so that a process whose workers
    all started already does not hold a server nobody forks from.
    """
    if context.get_start_method() != "forkserver" or not modules:
        return
    with _lock:
        state = _here()
        if state.learned is None:
            state.learned = (context, list(modules))
    if wait:
        for_launch()


def for_launch() -> ModuleServer | None:
    """The server to fork the next worker from: started now if modules were reported."""
    with _lock:
        state = _here()
        if not state.tried and state.learned is not None:
            state.tried = True
            context, modules = state.learned
            try:
                state.server = ModuleServer(context, modules)
                logger.info("module server: started with %d modules", len(modules))
            except OSError as exc:
                logger.warning("module server: %s; workers import their env's modules", exc)
        server = state.server
    return server if server is not None and server.is_alive() else None
