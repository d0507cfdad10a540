"""PARENT SIDE: the SubprocessEnv proxy (start/initialize/respawn/close), create_subprocess_envs().

A SubprocessEnv is a ``gymnasium.Env`` whose env lives in one daemon worker process. It owns
that process, its pipes and its restart budget. Failure semantics (DESIGN.md):

- The worker dies during ``step`` (signal, exit, OOM kill, or a ``step_timeout`` kill): no
  exception. The worker is respawned and re-initialized, and the step returns a truncation:
  the last observation the caller saw, ``reward=0.0``, ``terminated=False``,
  ``truncated=True``, ``info["multienv"] = {"restarted": True, "cause": ..., "restarts": k}``.
  The caller's next ``reset()`` (an autoreset wrapper's, or its own) starts the new episode.
- It dies during ``reset``, ``render``, ``call``, ``get_attr`` or ``set_attr``: respawned,
  and the command is replayed on the fresh env.
- It dies while building the env: respawned, under the same budget.
- Env code raises: ``EnvError`` naming the env, the remote type and message, with the
  worker's traceback chained; the worker stays alive (if ``env_fn`` raised, it has exited).
  With ``restart_on_error=True`` the error is treated as a death instead.
- Respawns beyond the ``RestartPolicy``: ``EnvCrashLoopError`` now and on every later call
  (``EnvCrashedError`` under ``RestartPolicy.never()``).
"""

from __future__ import annotations

import copy
import enum
import importlib.util
import logging
import math
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector.utils import create_empty_array

from multienv.errors import (
    EnvCrashedError,
    EnvCrashLoopError,
    EnvError,
    EnvStateError,
)
from multienv.forkserver import forkserver_context
from multienv.protocol import (
    DONE_OK,
    FAST_RESET,
    FAST_STEP,
    Command,
    EnvDescription,
    MessageReader,
    RemoteFailure,
    RemoteTraceback,
    Status,
    decode,
    encode,
    frame,
    worker_main,
    write_frame,
    write_message,
)
from multienv.restart import RestartPolicy
from multienv.shared_memory import SharedBatch

logger = logging.getLogger(__name__)

EnvFn = Callable[[], gym.Env[Any, Any]]
_PIPE_ERRORS = (EOFError, BrokenPipeError, ConnectionResetError)
_STDERR_TAIL_LINES = 30
_EARLY_EXIT_HINT = (
    "\nA worker that exits before multienv's worker code runs in it, for example while it "
    "imports your script, writes to this process's stderr instead: look above. If your "
    'script creates envs at its top level, move that under `if __name__ == "__main__":`.'
)
_DONE_OK_REPLY = (Status.OK, None)  # what a DONE_OK record stands for
_STEP_HEADER = frame(bytes(4))[:-4]  # the length prefix of a four-byte fast step
_RESET_HEADER = frame(bytes(3))[:-3]
_OBS_COMMANDS = (Command.STEP, Command.RESET)


class EnvState(enum.Enum):
    """Lifecycle of one SubprocessEnv; legal moves are listed in _TRANSITIONS."""

    CREATED = "created"  # object exists, no process yet
    STARTED = "started"  # worker alive, env not built yet
    READY = "ready"  # initialize() succeeded; reset/step/call allowed
    BROKEN = "broken"  # restart budget spent; calls raise EnvCrashLoopError
    CLOSED = "closed"  # terminal; calls raise ClosedEnvironmentError


_TRANSITIONS: dict[EnvState, set[EnvState]] = {
    EnvState.CREATED: {EnvState.STARTED, EnvState.CLOSED},
    # Any move back to STARTED is a respawn.
    EnvState.STARTED: {EnvState.STARTED, EnvState.READY, EnvState.BROKEN, EnvState.CLOSED},
    EnvState.READY: {EnvState.STARTED, EnvState.BROKEN, EnvState.CLOSED},
    EnvState.BROKEN: {EnvState.CLOSED},
    EnvState.CLOSED: set(),
}


class _Death:
    """The worker is gone (or was killed for a timeout); ``cause`` says how."""

    __slots__ = ("cause",)

    def __init__(self, cause: str) -> None:
        self.cause = cause


def resolve_context(context: BaseContext | str | None, preload: Sequence[str] = ()) -> BaseContext:
    """Return the multiprocessing context to start workers with.

    Args:
        context: A context, a start-method name, or None for the default: ``forkserver`` on
            Linux (with numpy, gymnasium and the user's script preloaded, so a respawn is a
            cheap fork; see ``multienv.forkserver``) and
            ``spawn`` elsewhere. ``fork`` is available on request; forking a parent whose
            threads hold locks can deadlock the child.
        preload: More modules for the forkserver to import; other start methods ignore it.
    """
    if isinstance(context, BaseContext):
        return context
    name = context or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    if name == "forkserver":
        return forkserver_context(preload)
    return multiprocessing.get_context(name)


def _checked_preload(preload: Sequence[str], env_index: int) -> tuple[str, ...]:
    """Return the module names of ``preload``; raise, naming the env, if one is not installed."""
    is_collection = isinstance(preload, Iterable) and not isinstance(preload, str | bytes)
    names = tuple(preload) if is_collection else ()
    if not is_collection or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"env {env_index}: preload must be a list of module names, such as "
            f"['gymnasium.envs.classic_control'], got {preload!r}"
        )
    for name in names:
        top_level = name.partition(".")[0]
        if not top_level or importlib.util.find_spec(top_level) is None:
            raise ModuleNotFoundError(
                f"env {env_index}: preload names {name!r}, but no module {top_level!r} is installed"
            )
    return names


class SubprocessEnv(gym.Env[Any, Any]):
    """A ``gymnasium.Env`` proxy whose env runs in one daemon worker process.

    Call ``start()`` (returns at once) then ``initialize()`` (waits for the env), or use
    ``create_subprocess_envs()``. See the module docstring for what happens when the
    worker dies, hangs or raises.

    Args:
        env_fn: Zero-argument callable returning a new gymnasium.Env (sent with cloudpickle).
        context: Multiprocessing context or start-method name; see ``resolve_context``.
        restart_policy: How many respawns are allowed, and how fast.
        step_timeout: Seconds a ``step`` may take before the worker is killed; None waits forever.
        reset_timeout: Seconds a ``reset`` may take before the worker is killed; None waits forever.
        init_timeout: Seconds a worker may take to build its env before it is killed.
        restart_on_error: Treat an exception raised by env code as a death.
        close_timeout_s: Seconds ``close()`` waits for the worker to exit before killing it.
        env_index: Position of this env in its vector; used in messages and process names.
        preload: Names of modules for the forkserver to import before it forks workers, such
            as the env's package (``"ale_py"``), so that every worker shares their memory
            and a respawn does not import them again. The forkserver starts once per
            process, so pass it to the first env a process starts; later ones log a warning.
            Other start methods ignore it.
    """

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        context: BaseContext | str | None = None,
        restart_policy: RestartPolicy | None = None,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        init_timeout: float | None = 60.0,
        restart_on_error: bool = False,
        close_timeout_s: float = 5.0,
        env_index: int = 0,
        preload: Sequence[str] = (),
    ) -> None:
        """Check the options and pickle ``env_fn``; no process is started yet."""
        self.env_index = env_index
        for name, value in (
            ("step_timeout", step_timeout),
            ("reset_timeout", reset_timeout),
            ("init_timeout", init_timeout),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"env {env_index}: {name} must be > 0 or None, got {value!r}")
        if not callable(env_fn):
            raise TypeError(
                f"env {env_index}: env_fn must be a zero-argument callable returning a "
                f"gymnasium.Env, got {type(env_fn).__name__}"
            )
        try:
            self._env_fn_bytes: bytes = cloudpickle.dumps(env_fn)
        except Exception as exc:
            raise TypeError(
                f"env {env_index}: env_fn {env_fn!r} cannot be pickled with cloudpickle ({exc}); "
                "build unpicklable resources inside env_fn instead of capturing them."
            ) from exc
        self._context = resolve_context(context, _checked_preload(preload, env_index))
        self._restart_policy = restart_policy if restart_policy is not None else RestartPolicy()
        self._step_timeout = step_timeout
        self._reset_timeout = reset_timeout
        self._init_timeout = init_timeout
        self._restart_on_error = restart_on_error
        self._close_timeout_s = close_timeout_s

        self._state = EnvState.CREATED
        self._process: BaseProcess | None = None  # None once reaped
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._fd = -1  # self._conn's fd, written to directly
        self._reader: MessageReader | None = None
        self._poller: Any = None  # select.poll over the pipe and the process sentinel
        self._stderr_pump: threading.Thread | None = None
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._init_deadline: float | None = None
        self._pending: tuple[Command, Any, float | None] | None = None
        self._sent_at = 0.0
        self._last_obs: Any = None
        self._shared: SharedBatch | None = None  # set by attach(); then obs travel through it
        self._write_slot: int | None = None  # the shared slot the in-flight call writes into
        self._done_read = -1  # set by attach(): our group's done pipe
        self._seq = 0  # of the last fast request, 1 to 255
        self._notify_seq = 0  # the in-flight fast request's seq; 0 when its reply is a message
        self._restart_times: list[float] = []
        self._consecutive_restarts = 0  # respawns since the last successful call
        self._broken_error: EnvCrashedError | None = None
        self._is_closing = threading.Event()
        self.restarts = 0
        self.last_failure: str | None = None
        self.steps = 0
        self.episodes = 0
        self.step_latencies_s: deque[float] = deque(maxlen=1000)

    # ----------------------------------------------------------------- lifecycle

    @property
    def pid(self) -> int | None:
        """Process id of the current worker; None before ``start()``."""
        return self._pid

    @property
    def state(self) -> EnvState:
        """Where this proxy is in its lifecycle."""
        return self._state

    def start(self) -> None:
        """Launch the worker, which starts building the env; returns without waiting."""
        self._require(EnvState.CREATED, "start")
        self._spawn()

    def initialize(self) -> None:
        """Wait until the worker has built its env, then cache spaces, metadata and spec.

        Raises:
            EnvError: ``env_fn`` raised in the worker.
            EnvCrashLoopError: The worker kept dying or timing out while building the env.
        """
        self._require(EnvState.STARTED, "initialize")
        cause = self._handshake()
        if cause is None:
            self._set_state(EnvState.READY)
        else:
            self._respawn(cause)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker and release its pipes; idempotent and bounded in time.

        Args:
            timeout: Seconds to wait for a clean exit before the worker is killed;
                defaults to ``close_timeout_s``.
        """
        if self._state is EnvState.CLOSED:
            return
        self._is_closing.set()
        self._stop_worker(self._close_timeout_s if timeout is None else timeout)
        self._set_state(EnvState.CLOSED)

    def __del__(self) -> None:
        """Close the worker if the proxy was fully constructed."""
        if "_state" in self.__dict__:
            self.close(timeout=1.0)

    # ----------------------------------------------------------------- env API

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the remote env; replayed on a fresh worker if the worker dies."""
        self.send_reset(seed=seed, options=options)
        obs, info = self.recv_reset()
        if obs is None:
            obs = self._read_shared_obs()
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Step the remote env; a worker death comes back as a flagged truncation."""
        self.send_step(action)
        obs, reward, terminated, truncated, info, _ = self.recv_step()
        if obs is None:
            obs = self._read_shared_obs()
        return obs, reward, terminated, truncated, info

    def render(self) -> Any:
        """Return the remote env's ``render()`` result."""
        return self._request(Command.RENDER, None)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the remote env's method ``name`` (or return the attribute, if not callable)."""
        return self._request(Command.CALL, (name, args, kwargs))

    def get_attr(self, name: str) -> Any:
        """Return the remote env's attribute ``name`` (searched through its wrappers)."""
        return self._request(Command.GET_ATTR, name)

    def set_attr(self, name: str, value: Any) -> None:
        """Set the remote env's attribute ``name`` (on the wrapper that has it)."""
        self._request(Command.SET_ATTR, (name, value))

    def attach(self, shared: SharedBatch) -> None:
        """Move observations, actions and results to ``shared`` (slot ``env_index``).

        From now on, ``recv_step`` and ``recv_reset`` return None for an observation that
        is in shared memory (``reset`` and ``step`` still return it). A respawned worker
        is attached again before it serves a call.
        """
        self._require(EnvState.READY, "attach")
        self._shared = shared
        self._done_read = shared.done_read(self.env_index)
        self._poller.register(self._done_read, select.POLLIN)
        cause = self._attach_worker()
        if cause is not None:
            self._respawn(cause)

    # ------------------------------------------- split-phase calls, for vectors and backends

    def send_reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Send a reset without waiting; ``recv_reset()`` collects it."""
        self._begin(Command.RESET, (seed, options), "reset", self._reset_timeout)

    def recv_reset(self) -> tuple[Any, dict[str, Any]]:
        """Wait for the reset sent by ``send_reset()``; obs is None when it is in shared memory."""
        obs, info = self._finish()
        self._last_obs = obs
        return obs, info

    def send_step(self, action: Any, *, autoreset: bool = False) -> None:
        """Send a step without waiting; ``recv_step()`` collects it.

        Args:
            action: The action for this env.
            autoreset: Let the worker reset a finished episode in the same round trip.
        """
        self._begin(Command.STEP, (action, autoreset), "step", self._step_timeout)

    def recv_step(self) -> tuple[Any, Any, bool, bool, dict[str, Any], Any]:
        """Wait for the step sent by ``send_step()``.

        Returns:
            ``(obs, reward, terminated, truncated, info, reset_result)``, where
            ``reset_result`` is the worker's ``(obs, info)`` after an autoreset, else None.
            When attached, an observation in shared memory is None: ``obs`` (unless it is
            the final obs of an autoreset episode) and the obs of ``reset_result``.
        """
        result: tuple[Any, Any, bool, bool, dict[str, Any], Any] = self._finish()
        obs, _, terminated, truncated, _, reset_result = result
        if terminated or truncated:
            self.episodes += 1
        self._last_obs = obs if reset_result is None else reset_result[0]
        return result

    @staticmethod
    def wait_ready(envs: Sequence[SubprocessEnv], timeout: float | None = None) -> list[int]:
        """Wait until at least one of ``envs`` can be collected without blocking.

        Waits on every worker's pipe and process sentinel, and on the vectors' done pipes,
        together, so a death is seen at once. An env counts as ready when its reply or DONE
        record is in, its worker died, its step or
        reset deadline passed (collecting it then kills the worker), or it has nothing in
        flight (collecting it then raises).

        Args:
            envs: Proxies, each normally with one call in flight.
            timeout: Seconds to wait at most; None waits until one is ready.

        Returns:
            The positions in ``envs`` that are ready, ascending; empty if ``timeout`` passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        has_polled = False
        while True:
            now = time.monotonic()
            poller = select.poll()
            owner: dict[int, int] = {}
            channels: dict[int, SharedBatch] = {}  # done pipes, drained rather than owned
            ready = []
            wait_until = deadline
            for position, env in enumerate(envs):
                handles = env._wait_handles()
                if handles is None or env._has_record():
                    ready.append(position)
                    continue
                fds, env_deadline = handles
                if env_deadline is not None:
                    if env_deadline <= now:
                        ready.append(position)
                        continue
                    wait_until = (
                        env_deadline if wait_until is None else min(wait_until, env_deadline)
                    )
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                    owner[fd] = position
                if env._shared is not None:
                    channels[env._done_read] = env._shared
            if ready:
                return ready
            if has_polled and deadline is not None and now >= deadline:
                return []
            for fd in channels:
                poller.register(fd, select.POLLIN)
            events = poller.poll(_poll_ms(wait_until, now))
            has_polled = True
            for fd, _ in events:
                if fd in channels:
                    channels[fd].drain(fd)  # the records are checked at the top
                else:
                    ready.append(owner[fd])
            if ready:
                return sorted(set(ready))

    # ----------------------------------------------------------------- internals

    def _wait_handles(self) -> tuple[list[int], float | None] | None:
        """The fds that signal the in-flight call's end, and its deadline; None if none.

        The vector's done pipe is not among them: ``_has_record`` covers it.
        """
        if self._pending is None or self._process is None or self._conn is None:
            return None
        return [self._fd, self._process.sentinel], self._pending[2]

    def _has_record(self) -> bool:
        """Whether the DONE record of the in-flight fast request has been read already."""
        seq, shared = self._notify_seq, self._shared
        return bool(seq) and shared is not None and shared.done_seq[self.env_index] == seq

    def _set_state(self, new: EnvState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise EnvStateError(
                f"env {self.env_index}: illegal state move {self._state.name} -> {new.name}",
                env_index=self.env_index,
            )
        logger.debug("env %d: %s -> %s", self.env_index, self._state.name, new.name)
        self._state = new

    def _require(self, wanted: EnvState, name: str) -> None:
        state = self._state
        if state is wanted:
            return
        if state is EnvState.CLOSED:
            raise ClosedEnvironmentError(
                f"env {self.env_index}: {name}() called after close(); create a new env."
            )
        if state is EnvState.BROKEN and self._broken_error is not None:
            raise copy.copy(self._broken_error)
        hints = {
            EnvState.CREATED: (
                "call start() and initialize() first, or use create_subprocess_envs()"
            ),
            EnvState.STARTED: "call initialize() first",
            EnvState.READY: f"{name}() may be called only once",
        }
        raise EnvStateError(
            f"env {self.env_index}: {name}() called in state {state.name}; {hints[state]}.",
            env_index=self.env_index,
        )

    def _spawn(self) -> None:
        """Start a new worker process; the env is built there while we return."""
        parent_conn, child_conn = self._context.Pipe()
        stderr_read, stderr_write = self._context.Pipe(duplex=False)
        is_forkserver = self._context.get_start_method() == "forkserver"
        process = self._context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(
                child_conn,
                stderr_write,
                self._env_fn_bytes,
                self.env_index,
                os.getpid(),
                is_forkserver,
            ),
            name=f"multienv-worker-{self.env_index}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            child_conn.close()
            stderr_write.close()
        self._process, self._conn, self._pid = process, parent_conn, process.pid
        self._fd = parent_conn.fileno()
        self._reader = MessageReader(self._fd)
        # Registered once per worker: a poll() per reply is one syscall, where
        # multiprocessing.connection.wait() builds a new selector on every call.
        self._poller = select.poll()
        self._poller.register(parent_conn.fileno(), select.POLLIN)
        self._poller.register(process.sentinel, select.POLLIN)
        if self._shared is not None:
            self._poller.register(self._done_read, select.POLLIN)
        self._stderr_tail = deque(maxlen=_STDERR_TAIL_LINES)
        self._stderr_pump = threading.Thread(
            target=_pump_stderr,
            args=(stderr_read, self._stderr_tail),
            name=f"multienv-stderr-{self.env_index}",
            daemon=True,
        )
        self._stderr_pump.start()
        self._init_deadline = (
            None if self._init_timeout is None else time.monotonic() + self._init_timeout
        )
        logger.info("env %d: started worker pid %d", self.env_index, process.pid)
        self._set_state(EnvState.STARTED)

    def _handshake(self) -> str | None:
        """Wait for the worker's first message; return a cause of death, or None when ready."""
        outcome = self._receive(self._init_deadline)
        if isinstance(outcome, _Death):
            return outcome.cause
        status, payload = outcome
        if status == Status.ERROR:
            if self._restart_on_error:
                return f"error: {payload.type_name}"
            raise self._env_error(
                payload,
                "initialize",
                "The worker has exited; initialize() again tries env_fn in a new worker.",
            )
        description: EnvDescription = payload
        self.observation_space = description.observation_space
        self.action_space = description.action_space
        self.metadata = description.metadata
        self.render_mode = description.render_mode
        self.spec = description.spec
        return None

    def _attach_worker(self) -> str | None:
        """Send the shared memory to the worker; return a cause of death, or None when done."""
        shared, conn = self._shared, self._conn
        assert shared is not None
        assert conn is not None
        assert shared.fd is not None
        deadline = None if self._init_timeout is None else time.monotonic() + self._init_timeout

        memory_fd = shared.fd

        def send_fds() -> None:
            send_handle(conn, memory_fd, self._pid)
            send_handle(conn, shared.done_write(self.env_index), self._pid)

        # Two round trips: the worker acks the command, then we send the fds, then it acks them.
        for send in (
            lambda: write_message(
                self._fd, encode((int(Command.ATTACH), (shared.layout, self.env_index)))
            ),
            send_fds,
        ):
            try:
                send()
            except _PIPE_ERRORS:
                pass  # the worker is dead; _receive() sees its sentinel
            outcome = self._receive(deadline)
            if isinstance(outcome, _Death):
                return outcome.cause
            status, payload = outcome
            if status == Status.ERROR:
                raise self._env_error(payload, "attach")
        return None

    def _read_shared_obs(self) -> Any:
        assert self._shared is not None
        return self._shared.read(self.env_index)

    def _receive(self, deadline: float | None) -> Any:
        """Wait for one reply or the worker's death, whichever comes first, up to ``deadline``.

        The reply to a fast request is its DONE record on the shared done pipe; every wait
        also drains that pipe, since the records of the other envs of the vector arrive there
        too, and they are noted for when their envs are collected.
        """
        process, shared = self._process, self._shared
        assert process is not None
        seq = self._notify_seq
        while True:
            if seq and shared is not None and shared.done_seq[self.env_index] == seq:
                shared.done_seq[self.env_index] = 0
                if shared.done_kind[self.env_index] == DONE_OK:
                    return _DONE_OK_REPLY
                seq = 0  # the reply follows on our own pipe
            try:
                events = self._poller.poll(_poll_ms(deadline, time.monotonic()))
            except (OSError, ValueError):
                events = [(process.sentinel, 0)]  # close() on another thread closed the pipe
            if self._is_closing.is_set():
                raise ClosedEnvironmentError(
                    f"env {self.env_index}: closed while a call was waiting."
                )
            fds = [fd for fd, _ in events]
            if shared is not None and self._done_read in fds:
                shared.drain(self._done_read)
                fds.remove(self._done_read)
                if not fds:
                    continue
            if self._fd in fds:
                assert self._reader is not None
                try:
                    return decode(self._reader.read())
                except _PIPE_ERRORS:
                    pass
            elif not fds:
                logger.warning(
                    "env %d: worker pid %d timed out; killing it", self.env_index, process.pid
                )
                process.kill()
                process.join(5.0)
                return _Death("timeout")
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
            return _Death(_describe_exit(process.exitcode))

    def _begin(self, command: Command, payload: Any, name: str, timeout: float | None) -> None:
        if self._state is not EnvState.READY:
            self._require(EnvState.READY, name)
        if self._pending is not None:
            # A call interrupted in the parent (e.g. by KeyboardInterrupt) left a reply in flight.
            self._discard_pending()
        self._notify_seq = 0
        # Encoded before anything is marked in flight: a payload that cannot be sent raises here.
        if command in _OBS_COMMANDS:
            message = self._obs_request(command, payload)
        else:
            message = frame(encode((int(command), payload)))
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pending = (command, payload, deadline)
        self._sent_at = time.perf_counter()
        try:
            write_frame(self._fd, message)
        except _PIPE_ERRORS:
            pass  # the worker is dead; _finish() sees its sentinel and respawns

    def _obs_request(self, command: Command, payload: tuple[Any, Any]) -> bytes:
        """Frame a step or reset; when attached, name the slot its observation goes into."""
        shared = self._shared
        if shared is None:
            self._write_slot = None
            return frame(encode((int(command), (*payload, None))))
        slot = 1 - int(shared.slot[self.env_index])  # never the slot the caller saw last
        self._write_slot = slot
        seq = self._seq % 255 + 1
        if command is Command.STEP:
            action, autoreset = payload
            if shared.actions is not None:
                shared.actions[self.env_index] = action
                self._seq = self._notify_seq = seq
                return _STEP_HEADER + bytes((FAST_STEP, slot, autoreset, seq))
        elif payload == (None, None):
            self._seq = self._notify_seq = seq
            return _RESET_HEADER + bytes((FAST_RESET, slot, seq))
        return frame(encode((int(command), (*payload, slot))))

    def _finish(self) -> Any:
        if self._pending is None:
            raise EnvStateError(
                f"env {self.env_index}: no call is in flight; send one first.",
                env_index=self.env_index,
            )
        command, payload, deadline = self._pending
        outcome = self._receive(deadline)
        self._pending = None
        self._notify_seq = 0  # a late record of this request must not answer a later one
        if isinstance(outcome, _Death):
            return self._recover(command, payload, outcome.cause)
        status, result = outcome
        if status == Status.ERROR:
            if self._restart_on_error:
                self._kill()
                return self._recover(command, payload, f"error: {result.type_name}")
            raise self._env_error(result, command.name.lower())
        self._consecutive_restarts = 0
        if command is Command.STEP:
            self.steps += 1
            self.step_latencies_s.append(time.perf_counter() - self._sent_at)
        if self._write_slot is not None and command in _OBS_COMMANDS:
            return self._shared_result(command, result)
        return result

    def _shared_result(self, command: Command, result: Any) -> Any:
        """Turn an attached worker's reply into the usual tuple, with None for shared obs."""
        shared, env_index = self._shared, self.env_index
        assert shared is not None
        shared.slot[env_index] = self._write_slot
        if command is Command.RESET:
            return (None, {}) if result is None else result
        reward, terminated, truncated = shared.read_result(env_index)
        if result is None:
            return None, reward, terminated, truncated, {}, None
        final_obs, info, reset_info = result
        reset_result = None if reset_info is None else (None, reset_info)
        return final_obs, reward, terminated, truncated, info, reset_result

    def _recover(self, command: Command, payload: Any, cause: str) -> Any:
        """Respawn after a death, then answer the interrupted command as DESIGN.md says."""
        self._respawn(cause)
        if command is Command.STEP:
            info = {"multienv": {"restarted": True, "cause": cause, "restarts": self.restarts}}
            obs = self._read_shared_obs() if self._shared is not None else self._last_obs
            if obs is None:
                obs = create_empty_array(self.observation_space, n=None, fn=np.zeros)
            return obs, 0.0, False, True, info, None
        return self._request(command, payload)  # replayed on the fresh worker

    def _request(self, command: Command, payload: Any) -> Any:
        timeout = self._reset_timeout if command is Command.RESET else None
        self._begin(command, payload, command.name.lower(), timeout)
        return self._finish()

    def _discard_pending(self) -> None:
        command = self._pending[0] if self._pending is not None else None
        logger.debug("env %d: discarding the reply to an interrupted %s", self.env_index, command)
        try:
            self._finish()
        except EnvError:
            pass

    def _respawn(self, cause: str) -> None:
        """Replace a dead worker, under the restart budget, until one is ready."""
        while True:
            self._bury(cause)
            self._spawn()
            next_cause = self._handshake()
            if next_cause is None and self._shared is not None:
                next_cause = self._attach_worker()
            if next_cause is None:
                self._set_state(EnvState.READY)
                return
            cause = next_cause

    def _bury(self, cause: str) -> None:
        """Reap the dead worker, then wait out the backoff or raise if the budget is spent."""
        pid = self._pid
        self._kill()
        self._release_pipes()
        self.last_failure = cause
        now = time.monotonic()
        policy = self._restart_policy
        delay = policy.next_delay(self._restart_times, now, self._consecutive_restarts)
        if delay is None:
            self._become_broken(pid, cause)
        self._restart_times = [*policy.recent(self._restart_times, now), now]
        self._consecutive_restarts += 1
        self.restarts += 1
        logger.warning(
            "env %d: worker pid %s died (%s); respawning (%d/%d in %g s)",
            self.env_index,
            pid,
            cause,
            len(self._restart_times),
            policy.max_restarts,
            policy.window_s,
        )
        if delay and self._is_closing.wait(delay):
            raise ClosedEnvironmentError(f"env {self.env_index}: closed during a respawn.")

    def _become_broken(self, pid: int | None, cause: str) -> None:
        tail = tuple(self._stderr_tail)
        policy = self._restart_policy
        stderr_text = "\n".join(tail) if tail else "(nothing)"
        if not tail and cause.startswith("exit code"):
            stderr_text += _EARLY_EXIT_HINT
        error: EnvCrashedError
        if policy.is_never:
            error = EnvCrashedError(
                f"env {self.env_index}: worker (pid {pid}) died ({cause}) and "
                "RestartPolicy.never() is set; its last stderr lines follow. Fix the crash or "
                f"allow restarts.\n{stderr_text}",
                env_index=self.env_index,
            )
        else:
            deaths = len(policy.recent(self._restart_times, time.monotonic())) + 1
            error = EnvCrashLoopError(
                f"env {self.env_index}: worker died {deaths} times in {policy.window_s:g} s "
                f"(RestartPolicy max_restarts={policy.max_restarts}, "
                f"window_s={policy.window_s:g}); "
                f"last cause {cause}; its last stderr lines follow. Fix the crash or loosen "
                f"the policy.\n{stderr_text}",
                env_index=self.env_index,
                restarts=deaths,
                cause=cause,
                stderr_tail=tail,
            )
            logger.error("%s", error)
        self._broken_error = error
        self._set_state(EnvState.BROKEN)
        raise error

    def _env_error(
        self, failure: RemoteFailure, name: str, advice: str = "The worker is still alive."
    ) -> EnvError:
        remote = RemoteTraceback(failure.traceback)
        cause: BaseException = failure.exception if failure.exception is not None else remote
        if cause is not remote:
            cause.__cause__ = remote
        error = EnvError(
            f"env {self.env_index}: worker (pid {self.pid}) raised {failure.type_name} in "
            f"{name}(): {failure.message}; see the worker traceback above. {advice}",
            env_index=self.env_index,
        )
        error.__cause__ = cause
        return error

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(5.0)

    def _release_pipes(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._stderr_pump is not None:
            self._stderr_pump.join(1.0)  # its EOF arrives once the worker's fd 2 is closed
        if self._process is not None and self._process.exitcode is not None:
            self._process.close()  # releases its sentinel fd
            self._process = None

    def _stop_worker(self, timeout_s: float) -> None:
        process, conn = self._process, self._conn
        if process is None or conn is None:
            self._release_pipes()
            return
        try:
            if process.exitcode is None:
                write_message(self._fd, encode((int(Command.CLOSE), None)))
        except (*_PIPE_ERRORS, OSError, ValueError):
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
            self._release_pipes()


def _poll_ms(deadline: float | None, now: float) -> int | None:
    """The ``poll()`` timeout that ends at ``deadline`` (monotonic seconds); None waits forever."""
    return None if deadline is None else max(0, math.ceil((deadline - now) * 1000))


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _pump_stderr(read_conn: Connection, tail: deque[str]) -> None:
    """Forward a worker's stderr to ours, keeping its last lines for crash reports."""
    fd = read_conn.fileno()
    partial = b""
    try:
        while chunk := os.read(fd, 65536):
            try:
                os.write(2, chunk)
            except OSError:
                pass  # our own stderr is gone; keep collecting the tail
            *lines, partial = (partial + chunk).split(b"\n")
            tail.extend(line.decode(errors="replace") for line in lines)
    except OSError:
        pass
    finally:
        if partial:
            tail.append(partial.decode(errors="replace"))
        read_conn.close()


def create_subprocess_envs(env_fns: Sequence[EnvFn], **options: Any) -> list[SubprocessEnv]:
    """Start one worker per env factory, then initialize them all in parallel.

    Args:
        env_fns: Zero-argument callables returning a new gymnasium.Env (sent with cloudpickle).
        **options: Keyword options of ``SubprocessEnv``, applied to every env.

    Raises:
        TypeError: An env_fn cannot be pickled; nothing was started.
        EnvError: An env_fn raised in its worker; all proxies are closed first.
        EnvCrashLoopError: A worker kept failing to start; all proxies are closed first.
    """
    if "env_index" in options:
        raise TypeError("create_subprocess_envs() numbers the envs itself; do not pass env_index")
    envs = [SubprocessEnv(env_fn, env_index=i, **options) for i, env_fn in enumerate(env_fns)]
    try:
        for env in envs:
            env.start()
        with ThreadPoolExecutor(
            max_workers=max(1, min(len(envs), 32)), thread_name_prefix="multienv"
        ) as pool:
            futures = [pool.submit(env.initialize) for env in envs]
            wait_futures(futures)
        errors = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
        for i, error in errors[1:]:
            logger.error("env %d: initialize() failed too: %s", i, error)
        if errors:
            raise errors[0][1]  # type: ignore[misc]
    except BaseException:
        for env in envs:
            env.close(timeout=1.0)
        raise
    return envs


__all__ = ["EnvFn", "EnvState", "SubprocessEnv", "create_subprocess_envs", "resolve_context"]
