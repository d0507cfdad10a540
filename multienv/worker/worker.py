"""WORKER SIDE: process set-up and the pipe loop that serves an ``EnvRunner`` of k envs.

The worker talks to its parent only through the wire modules (``protocol``, ``framing``,
``shared_memory``). It ignores SIGINT (the parent got
the same Ctrl-C and owns shutdown), sends its stderr to the parent through a pipe (the parent
forwards it and keeps the last lines for crash reports), and exits by itself when the parent
process dies, even by SIGKILL. Once the parent attaches the vector's shared memory, the
worker reads its requests from the pipe that came with it (its socket then carries replies
and fds), a fast batch steps all the envs it names in one wake-up, writes their
observations, rewards and flags there, and answers with one DONE record.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from multienv.wire.autoreset import step_env
from multienv.wire.done_pipes import DoneNotifier
from multienv.wire.framing import (
    DONE_OK,
    DONE_REPLY,
    FAST_BATCH,
    FAST_BATCH_COUNTED,
    IS_AUTORESET,
    IS_INFO_COLUMNS,
    IS_KEEP_NP_RANDOM,
    IS_RESET,
    PLANNED_KINDS,
    MessageReader,
    decode,
    decode_fast_batch,
    encode,
    readable,
    slot_of,
    write_message,
)
from multienv.wire.protocol import Command, Order, Outcome, OwnerWatch, Reply, Request
from multienv.wire.shared_memory import BatchLayout, SlotWriter
from multienv.wire.space_bounds import dumps_compact
from multienv.wire.worker_settings import WorkerSettings
from multienv.worker.planned_step import PlannedStep
from multienv.worker.runner import (
    BuildError,
    EnvRunner,
    encode_reply,
    np_random_or_none,
    package_failure,
)

logger = logging.getLogger(__name__)
_perf_counter = time.perf_counter

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# glibc's mallopt parameters (malloc.h), and what keep_freed_heap sets them to.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_HEAP_BLOCK = 32 << 20  # blocks below this come from the heap, not from their own mmap
_HEAP_KEPT = 64 << 20  # free memory kept at the heap's top
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
OS_NAME_PREFIX = "multienv-w"  # /proc/<pid>/comm of a worker is this plus its first env index
_PARENT_POLL_S = 0.5  # fallback only, when pidfd_open is unavailable


def run_worker(
    conn: Connection,
    stderr_conn: Connection,
    env_fn_bytes: list[bytes],
    env_index: int,
    parent_pid: int,
    owner_watch: OwnerWatch,
    settings: WorkerSettings,
) -> None:
    """Build the envs, report their spaces, then serve requests until CLOSE or the pipe breaks.

    Args:
        conn: The worker's end of the command pipe.
        stderr_conn: Write end of a pipe that becomes this process's fd 2.
        env_fn_bytes: The cloudpickled env factories, one per env of this worker.
        env_index: Index of the worker's first env in its vector, for names and messages.
        parent_pid: The process that owns this worker; the worker exits when it dies.
        owner_watch: How: a thread, and PR_SET_PDEATHSIG when the direct parent is the
            single-threaded forkserver; nothing more when the module server watches.
        settings: Threads and CPU pinning, applied before the envs are built.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(stderr_conn.fileno(), 2)
    stderr_conn.close()
    faulthandler.enable(all_threads=False)  # the crashing env thread; not our watcher
    set_process_name(f"{OS_NAME_PREFIX}{env_index}")
    _exit_with_parent(parent_pid, owner_watch)
    settings.apply()

    runner = EnvRunner(env_fn_bytes)
    before = set(sys.modules)
    try:
        descriptions = runner.build()
    except BuildError as exc:
        write_message(conn.fileno(), encode(Reply(failure=exc.failure)))
        return
    modules = _imported_since(before)
    _warm_up()
    # Large uniform Box bounds travel as four numbers (``space_bounds``): Atari's frames
    # would cost 400 KiB a worker to pickle, and the parent to unpickle and keep.
    write_message(conn.fileno(), dumps_compact(Reply(descriptions, modules=modules)))

    is_closed_by_parent = False
    try:
        _Loop(conn, runner, settings.spin_s).serve()
        is_closed_by_parent = True
    except KeyboardInterrupt:
        pass
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.debug("worker of env %d: pipe closed; exits", env_index)
    finally:
        runner.close()
        if is_closed_by_parent:
            try:
                write_message(conn.fileno(), encode(Reply()))
            except (BrokenPipeError, ConnectionResetError):
                pass
        conn.close()


def _imported_since(before: set[str]) -> list[str]:
    """The modules imported since ``before`` that can be imported again by name.

    The parent's module server imports them, so that later workers share them.
    """
    return sorted(
        name
        for name in set(sys.modules) - before
        if not name.startswith(("__main__", "__mp_main__", "multienv"))
        and getattr(sys.modules[name], "__spec__", None) is not None
    )


def _warm_up() -> None:
    """Decode and encode a batch's messages once, before the worker says it is ready.

    A fresh process pays for the first run of each code path; unpickling its first NumPy
    generator alone takes about 0.3 ms. A recycle's replacement would pay that in the step
    that swaps it in, where its first reset brings the old env's generator.
    """
    order = Order(0, is_reset=True, np_random=np.random.default_rng(0))
    decode(encode(Request(Command.BATCH, -1, [order])))
    encode_reply(Reply([Outcome(info={})]), None)


class _Loop:
    """Answers requests one at a time; ``serve`` returns on CLOSE."""

    def __init__(self, conn: Connection, runner: EnvRunner, spin_s: float = 0.0) -> None:
        self.conn = conn
        self.fd = conn.fileno()  # replies go here, and fds come; requests until attached
        self.reader = MessageReader(self.fd, spin_s)  # of requests: a pipe's once attached
        self.runner = runner
        self.writer: SlotWriter | None = None  # set by ATTACH
        self.planned: PlannedStep | None = None  # set by ATTACH, when the envs are a run
        self.spin_s = spin_s
        self.is_trimmed = False  # the heap was trimmed after the first resets

    def _trim_once(self) -> None:
        """After the worker's first batch with resets, give the heap's free pages back.

        Once: what building the envs and their first reset left. Not at every reset, as
        autoresets are: each trim costs 0.2 ms or more, and the steps that follow fault
        the pages it gave back in again. From then on the heap keeps what a step frees
        (``keep_freed_heap``).
        """
        self.is_trimmed = True
        if self.planned is not None:
            self.planned.on_reset = None
        release_free_memory()
        keep_freed_heap()

    def serve(self) -> None:
        while True:
            reader = self.reader  # a new one after each ATTACH
            request = reader.read()
            kind = request[0]
            if kind in PLANNED_KINDS:
                assert self.planned is not None  # the parent plans only workers of a run
                if reader.is_empty:  # steps on, reading the pipe itself, while they come
                    reader.push(self.planned.serve(kind))
                elif self.planned.run(kind) and self.planned.on_reset is not None:
                    self.planned.on_reset()
                continue
            if self.planned is not None:
                self.planned.last_seq = 0
            if kind == FAST_BATCH or kind == FAST_BATCH_COUNTED:
                seq, raw_items = decode_fast_batch(request)
                self._fast_batch(seq, list(raw_items), kind == FAST_BATCH_COUNTED, False)
                continue
            message: Request = decode(request)
            if message.command is Command.CLOSE:
                return
            if message.command is Command.ATTACH:
                self._attach(message.payload)
                continue
            if message.command is Command.BATCH and self.writer is not None:
                try:
                    reply = self._batch(message.payload)
                except Exception as exc:  # noqa: BLE001 - reported to the parent, as EnvError
                    reply = Reply(failure=package_failure(exc, message.position))
            else:
                reply = self.runner.serve(message)
            write_message(self.fd, encode_reply(reply, message))
            if (
                not self.is_trimmed
                and message.command is Command.BATCH
                and any(order.is_reset for order in message.payload)
            ):
                self._trim_once()

    def _attach(self, payload: tuple[BatchLayout, int, list[int]]) -> None:
        # The parent sends the fds only after this ack, so no read of ours can swallow them.
        layout, worker_number, env_indices = payload
        write_message(self.fd, encode(Reply()))
        memory_fd = recv_handle(self.conn)
        done_fds = (recv_handle(self.conn), recv_handle(self.conn), recv_handle(self.conn))
        request_fd = recv_handle(self.conn)
        if not self.reader.is_empty:  # the parent waits for the acks: nothing can be here
            raise RuntimeError("a request came between ATTACH and its fds")
        if self.reader.fd != self.fd:
            os.close(self.reader.fd)  # the last link's pipe
        self.reader = MessageReader(request_fd, self.spin_s)
        self.use(SlotWriter(layout, memory_fd, DoneNotifier(worker_number, done_fds), env_indices))
        write_message(self.fd, encode(Reply()))

    def use(self, writer: SlotWriter) -> None:
        """Answer fast batches and planned steps through ``writer`` from now on."""
        self.writer = writer
        rows = writer.planned_rows()
        self.planned = None
        if rows is not None:
            self.planned = PlannedStep(
                rows, writer, self.runner, self._fast_batch, self.reader.fd, self.fd, self.spin_s
            )
            if not self.is_trimmed:
                self.planned.on_reset = self._trim_once

    def _batch(self, orders: list[Order]) -> Reply:
        """Run pickled orders whose observations go to shared-memory slots."""
        return Reply([self._run(order) for order in orders])

    def _run(self, order: Order) -> Outcome:
        outcome = self.runner.run(order)
        writer, slot = self.writer, order.slot
        if slot is None or outcome.failure is not None:
            return outcome
        assert writer is not None
        position = order.position
        writer.write_results(
            [position], [outcome.reward], [outcome.terminated], [outcome.truncated]
        )
        if outcome.reset is not None:  # the slot gets the new episode's first obs
            writer.write_obs(position, slot, outcome.reset[0])
            outcome.reset = (None, outcome.reset[1])  # the final obs stays in the reply
        else:
            writer.write_obs(position, slot, outcome.obs)
            outcome.obs = None
        return outcome

    def _fast_batch(
        self,
        seq: int,
        items: list[tuple[int, int]],
        is_counted: bool,
        is_planned: bool,
        is_round: bool = False,
    ) -> None:
        """Run a fast batch: everything but infos and errors goes through shared memory.

        ``items``: each env's ``(position, flags)``; ``is_counted``: one of a round's
        batches; ``is_planned``: a planned step, answered in the worker's status too;
        ``is_round``: of a data plane's round, where that status is the whole answer.
        Kept free of per-env objects: on cheap envs the loop costs as much as the envs.
        """
        began = _perf_counter()
        writer = self.writer
        assert writer is not None
        runner = self.runner
        envs, check = runner.envs, runner.check
        columns, env_indices = writer.infos, writer.env_indices
        writes_each_obs = writer.writes_each_obs
        actions = writer.read_actions(
            [position for position, flags in items if not flags & IS_RESET]
        )
        extras: dict[int, Outcome] = {}
        resets: set[int] = set()
        done_positions: list[int] = []
        observations: list[Any] = []  # small ones, by done position, written after the loop
        slots: list[int] = []
        rewards: list[Any] = []
        reward: Any
        terminations: list[Any] = []
        truncations: list[Any] = []
        next_action = 0
        for position, flags in items:
            try:
                if flags & IS_RESET:
                    resets.add(position)
                    obs, info = envs[position].reset()
                    check(position, obs)
                    reward, terminated, truncated = 0.0, False, False
                else:
                    action = actions[next_action]
                    next_action += 1  # before the step, which may raise
                    if flags & IS_AUTORESET:  # same-step autoreset: may reset it too
                        obs, reward, terminated, truncated, info, final = step_env(
                            envs[position], position, action, True, check
                        )
                        if final is not None:  # the slot gets the new episode's first obs
                            extras[position] = Outcome(final[0], info=final[1], reset=(None, info))
                            info = {}
                    else:  # step_env's plain step, inline: on cheap envs every call counts
                        obs, reward, terminated, truncated, info = envs[position].step(action)
                        check(position, obs)
            except Exception as exc:  # noqa: BLE001 - reported for this env only; siblings go on
                extras[position] = Outcome(failure=package_failure(exc, position))
                if flags & IS_INFO_COLUMNS:
                    columns.clear(env_indices[position])
                continue
            if flags & IS_INFO_COLUMNS:
                if not info:
                    columns.clear(env_indices[position])
                elif not columns.write(env_indices[position], info):
                    extras[position] = Outcome(info=info)
            elif info:
                extras[position] = Outcome(info=info)
            if flags & IS_KEEP_NP_RANDOM and (terminated or truncated):
                outcome = extras.setdefault(position, Outcome())
                outcome.np_random = np_random_or_none(envs[position])
            if writes_each_obs:  # while it is in the cache
                writer.write_obs(position, slot_of(flags), obs)
            else:
                observations.append(obs)
                slots.append(slot_of(flags))
            done_positions.append(position)
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
        if not writes_each_obs:
            writer.write_many_obs(done_positions, slots, observations)
        writer.write_results(done_positions, rewards, terminations, truncations)
        schemas = columns.take_pending() if columns.pending else None
        writer.note_batch_time(_perf_counter() - began)
        if not extras and schemas is None:
            writer.notifier.notify(seq, DONE_OK, is_counted, is_planned, is_round)
        else:
            writer.notifier.notify(seq, DONE_REPLY, is_counted, is_planned, is_round)
            write_message(self.fd, encode_reply(Reply(extras, schemas=schemas), None, resets))
        if resets and not self.is_trimmed:
            self._trim_once()


def set_process_name(name: str) -> None:
    """Show ``name`` (15 bytes at most) for this process in ``ps`` and ``top``; Linux only."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, name.encode()[:15])


@functools.cache
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


def release_free_memory() -> None:
    """Give the allocator's free pages back to the system (glibc's ``malloc_trim``).

    glibc keeps freed memory in its heap, resident, unless it is at the top. A worker calls
    this once, after its first batch with resets, where its envs dropped what their
    construction and first reset allocated: 0.9 MiB in a worker of 8 Pong envs. A fork
    source calls it before it forks workers: 2.5 MiB in the module server once it imported
    Pong's modules. It takes about 0.2 ms.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def keep_freed_heap() -> bool:
    """Let glibc keep the memory a step frees, rather than give it back and fault it in again.

    glibc gives the top of its heap back to the system whenever more than 128 KiB is free
    there. A fast batch holds its envs' observations until all are written, then drops them
    together: with Atari-sized frames of 100 KB that is more than 128 KiB at every step, so
    the next step faulted every page of them in again (about 21 page faults per env step; 4x
    slower than keeping them, on 16 such envs in one worker). This sets the thresholds that
    glibc's own adaptive rule ends at when a process frees large blocks: blocks up to 32 MiB
    come from the heap, and up to 64 MiB may stay free at its top. The user's own
    ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TOP_PAD_`` win.

    Returns:
        Whether the thresholds were set (glibc only).
    """
    if any(name in os.environ for name in MALLOC_VARIABLES):
        return False
    try:
        is_glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):
        is_glibc = False
    mallopt = getattr(_libc(), "mallopt", None)
    if not is_glibc or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT)
    )


def exit_with_direct_parent(expected_ppid: int) -> bool:
    """Ask for SIGKILL when the direct parent dies; exit now if it died already.

    Returns:
        False when the kernel call is unavailable (not Linux): nothing was set.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected_ppid:  # it died before the call took effect
        os._exit(0)
    return True


def warm_up() -> None:
    """Run the worker's first-time code paths in this process (``fork_source``).

    Loading libc and a message's encoding and decoding: workers forked from here inherit
    them warm.
    """
    _libc()
    _warm_up()


def _exit_with_parent(parent_pid: int, owner_watch: OwnerWatch) -> None:
    """Make this process exit soon after ``parent_pid`` dies, however it dies."""
    if owner_watch is OwnerWatch.SERVER:
        return  # the module server watches it, and PR_SET_PDEATHSIG is set
    if owner_watch is OwnerWatch.PDEATHSIG_AND_THREAD:
        exit_with_direct_parent(os.getppid())
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
    readable([pidfd], None)
    os._exit(0)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
