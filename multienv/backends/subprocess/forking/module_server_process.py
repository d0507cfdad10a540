"""THE MODULE SERVER'S PROCESS: a fresh Python that imports once and forks workers on request.

``module_server`` (the parent's side) explains what it is for. This module is what
runs in it, and the wire both sides speak over a ``SOCK_SEQPACKET`` pair:

1. The parent spawns ``python -c`` with ``BOOTSTRAP``, passing its end of the pair and its
   ``sys.path``, and sends one pickled ``ServerStart``. The server imports numpy,
   gymnasium, multienv's worker, the ``preload`` modules and the user's script, warms and
   freezes what workers inherit, and answers ``READY``: or ``REFUSED`` if the imports
   started a thread, which would be copied half-way into every worker.
2. ``ImportRequest``: the modules a worker's envs imported (``Reply.modules``); the server
   imports them so that later workers share them, and answers ``READY``; or ``REFUSED`` if
   they started a thread: then it forks no more workers, and lives on for those it forked.
3. ``WorkerArgs`` with three fds (the worker's pipe end, its stderr pipe, the write end of
   a status pipe): the server forks the worker and answers with its pid. When it reaps the
   child, it writes its exit status (the code, or minus the signal) into the status pipe.
4. ``SpareRequest(count)``, not answered: keep ``count`` spares from now on (the most
   workers one vector has started). A spare is a worker forked ahead of its request, waiting
   on a socket of its own; a ``WorkerArgs`` then goes to a spare, with its fds, and the
   server answers at once instead of after a fork (2 to 8 ms each on these VMs, one after
   the other: most of a later vector's start-up at one env per worker). The server forks
   spares only after ``SPARE_IDLE_S`` without a request, one at a time, so never while a
   vector starts; and drops them whenever what workers inherit changes (an import, the
   objects made immortal), for spares forked before would not share it.

Workers forked after a probe share the server's objects without copying their pages: the
server makes them immortal (``fork_source.immortalize_and_freeze``) once it has forked the
first probe, while the probe builds env 0, and the env's modules' objects as it imports
them. Not before: that takes about 20 ms, which the first workers of a vector without a
probe would wait for, and not later: writing to the objects once workers share their pages
would copy them all into the server. Each time, it gives its heap's free pages back
(``worker.release_free_memory``), so that workers forked next do not inherit them.

It builds no env. It watches the parent through a pidfd and exits when the parent dies;
its workers die with it (``PR_SET_PDEATHSIG``), and run no thread of their own to watch the
parent. It exits at EOF on its socket, when the parent closes it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from multienv.backends.subprocess.forking.fork_source import (
    immortalize_and_freeze,
    import_main,
    import_modules,
    prepare_to_fork_workers,
    starts_envs_at,
)
from multienv.errors import MissingMainGuardError
from multienv.wire.framing import readable
from multienv.wire.protocol import OwnerWatch, worker_main, worker_module

logger = logging.getLogger(__name__)

STATUS = struct.Struct("<i")  # a pid, or an exit status: the code, or minus the signal
READY = b"ready"
REFUSED = b"refused"
MAIN_STARTS_ENVS = b"main-starts-envs:"  # then where: the script's file, line and code
MAX_REQUEST = 64 * 1024  # bytes; one datagram: factories and environment. Larger: forkserver
SPARE_IDLE_S = 0.2  # the server forks a spare only after this long without a request
MAX_SPARES = 64
BOOTSTRAP = (
    "import sys; sys.path[:] = sys.argv[2:]; "
    "from multienv.backends.subprocess.forking.module_server_process import main; "
    "main(int(sys.argv[1]))"
)
BASE_MODULES = ("numpy", "gymnasium", "cloudpickle", "multienv.worker.worker")
PROCESS_NAME = "multienv-server"  # its name in ps and top
SPARE_NAME = "multienv-spare"  # a spare's, until it becomes a worker


@dataclasses.dataclass(frozen=True)
class ServerStart:
    """What the server imports and who owns it: the parent's first message."""

    preload: list[str]
    main_path: str | None  # the user's script, imported as multiprocessing would
    argv: list[str]  # the parent's sys.argv, which the script may read at its top level
    owner_pid: int


@dataclasses.dataclass(frozen=True)
class ImportRequest:
    """Modules for the server to import before it forks more workers."""

    modules: list[str]


@dataclasses.dataclass(frozen=True)
class SpareRequest:
    """How many spares the server keeps from now on (``MAX_SPARES`` at most); no answer."""

    count: int


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """``worker_main``'s arguments but the two pipe ends, which travel as fds."""

    env_fn_bytes: list[bytes]
    env_index: int
    parent_pid: int
    settings: Any
    cwd: str  # the parent's working directory now: a worker starts in it
    is_probe: bool = False  # a worker that builds env 0 only to report its modules
    environ: dict[str, str] | None = None  # the parent's environment now: a worker gets it


def main(fd: int) -> None:
    """The server process: set up from the parent's ``ServerStart``, then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C, as in workers
    worker_module().set_process_name(PROCESS_NAME)
    with socket.socket(fileno=fd) as sock:  # closed at the end: a script may warn of it
        start: ServerStart = pickle.loads(sock.recv(1 << 20))
        sys.argv[:] = start.argv
        import_modules([*BASE_MODULES, *start.preload])
        failure = import_main(start.main_path)
        if isinstance(failure, MissingMainGuardError) and start.main_path is not None:
            # No worker would get further: the parent raises at once, with the line.
            sock.send(MAIN_STARTS_ENVS + starts_envs_at(failure, start.main_path).encode())
            return
        # A script that failed here fails again in each worker, which reports it.
        main_failed = None if failure is None else start.main_path
        if threading.active_count() > 1:
            sock.send(REFUSED)
            return
        prepare_to_fork_workers()
        sock.send(READY)
        serve(sock, start.owner_pid, main_failed)


def serve(sock: socket.socket, owner_pid: int, main_failed: str | None) -> None:
    """Answer the parent's requests until EOF, or until the owner dies."""
    try:
        owner_fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: each worker watches the owner itself
        owner_fd = -1
    try:
        _Server(sock, owner_fd, main_failed).serve()
    except (BrokenPipeError, ConnectionResetError):
        return  # the parent went while the server answered it


@dataclasses.dataclass(frozen=True)
class _Spare:
    """A worker forked ahead of its request: it waits for one on the other end of ``sock``."""

    pid: int
    sock: socket.socket


class _Server:
    """The server's state between requests: its children, and what it may still do."""

    def __init__(self, sock: socket.socket, owner_fd: int, main_failed: str | None) -> None:
        """Set up the wake-up pipe that SIGCHLD writes to, so that the poll sees deaths."""
        self.sock = sock
        self.owner_fd = owner_fd  # -1: no pidfd
        self.main_failed = main_failed
        self.status_fds: dict[int, int] = {}  # a child's pid: the pipe for its exit status
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.is_refusing = False  # a thread runs: forking now could copy a lock held by it
        self.is_shared = False  # all the objects are immortal (a probe came first)
        self.spares: list[_Spare] = []
        self.spare_count = 0  # how many spares to keep (``SpareRequest``)
        self.pid = os.getpid()  # what a child expects its parent to be

    def serve(self) -> None:
        """Fork, import and reap until EOF on the socket, or until the owner dies.

        Spares are forked when no request came for ``SPARE_IDLE_S``, one per turn of the
        loop, so that a request never waits for more than one fork.
        """
        sock_fd = self.sock.fileno()
        watched = [sock_fd, self.wake_r] + ([self.owner_fd] if self.owner_fd >= 0 else [])
        idle_s = SPARE_IDLE_S
        while True:
            wants_spare = len(self.spares) < self.spare_count and not self.is_refusing
            ready = readable(watched, idle_s if wants_spare else None)
            if not ready:
                self._fork_spare()
                idle_s = 0.0  # idle already: the next spare as soon as nothing is asked
                continue
            if self.owner_fd in ready:
                return  # the owner died; PR_SET_PDEATHSIG ends the workers
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self._reap()
            if sock_fd not in ready:
                continue
            idle_s = SPARE_IDLE_S
            message, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 3)
            if not message:
                return  # the parent closed it
            request = pickle.loads(message)
            if isinstance(request, ImportRequest):
                self._import(request)
            elif isinstance(request, SpareRequest):
                self.spare_count = max(self.spare_count, min(request.count, MAX_SPARES))
            elif self.is_refusing:  # the parent then starts the worker from the forkserver
                for fd in fds:
                    os.close(fd)
                self.sock.send(REFUSED)
            else:
                self._start_worker(message, request, fds)

    def _import(self, request: ImportRequest) -> None:
        self._drop_spares()  # forked before the import, they would not share it
        import_modules(request.modules)
        self.is_refusing = threading.active_count() > 1
        if not self.is_refusing:  # the new objects: pages no worker shares yet
            prepare_to_fork_workers(immortalize=True)
        self.sock.send(REFUSED if self.is_refusing else READY)

    def _start_worker(self, message: bytes, args: WorkerArgs, fds: list[int]) -> None:
        """Answer with the pid of a live spare, then hand it the request; or fork the worker.

        The answer goes first: a spare woken on the server's core often runs before it, and
        its start-up would delay the answer by milliseconds.
        """
        child_fd, stderr_fd, status_fd = fds
        spare = self._live_spare()
        if spare is not None:
            self.sock.send(STATUS.pack(spare.pid))
            self.status_fds[spare.pid] = status_fd
            try:
                socket.send_fds(spare.sock, [message], [child_fd, stderr_fd])
            except OSError:  # it died just now: the parent reads its death as a start's
                os.kill(spare.pid, signal.SIGKILL)
            spare.sock.close()  # what was sent stays readable on the spare's end
        else:
            pid = os.fork()
            if pid == 0:
                watch = self._leave_for_child([status_fd])
                _run_child((child_fd, stderr_fd), args, watch, self.main_failed)
            self.status_fds[pid] = status_fd
            self.sock.send(STATUS.pack(pid))
        os.close(child_fd)
        os.close(stderr_fd)
        if args.is_probe and not self.is_shared:  # no worker but the probe shares the pages
            self.is_shared = True
            self._drop_spares()
            immortalize_and_freeze(include_frozen=True)
            worker_module().release_free_memory()

    def _live_spare(self) -> _Spare | None:
        """Take a spare whose end of the socket is still open (it did not die); or None."""
        while self.spares:
            spare = self.spares.pop()
            if not readable([spare.sock.fileno()], 0):  # no EOF: it waits
                return spare
            spare.sock.close()
        return None

    def _fork_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:  # no memory or no pids left: keep the spares there are
            ours.close()
            theirs.close()
            self.spare_count = len(self.spares)
            return
        if pid == 0:
            ours.close()
            watch = self._leave_for_child([])
            _run_spare(theirs, watch, self.main_failed)
        theirs.close()
        self.spares.append(_Spare(pid, ours))

    def _drop_spares(self) -> None:
        """Close every spare's socket: each exits at EOF (and is reaped as any child)."""
        for spare in self.spares:
            spare.sock.close()
        self.spares.clear()

    def _leave_for_child(self, more_fds: list[int]) -> OwnerWatch:
        """In a forked child: drop the server's fds and signal set-up; die with the server."""
        watch = _watch_in_child(self.pid, self.owner_fd >= 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sock.close()
        for spare in self.spares:
            spare.sock.close()
        server_fds = [self.wake_r, self.wake_w, *more_fds, *self.status_fds.values()]
        for fd in server_fds + ([self.owner_fd] if self.owner_fd >= 0 else []):
            os.close(fd)
        return watch

    def _reap(self) -> None:
        """Write the exit status of every child that ended into its status pipe."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = self.status_fds.pop(pid, None)
            if fd is None:  # a spare (dropped, or killed before it was used)
                self.spares = [spare for spare in self.spares if spare.pid != pid]
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                os.write(fd, STATUS.pack(code))
            except BrokenPipeError:
                pass  # no reader: the parent is gone (its exit closed every status pipe)
            finally:
                os.close(fd)


def _adopt_environ(environ: dict[str, str]) -> None:
    """In the forked worker: take the parent's environment, as a forked child of it would.

    The server's own is the parent's as it was when the server started: a variable the
    parent set or removed since (``CUDA_VISIBLE_DEVICES``, say) would otherwise not reach
    the worker. A module the server imported already read its variables then. The thread
    variables the server started with are the worker settings' to set again
    (``WorkerSettings.apply``).
    """
    for name in os.environ.keys() - environ.keys():
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _watch_in_child(server_pid: int, is_watching: bool) -> OwnerWatch:
    """In the forked worker: die with the server; how it watches its owner (``OwnerWatch``).

    Without a pidfd of the owner in the server, the worker's own thread watches the owner.
    """
    if worker_module().exit_with_direct_parent(server_pid) and is_watching:
        return OwnerWatch.SERVER
    return OwnerWatch.THREAD


def _run_spare(sock: socket.socket, watch: OwnerWatch, main_failed: str | None) -> None:
    """In a spare: wait for a request on ``sock``, then run it as a worker; exit at EOF."""
    code = 1
    try:
        worker_module().set_process_name(SPARE_NAME)
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        sock.close()
        if not message:  # dropped by the server
            code = 0
            return
        _run_child((fds[0], fds[1]), pickle.loads(message), watch, main_failed)
    except BaseException:  # noqa: BLE001 - reported on the server's stderr, then the exit code
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_child(
    pipes: tuple[int, int], args: WorkerArgs, watch: OwnerWatch, main_failed: str | None
) -> None:
    """In the forked worker, which left the server (``_Server._leave_for_child``): run it.

    ``pipes``: the worker's pipe end and its stderr pipe. ``main_failed``: the user's
    script, if it raised in the server: the worker imports it again and reports what it
    raises, as it would under multiprocessing.
    """
    code = 1
    child_fd, stderr_fd = pipes
    try:
        if args.cwd != os.getcwd():
            os.chdir(args.cwd)
        if args.environ is not None:
            _adopt_environ(args.environ)
        if main_failed is not None:
            os.dup2(stderr_fd, 2)  # the traceback reaches the parent's crash report
            import_main(main_failed, is_raising=True)
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
