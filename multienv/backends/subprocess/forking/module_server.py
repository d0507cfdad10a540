"""PARENT SIDE: the module server, the process that daemon workers fork from.

Workers start from a server process that imports numpy, gymnasium, multienv's worker, the
``preload`` option's modules and the user's script once (``fork_source``), so a
worker or a respawn is a cheap fork that shares those pages. It is a fresh Python, spawned
by the first vector (or by ``multienv.start_forkserver()``) and kept for the process's
life; what runs in it, and the wire, is ``module_server_process``.

It also learns the env's own modules, which the factories import only when they run
(``gym.make("HalfCheetah-v5")`` imports mujoco and Gymnasium's MuJoCo modules): the first
worker of a process (or a probe that builds env 0 alone, for a vector with more workers
than cores) reports the modules its envs imported (``Reply.modules``), and the server
imports them before it forks the next worker. Workers started after that (the rest of a
vector, respawns, recycles, later vectors) share them and skip the imports: about 15 MiB
per HalfCheetah worker.

It stays safe to fork from: it builds no env, and it refuses to serve if its imports
started a thread. It watches the parent's pid and exits when the parent dies; its workers
die with it (``PR_SET_PDEATHSIG``), whichever way it ends. Workers it cannot fork (it
refused or died, non-daemon workers, factories larger than one request) start from
multiprocessing's forkserver instead (``forkserver``), which starts only then:
without it, a process runs no forkserver and no resource tracker, two Python processes
that cost about 17 MiB.

After ``start_forkserver()``, each vector that started from the server asks it to keep
spares for the next one (``keep_spares``): workers forked ahead, which a launch takes
without waiting for a fork (``module_server_process`` says how).

``ServedProcess`` behaves like a ``multiprocessing.Process`` for the handle: ``sentinel``
(the status pipe the server writes the exit status to), ``exitcode``, ``join``, ``kill``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import spawn
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

from multienv.backends.subprocess.forking import forkserver
from multienv.backends.subprocess.forking.fork_source import (
    check_not_bootstrapping,
    guard_missing_error,
)
from multienv.backends.subprocess.forking.module_server_process import (
    BOOTSTRAP,
    MAIN_STARTS_ENVS,
    MAX_REQUEST,
    READY,
    STATUS,
    ImportRequest,
    ServerStart,
    SpareRequest,
    WorkerArgs,
)
from multienv.wire.framing import readable

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # the server's imports: numpy, gymnasium, the script, an env's modules


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
        # close() runs it; so does the collector, for a worker dropped unclosed (abandon).
        self._close_fds = weakref.finalize(self, _close_fds, status_fd, self._pidfd)
        self._close_fds.atexit = False

    @property
    def exitcode(self) -> int | None:
        """The exit status once the worker ended (minus the signal that killed it), else None."""
        if self._exitcode is None and self.sentinel >= 0:
            if readable([self.sentinel], 0):
                data = os.read(self.sentinel, STATUS.size)
                # No status: the server died, and its workers with it (PR_SET_PDEATHSIG).
                self._exitcode = (
                    STATUS.unpack(data)[0] if len(data) == STATUS.size else -signal.SIGKILL
                )
        return self._exitcode

    def is_alive(self) -> bool:
        """Whether the worker has not ended yet."""
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the worker to end."""
        if self.exitcode is None and self.sentinel >= 0:
            readable([self.sentinel], timeout)

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
        self._close_fds()
        self.sentinel, self._pidfd = -1, None


def _close_fds(status_fd: int, pidfd: int | None) -> None:
    os.close(status_fd)
    if pidfd is not None:
        os.close(pidfd)


class ModuleServer:
    """The parent's end of a running module server.

    Args:
        preload: More modules for it to import (the ``preload`` option).
        thread_env: Thread-count variables it starts with (see ``forkserver_context``).
    """

    def __init__(self, preload: Sequence[str], thread_env: Mapping[str, str]) -> None:
        """Spawn the server; it imports while the caller goes on (``wait_ready`` waits).

        Raises:
            OSError: It could not be spawned.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._is_ready = False
        self._pending_import: int | None = None  # modules requested, answer not read yet
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        path = [os.fspath(entry) for entry in sys.path if isinstance(entry, str | os.PathLike)]
        try:
            self._process = subprocess.Popen(
                [spawn.get_executable(), *flags, "-c", BOOTSTRAP, str(theirs.fileno()), *path],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env={**os.environ, **thread_env},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        start = ServerStart(list(preload), forkserver.main_script_path(), sys.argv, os.getpid())
        try:
            ours.send(pickle.dumps(start, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self.close()
            raise
        atexit.register(self.close)  # the server exits at EOF; reaped, it warns of nothing

    @property
    def is_ready(self) -> bool:
        """Whether the server answered that it serves."""
        return self._is_ready

    def wait_ready(self) -> None:
        """Wait until the server has imported everything and serves.

        Raises:
            OSError: It died, refused to serve, or took too long.
            MissingMainGuardError: The user's script starts envs at its top level.
        """
        if not self._is_ready:
            answer = self._answer()
            if answer.startswith(MAIN_STARTS_ENVS):  # it exits: no worker starts anywhere
                where = answer.removeprefix(MAIN_STARTS_ENVS).decode(errors="replace")
                raise guard_missing_error(where)
            self._is_ready = answer == READY
            if not self._is_ready:
                raise OSError("the module server did not start")

    def request_import(self, modules: Sequence[str]) -> None:
        """Have the server import ``modules``, so that the workers it forks next share them.

        Its answer is read by ``settle``, which every launch calls first.

        Raises:
            OSError: It is gone.
        """
        request = pickle.dumps(ImportRequest(list(modules)), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._sock.send(request)
            self._pending_import = len(modules)

    def settle(self) -> None:
        """Wait for the answer to an import request, if one is pending.

        Raises:
            OSError: It is gone, or it refused: the imports started a thread, so it forks no
                more workers, and lives on for those it forked.
        """
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        if self._pending_import is None:
            return
        count, self._pending_import = self._pending_import, None
        if self._answer() != READY:
            raise OSError("the module server refused the env's modules")
        logger.info("module server: imported %d modules", count)

    def keep_spares(self, count: int) -> None:
        """Have the server keep ``count`` workers forked ahead of their requests (no answer).

        Raises:
            OSError: It is gone.
        """
        request = pickle.dumps(SpareRequest(count), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._sock.send(request)

    def _answer(self) -> bytes:
        """The server's next short answer, or b"" if it is gone or took too long."""
        self._sock.settimeout(_START_TIMEOUT_S)
        try:
            return self._sock.recv(4096)
        except OSError:
            return b""
        finally:
            self._sock.settimeout(None)

    def launch(
        self, child_conn: Connection, stderr_write: Connection, args: WorkerArgs, name: str
    ) -> ServedProcess | None:
        """Fork a worker from the server; its pipe ends are duplicated into it.

        Returns None, sending nothing, when the pickled factories are too large for one
        request (the caller starts the worker from the forkserver).

        Raises:
            OSError: The server is gone, or refuses to fork (the caller falls back to the
                forkserver).
        """
        request = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        if len(request) > MAX_REQUEST:
            return None
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                self._settle()
                socket.send_fds(
                    self._sock, [request], [child_conn.fileno(), stderr_write.fileno(), status_w]
                )
                answer = self._sock.recv(64)  # one datagram: a pid, or REFUSED
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        if len(answer) != STATUS.size:  # refused (a thread runs in it), or gone
            os.close(status_r)
            raise OSError(f"the module server forked no worker ({answer!r})")
        return ServedProcess(STATUS.unpack(answer)[0], status_r, name)

    def is_alive(self) -> bool:
        """Whether the server process still runs."""
        return self._process.poll() is None

    def close(self) -> None:
        """Stop the server (its workers exit with it)."""
        self._sock.close()
        try:
            self._process.wait(1.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(1.0)


@dataclasses.dataclass
class _ProcessState:
    """This process's module server, and the env modules the first report asked for."""

    pid: int = -1  # the process it belongs to (a forked child starts afresh)
    server: ModuleServer | None = None
    has_failed: bool = False  # it could not start, or refused: workers use the forkserver
    learned: list[str] | None = None
    tried: bool = False  # the learned modules were sent to the server (or it had failed)
    spares: int = 0  # the most spares the server may keep (``allow_spares``)


_lock = threading.Lock()
_state = _ProcessState()


def _here() -> _ProcessState:
    """The state of this process, forgetting the one of a process it was forked from."""
    global _state  # noqa: PLW0603 - one module server per process
    if _state.pid != os.getpid():
        _state = _ProcessState(pid=os.getpid())
    return _state


def start() -> None:
    """Spawn this process's module server now, unless it runs (or failed); do not wait.

    It starts as ``forkserver_context`` configured this process's fork sources.

    Raises:
        RuntimeError: This process is a fork source importing the user's script, and the
            script starts envs at its top level.
    """
    check_not_bootstrapping()
    with _lock:
        _start(_here())


def _start(state: _ProcessState) -> None:
    if state.server is None and not state.has_failed:
        try:
            state.server = ModuleServer(
                forkserver.configured_preload(), forkserver.forkserver_thread_env() or {}
            )
        except OSError as exc:
            state.has_failed = True
            logger.warning("module server: %s; workers start from the forkserver", exc)


def running() -> ModuleServer | None:
    """This process's module server, if it runs."""
    with _lock:
        server = _here().server
    return server if server is not None and server.is_alive() else None


def has_tried() -> bool:
    """Whether this process's module server was sent the env modules a worker reported."""
    with _lock:
        return _here().tried


def learn(context: BaseContext, modules: Sequence[str] | None, wait: bool) -> None:
    """A worker reported the modules its envs imported; the first report in a process counts.

    Only for workers started from the forkserver context. ``wait``: send them to the server
    now (a probe, whose vector's workers wait for it). Otherwise the server imports them
    before it forks the next worker (a respawn, a recycle, a later vector).
    """
    if context.get_start_method() != "forkserver" or not modules:
        return
    with _lock:
        state = _here()
        if state.learned is None:
            state.learned = list(modules)
    if wait:
        for_launch()


def for_launch() -> ModuleServer | None:
    """The server to fork the next worker from, ready and with the learned modules; or None.

    Spawns it if this process has none yet (as ``forkserver_context`` configured it, or
    with no preload for a context of the caller's own).

    Raises:
        RuntimeError: This process is a fork source importing the user's script, and the
            script starts envs at its top level.
    """
    check_not_bootstrapping()
    with _lock:
        state = _here()
        _start(state)
        server = state.server
        if server is None or state.has_failed:
            return None
        try:
            server.wait_ready()
        except OSError as exc:  # it forked nothing yet
            server.close()
            state.server = None
            _fall_back(state, exc)
            return None
        try:
            _send_learned(state, server)
            server.settle()
        except OSError as exc:  # it stays for the workers it forked, if it lives
            _fall_back(state, exc)
            return None
    return server if server.is_alive() else None


def allow_spares(limit: int) -> None:
    """Let this process's server keep up to ``limit`` spares (``start_forkserver``'s)."""
    with _lock:
        _here().spares = limit


def keep_spares(count: int) -> None:
    """A vector of ``count`` workers from the server started: keep spares for the next one.

    The server forks them while idle (``module_server_process``), having imported the
    modules the vector's workers reported, which it is sent now rather than at the next
    launch. Nothing happens without a ready server, or unless ``allow_spares`` allowed any.
    """
    with _lock:
        state = _here()
        server = state.server
        if server is None or state.has_failed or not server.is_ready or state.spares == 0:
            return
        try:
            _send_learned(state, server)
            server.keep_spares(min(count, state.spares))
        except OSError as exc:
            _fall_back(state, exc)


def _send_learned(state: _ProcessState, server: ModuleServer) -> None:
    """Send the server the modules the first report named, once (answered by ``settle``)."""
    if state.learned is not None and not state.tried:
        state.tried = True
        server.request_import(state.learned)


def _fall_back(state: _ProcessState, exc: OSError) -> None:
    """The server cannot fork: every later worker of this process starts from the forkserver."""
    state.has_failed = True
    logger.warning("module server: %s; workers start from the forkserver", exc)
