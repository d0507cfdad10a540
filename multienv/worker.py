"""WORKER SIDE: the loop that runs in each worker process; builds, owns and closes one env.

The worker talks to its parent only through ``protocol``. It ignores SIGINT (the parent got
the same Ctrl-C and owns shutdown), sends its stderr to the parent through a pipe (the parent
forwards it and keeps the last lines for crash reports), and exits by itself when the parent
process dies, even by SIGKILL.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from multienv.protocol import (
    DONE_OK,
    DONE_REPLY,
    FAST_RESET,
    FAST_STEP,
    Command,
    EnvDescription,
    MessageReader,
    RemoteFailure,
    Status,
    decode,
    encode,
    write_message,
)
from multienv.shared_memory import BatchLayout, SlotWriter

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
OS_NAME_PREFIX = "multienv-w"  # /proc/<pid>/comm of a worker is this plus its env index
_PARENT_POLL_S = 0.5  # fallback only, when pidfd_open is unavailable
ObsCheck = Callable[[Any], "str | None"]
_PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


def run_worker(
    conn: Connection,
    stderr_conn: Connection,
    env_fn_bytes: bytes,
    env_index: int,
    parent_pid: int,
    use_pdeathsig: bool,
) -> None:
    """Build the env, report its spaces, then serve commands until CLOSE or the pipe breaks.

    Args:
        conn: The worker's end of the command pipe.
        stderr_conn: Write end of a pipe that becomes this process's fd 2.
        env_fn_bytes: The cloudpickled env factory.
        env_index: Position of this env in its vector, for messages.
        parent_pid: The process that owns this worker; the worker exits when it dies.
        use_pdeathsig: Ask the kernel for SIGKILL when the direct parent dies (safe only when
            the direct parent is single-threaded, as the forkserver is).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(stderr_conn.fileno(), 2)
    stderr_conn.close()
    faulthandler.enable(all_threads=False)  # the crashing env thread; not our watcher
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, f"{OS_NAME_PREFIX}{env_index}".encode()[:15])
    _exit_with_parent(libc, parent_pid, use_pdeathsig)

    try:
        env = cloudpickle.loads(env_fn_bytes)()
        description = EnvDescription(
            observation_space=env.observation_space,
            action_space=env.action_space,
            metadata=dict(env.metadata),
            render_mode=env.render_mode,
            spec=_picklable_or_none(env.spec),
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises EnvError
        write_message(conn.fileno(), encode((Status.ERROR, _failure(exc))))
        return
    write_message(conn.fileno(), encode((Status.OK, description)))

    is_closed_by_parent = False
    try:
        _serve(conn, env, _make_obs_check(env.observation_space), env_index)
        is_closed_by_parent = True
    except KeyboardInterrupt:
        pass
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.debug("env %d: pipe closed; worker exits", env_index)
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - closing is best effort; the process exits next
            traceback.print_exc()
        if is_closed_by_parent:
            try:
                write_message(conn.fileno(), encode((Status.OK, None)))
            except (BrokenPipeError, ConnectionResetError):
                pass
        conn.close()


def _serve(conn: Connection, env: gym.Env, check_obs: ObsCheck | None, env_index: int) -> None:
    """Answer requests one at a time; return on CLOSE (the caller closes the env and replies).

    Until the parent sends ATTACH, observations travel in the replies. After it, a request
    with a slot writes them into that slot of shared memory, and the reply carries only what
    does not fit there: the info dict when it is not empty, and a final observation. A fast
    request is answered with a DONE record on the shared done pipe, written before any reply
    on our own pipe, so the parent never waits on our pipe for a reply that is not coming.
    """
    writer: SlotWriter | None = None

    def reset(payload: tuple[int | None, dict[str, Any] | None, int | None]) -> Any:
        seed, options, slot = payload
        obs, info = env.reset(seed=seed, options=options)
        if check_obs is not None:
            _raise_on_bad_obs(check_obs, obs)
        if slot is None:
            return obs, info
        assert writer is not None
        writer.write_obs(slot, obs)
        return (None, info) if info else None

    def step(payload: tuple[Any, bool, int | None]) -> Any:
        action, autoreset, slot = payload
        obs, reward, terminated, truncated, info = env.step(action)
        if check_obs is not None:
            _raise_on_bad_obs(check_obs, obs)
        is_reset = autoreset and (terminated or truncated)
        if slot is None:
            reset_result = reset((None, None, None)) if is_reset else None
            return obs, reward, terminated, truncated, info, reset_result
        assert writer is not None
        writer.write_result(reward, terminated, truncated)
        if is_reset:  # the slot gets the new episode's first obs; the final one is pickled
            reset_reply = reset((None, None, slot))
            return obs, info, {} if reset_reply is None else reset_reply[1]
        writer.write_obs(slot, obs)
        return (None, info, None) if info else None

    def call(payload: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
        name, args, kwargs = payload
        attr = env.get_wrapper_attr(name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def set_attr(payload: tuple[str, Any]) -> None:
        env.set_wrapper_attr(*payload)

    def attach(payload: tuple[BatchLayout, int]) -> None:
        # The parent sends the fds only after this ack, so no read of ours can swallow them.
        nonlocal writer
        layout, slot_index = payload  # our position in the vector, which may be renumbered
        write_message(fd, encode((ok, None)))
        memory_fd = recv_handle(conn)
        writer = SlotWriter(layout, memory_fd, recv_handle(conn), slot_index)

    def fast_step(request: bytes) -> Any:
        assert writer is not None
        return step((writer.read_action(), bool(request[2]), request[1]))

    handlers: dict[int, Callable[[Any], Any]] = {
        Command.STEP: step,
        Command.RESET: reset,
        Command.RENDER: lambda _: env.render(),
        Command.CALL: call,
        Command.GET_ATTR: env.get_wrapper_attr,
        Command.SET_ATTR: set_attr,
        Command.ATTACH: attach,
    }
    fast_handlers: dict[int, tuple[Command, Callable[[bytes], Any]]] = {
        FAST_STEP: (Command.STEP, fast_step),
        FAST_RESET: (Command.RESET, lambda request: reset((None, None, request[1]))),
    }
    ok, error = int(Status.OK), int(Status.ERROR)
    fd = conn.fileno()
    read = MessageReader(fd).read
    while True:
        request = read()
        fast = fast_handlers.get(request[0])
        if fast is not None:
            command, handler = fast
            assert writer is not None
            seq = request[-1]
            try:
                result = handler(request)
            except Exception as exc:  # noqa: BLE001 - env errors go back to the parent as EnvError
                writer.notify(seq, DONE_REPLY)
                write_message(fd, encode((error, _failure(exc))))
                continue
            if result is None:
                writer.notify(seq, DONE_OK)
                continue
            writer.notify(seq, DONE_REPLY)
        else:
            command, payload = decode(request)
            if command == Command.CLOSE:
                return
            try:
                result = handlers[command](payload)
            except Exception as exc:  # noqa: BLE001 - env errors go back to the parent as EnvError
                write_message(fd, encode((error, _failure(exc))))
                continue
        try:
            reply = encode((ok, result))
        except _PICKLE_ERRORS as exc:
            reply = encode((error, _failure(_explain_unpicklable(Command(command), result, exc))))
        write_message(fd, reply)


def _failure(exc: BaseException) -> RemoteFailure:
    """Package an exception for the parent, keeping the object itself when it pickles."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
        kept: BaseException | None = exc
    except Exception:  # noqa: BLE001 - any pickling failure means "send the text only"
        kept = None
    return RemoteFailure(type(exc).__qualname__, str(exc), text, kept)


def _explain_unpicklable(command: Command, result: Any, exc: Exception) -> TypeError:
    """Name the info key (or the part of the reply) that could not be pickled."""
    info = None
    if command is Command.STEP:
        info = result[4] if len(result) == 6 else result[1]  # (final_obs, info, reset_info)
    elif command is Command.RESET:
        info = result[1]
    if isinstance(info, dict):
        for key, value in info.items():
            try:
                pickle.dumps(value)
            except _PICKLE_ERRORS as key_exc:
                return TypeError(
                    f"{command.name.lower()}() returned info[{key!r}] of type "
                    f"{type(value).__name__}, which cannot be pickled ({key_exc}); "
                    "return plain data in info"
                )
    return TypeError(
        f"the reply to {command.name.lower()}() cannot be pickled ({exc}); return plain data"
    )


def _picklable_or_none(value: Any) -> Any:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - a spec holding e.g. a lambda is dropped, not fatal
        return None
    return value


def _make_obs_check(space: gym.Space[Any]) -> ObsCheck | None:
    """Return a cheap check of an observation's shape and dtype, or None if the space has none.

    Shapes must match exactly. Dtypes must cast to the space's dtype within the same kind
    (float64 into float32 is accepted, as Gymnasium's batching does; float into uint8 is not).
    """
    if isinstance(space, gym.spaces.Box):
        shape, dtype = space.shape, space.dtype

        def check_box(obs: Any) -> str | None:
            array = obs if isinstance(obs, np.ndarray) else np.asarray(obs)
            if array.shape != shape or not np.can_cast(array.dtype, dtype, "same_kind"):
                return (
                    f"has shape {array.shape} and dtype {array.dtype}; "
                    f"expected shape {shape} and dtype {dtype}"
                )
            return None

        return check_box
    if isinstance(space, gym.spaces.Dict):
        checks = {key: _make_obs_check(sub) for key, sub in space.spaces.items()}

        def check_dict(obs: Any) -> str | None:
            if not isinstance(obs, dict) or obs.keys() != checks.keys():
                keys = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
                return f"has keys {keys!r}; expected {sorted(checks)!r}"
            for key, check in checks.items():
                problem = check(obs[key]) if check is not None else None
                if problem is not None:
                    return f"[{key!r}] {problem}"
            return None

        return check_dict
    if isinstance(space, gym.spaces.Tuple):
        tuple_checks = [_make_obs_check(sub) for sub in space.spaces]

        def check_tuple(obs: Any) -> str | None:
            if not isinstance(obs, tuple) or len(obs) != len(tuple_checks):
                return f"is {type(obs).__name__}; expected a tuple of {len(tuple_checks)}"
            for position, (check, item) in enumerate(zip(tuple_checks, obs, strict=True)):
                problem = check(item) if check is not None else None
                if problem is not None:
                    return f"[{position}] {problem}"
            return None

        return check_tuple
    return None


def _raise_on_bad_obs(check: ObsCheck, obs: Any) -> None:
    problem = check(obs)
    if problem is not None:
        raise ValueError(f"the observation {problem} (the env's observation_space)")


def _libc() -> Any:
    """Return libc with ``prctl`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl  # noqa: B018 - probe that the symbol exists
    except (OSError, AttributeError):
        return None
    return libc


def _exit_with_parent(libc: Any, parent_pid: int, use_pdeathsig: bool) -> None:
    """Make this process exit soon after ``parent_pid`` dies, however it dies."""
    if use_pdeathsig and libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # PDEATHSIG follows the direct parent thread, which under fork or spawn may be a pool
    # thread of the real parent; a pidfd (or a poll, without one) watches the process itself.
    threading.Thread(
        target=_wait_for_parent_exit, args=(parent_pid,), name="multienv-parent-watch", daemon=True
    ).start()


def _wait_for_parent_exit(parent_pid: int) -> None:
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        while _is_alive(parent_pid):
            time.sleep(_PARENT_POLL_S)
        os._exit(0)
    select.select([pidfd], [], [])
    os._exit(0)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
