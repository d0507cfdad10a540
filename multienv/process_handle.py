"""PARENT SIDE, subprocess backend: ``ProcessHandle``, the transport to one worker process.

It spawns the worker (or takes over a standby started ahead for a recycle), sends requests
on its pipe, waits for the reply and the process's death together (``poll`` on the pipe,
the process sentinel and, when linked, its group's done pipe), kills it, and keeps the last
lines it wrote to stderr. Linked into a vector (``shm_link.SubprocessLink``), it writes
actions into the vector's shared memory and sends a step as a few bytes (``framing``); the
worker answers with one record on the done pipe.
"""

from __future__ import annotations

import logging
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
from gymnasium.error import ClosedEnvironmentError

from multienv import framing, module_server
from multienv.framing import DONE_OK, MessageReader, decode, encode, frame, write_frame
from multienv.handles import Death
from multienv.process_launch import (
    LinkPayload,
    Standby,
    WorkerRecipe,
    attach,
    poll_ms,
    send_attach,
)
from multienv.process_reaper import PIPE_ERRORS, RETIRE_TIMEOUT_S, reaper, stop_process
from multienv.procfs import resident_mb
from multienv.protocol import (
    PLANNED_OK,
    Batch,
    BatchResult,
    Command,
    Outcome,
    Reply,
    Request,
    StepPlan,
    failed_batch,
    unpack_outcomes,
)
from multienv.shared_memory import SharedBatch
from multienv.stderr_relay import StderrPipe

logger = logging.getLogger(__name__)

_DONE_OK_REPLY = Reply()  # what a DONE_OK record stands for


class ProcessHandle:
    """The transport to one daemon worker process hosting k envs (``WorkerHandle``).

    Args:
        recipe: How to start the worker process.
    """

    def __init__(self, recipe: WorkerRecipe) -> None:
        """Keep what a spawn needs; no process is started yet."""
        self._recipe = recipe
        self._env_index = recipe.env_index
        self._process: BaseProcess | None = None  # None once reaped
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._fd = -1  # self._conn's fd, written to directly
        self._reader: MessageReader | None = None
        self._poller: Any = None  # select.poll over the pipe, the sentinel and the done pipe
        self._stderr: StderrPipe | None = None
        self._stderr_tail: deque[str] = deque()  # kept once the pipe is closed
        self._is_attach_sent = False  # begin_link sent ATTACH to the current worker
        self._is_closing = threading.Event()
        self._standby: Standby | None = None  # a recycle's replacement, started ahead
        self._ready_reply: Reply | None = None  # a standby's, for the handshake after spawn
        self._reaped: list[threading.Event] = []  # set when a retired worker is gone
        # Set by SubprocessLink: the vector's shared memory and this worker's place in it.
        self._shared: SharedBatch | None = None
        self._worker_index = -1
        self._env_indices: list[int] = []  # the vector's index of each env, by position
        self._env_index_array = np.zeros(0, dtype=np.intp)
        self._env_slice: slice | None = None  # the vector's envs of this worker, if contiguous
        self._done_read = -1
        self._seq = 0  # of the last fast batch, 1 to 255
        self._notify_seq = 0  # the in-flight fast batch's seq; 0 when its reply is a message
        self._batch_env_ids: Any = None  # the in-flight batch's env indices (array or slice)
        self._batch_slots: np.ndarray | None = None  # and the slots it writes
        self._batch: Batch | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the current worker; None before ``spawn()``."""
        return self._pid

    @property
    def is_linked(self) -> bool:
        """Whether observations travel through a vector's shared memory."""
        return self._shared is not None

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines the current (or last) worker wrote to stderr."""
        return tuple(self._stderr_tail)

    # ----------------------------------------------------------------- process

    def spawn(self) -> None:
        """Start a new worker process (or take the standby); its envs are built meanwhile."""
        self._release()
        standby, self._standby = self._standby, None
        ready: Reply | None = None
        taken = None if standby is None else standby.take()
        if taken is not None:
            launched, ready = taken
        else:
            launched = self._recipe.launch()
        self._ready_reply = ready
        process = launched.process
        self._process, self._conn, self._pid = process, launched.conn, process.pid
        self._fd = launched.conn.fileno()
        self._reader = launched.reader
        # Registered once per worker: a poll() per reply is one syscall, where
        # multiprocessing.connection.wait() builds a new selector on every call.
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(process.sentinel, select.POLLIN)
        if self._shared is not None:
            self._poller.register(self._done_read, select.POLLIN)
        self._stderr, self._stderr_tail = launched.stderr, launched.stderr.tail

    def prestart(self) -> None:
        """Start a standby worker, which the next ``spawn()`` takes over; idempotent."""
        if self._standby is None and not self._is_closing.is_set():
            self._standby = Standby(self._recipe, self._standby_link, self._is_closing)

    def _standby_link(self, pid: int) -> LinkPayload | None:
        return None if self._shared is None else self._link_payload(pid)

    def retire(self) -> None:
        """Ask the current worker to close its envs and exit; reaped on a background thread.

        The handle can ``spawn()`` at once; ``stop()`` waits for the retired workers.
        """
        process, conn, stderr = self._process, self._conn, self._stderr
        if process is None or conn is None:
            return
        self._process = self._conn = self._stderr = None
        self._reaped = [gone for gone in self._reaped if not gone.is_set()]  # a week of them
        self._reaped.append(reaper.stop(process, conn, stderr))

    def rss_mb(self) -> float | None:
        """Resident memory of the current worker in MiB; None if it cannot be read."""
        return None if self._pid is None else resident_mb(self._pid)

    def handshake(self, deadline: float | None) -> Reply | Death:
        """Wait for the worker's envs; a linked worker is then attached to the shared memory."""
        if self._ready_reply is not None:  # a standby's: built and attached ahead
            ready, self._ready_reply = self._ready_reply, None
            return ready
        reply = self._receive(deadline)
        if isinstance(reply, Reply) and reply.failure is None:
            module_server.learn(self._recipe.context, reply.modules, self._recipe.is_probe)
            death = self.join_link(deadline)  # None when not linked
            if death is not None:
                return death
        return reply

    def kill(self) -> None:
        """Kill the worker at once, reap it and release its pipes."""
        process = self._process
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(5.0)
        self._release()

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout_s``. Idempotent.

        A standby worker is stopped too, and retired workers are waited for.
        """
        self._is_closing.set()
        began = time.monotonic()
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()
        process, conn, stderr = self._process, self._conn, self._stderr
        if process is not None and conn is not None:
            # The fields stay set meanwhile: a thread waiting on this worker sees it go,
            # and raises ClosedEnvironmentError instead of reporting a death.
            stop_process(process, conn, stderr, timeout_s)
            self._process = self._conn = self._stderr = None
        self._release()
        for reaped in self._reaped:
            reaped.wait(max(0.0, timeout_s - (time.monotonic() - began)) + RETIRE_TIMEOUT_S)
        self._reaped.clear()

    def _release(self) -> None:
        self._is_attach_sent = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._stderr is not None:
            self._stderr.join(1.0)  # its EOF arrives once the worker's fd 2 is closed
            self._stderr = None
        if self._process is not None and self._process.exitcode is not None:
            self._process.close()  # releases its sentinel fd
            self._process = None

    # ----------------------------------------------------------------- calls

    def submit(self, request: Request) -> None:
        """Send one pickled call; a dead worker is noticed by ``collect``."""
        self._notify_seq = 0
        self._send(frame(encode(request)))

    def collect(self, deadline: float | None) -> Reply | Death:
        """Wait for the call's reply, the worker's death, or the deadline (then kill it)."""
        return self._receive(deadline)

    def submit_batch(self, batch: Batch) -> None:
        """Send a batch: as a few bytes when everything fits in shared memory, else pickled."""
        self._batch = batch
        self._notify_seq = 0
        shared = self._shared
        if shared is None:
            self._batch_env_ids = None
            self._send(frame(encode(Request(Command.BATCH, -1, batch.orders()))))
            return
        size = len(batch.positions)
        # A whole worker of contiguous envs, or a single env, is a slice: no fancy indexing.
        env_ids: Any
        if batch.is_whole and self._env_slice is not None:
            env_ids = self._env_slice
        elif size == 1:
            env_index = self._env_indices[batch.positions[0]]
            env_ids = slice(env_index, env_index + 1)
        else:
            env_ids = self._env_index_array[batch.positions]
        slots = shared.next_slots(env_ids)
        self._batch_env_ids, self._batch_slots = env_ids, slots
        is_reset = batch.is_reset
        num_resets = int(np.count_nonzero(is_reset))
        is_fast = (
            num_resets == size
            or (shared.actions is not None and _same_dtype(batch.actions, shared.actions))
        ) and (batch.seeds is None and batch.options is None and batch.np_randoms is None)
        if not is_fast:
            orders = batch.orders()
            for order, slot in zip(orders, slots.tolist(), strict=True):
                object.__setattr__(order, "slot", slot)
            self._send(frame(encode(Request(Command.BATCH, -1, orders))))
            return
        if shared.actions is not None and num_resets < size:
            if not num_resets:
                shared.actions[env_ids] = batch.actions
            else:
                steps = ~is_reset
                shared.actions[np.arange(shared.num_envs)[env_ids][steps]] = np.asarray(
                    batch.actions
                )[steps]
        self._seq = self._notify_seq = self._seq % 255 + 1
        flags = framing.item_flags(is_reset, slots, batch.autoreset, batch.keep_np_randoms)
        items = framing.encode_items(batch.positions, flags)
        self._send(framing.fast_batch_frame(self._seq, items))

    def submit_planned(self, plan: StepPlan, env_slice: slice) -> None:
        """Send this worker's slice of a planned step: its items were encoded for all envs."""
        wire: framing.PlannedItems = plan.wire
        self._batch = None
        self._batch_env_ids, self._batch_slots = env_slice, wire.slots[env_slice]
        self._seq = self._notify_seq = self._seq % 255 + 1
        self._send(framing.fast_batch_frame(self._seq, wire.items_of(env_slice)))

    def collect_planned(self, deadline: float | None) -> BatchResult | Death | None:
        """Wait for this worker's slice of a plan: None when all of it is in shared memory."""
        reply = self._receive(deadline)
        if reply is _DONE_OK_REPLY:
            return PLANNED_OK
        return reply if isinstance(reply, Death) else self._batch_result(reply)

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        """Wait for the batch's result, or the worker's death."""
        reply = self._receive(deadline)
        return reply if isinstance(reply, Death) else self._batch_result(reply)

    def _batch_result(self, reply: Reply) -> BatchResult:
        """The result of the batch in flight, from its reply and the shared memory."""
        batch, env_ids = self._batch, self._batch_env_ids
        is_planned = batch is None
        if reply.schemas and self._shared is not None:
            self._shared.infos.register(self._worker_index, reply.schemas)
        if batch is None:  # a planned step's slice
            assert isinstance(env_ids, slice)
            count = env_ids.stop - env_ids.start
            batch = self._batch = Batch(
                list(range(count)), np.zeros(count, dtype=np.bool_), None, is_whole=True
            )
        if reply.failure is not None:  # the request itself failed; blame every item
            return failed_batch(len(batch.positions), reply.failure, env_ids is None)
        shared = self._shared
        if env_ids is None or shared is None:
            return unpack_outcomes(reply.value)
        if isinstance(reply.value, list):  # a pickled batch; the obs are in shared memory
            result = unpack_outcomes(reply.value)
            result.obs = None
        else:
            extras: dict[int, Outcome] = {}
            if reply.value:
                item_of = {position: item for item, position in enumerate(batch.positions)}
                extras = {item_of[position]: extra for position, extra in reply.value.items()}
            flags = shared.flags
            result = BatchResult(
                shared.rewards[env_ids].copy(),  # copies: the next batch writes over them
                flags[0, env_ids].copy(),
                flags[1, env_ids].copy(),
                None,
                extras,
                info_columns=is_planned,
            )
        assert self._batch_slots is not None
        if result.extras:
            ok = np.array(
                [
                    item not in result.extras or result.extras[item].failure is None
                    for item in range(len(batch.positions))
                ]
            )
            shared.move_to(np.arange(shared.num_envs)[env_ids][ok], self._batch_slots[ok])
        else:
            shared.move_to(env_ids, self._batch_slots)
        return result

    def read_obs(self, position: int) -> Any:
        """The observation the env at ``position`` is on in shared memory; None if unlinked."""
        if self._shared is None or self._env_indices[position] < 0:
            return None
        return self._shared.read(self._env_indices[position])

    # ----------------------------------------------------------------- the vector's link

    def begin_link(self) -> None:
        """Send the worker the ATTACH command now; ``join_link`` waits for its ack.

        A vector sends it to all its workers before it joins them one by one, so that their
        acks cost one round trip, not one each.
        """
        if self._shared is None or self._conn is None or self._is_attach_sent:
            return
        send_attach(self._conn, self._link_payload(self._pid or 0))
        self._is_attach_sent = True

    def join_link(self, deadline: float | None) -> Death | None:
        """Send the shared memory and done pipe to the worker; two round trips (one if begun)."""
        if self._shared is None:
            return None
        assert self._conn is not None
        self._notify_seq = 0
        is_sent, self._is_attach_sent = self._is_attach_sent, False
        return attach(
            self._conn,
            self._link_payload(self._pid or 0),
            lambda: self._receive(deadline),
            is_sent,
        )

    def _link_payload(self, pid: int) -> LinkPayload:
        """What ``_attach`` sends worker ``pid``: the ATTACH payload and the two fds."""
        shared = self._shared
        assert shared is not None
        assert shared.fd is not None
        payload = (shared.layout, self._worker_index, self._env_indices)
        return payload, shared.fd, shared.done_write(self._worker_index), pid

    def set_link(
        self, shared: SharedBatch | None, worker_index: int, env_indices: Sequence[int]
    ) -> None:
        """Remember this worker's place in a vector (``SubprocessLink`` calls it)."""
        if self._shared is not None and self._poller is not None:
            try:
                self._poller.unregister(self._done_read)
            except KeyError:
                pass
        self._shared, self._worker_index = shared, worker_index
        self._env_indices = list(env_indices)
        self._env_index_array = np.asarray(self._env_indices, dtype=np.intp)
        first, count = (self._env_indices or [0])[0], len(self._env_indices)
        is_contiguous = count > 0 and self._env_indices == list(range(first, first + count))
        self._env_slice = slice(first, first + count) if is_contiguous else None
        self._done_read = -1 if shared is None else shared.done_read(worker_index)
        if shared is not None and self._poller is not None:
            self._poller.register(self._done_read, select.POLLIN)

    @property
    def done_read(self) -> int:
        """The read end of the done pipe of this worker's group; -1 when not linked."""
        return self._done_read

    def has_record(self) -> bool:
        """Whether the DONE record of the in-flight fast batch has been read already."""
        seq, shared = self._notify_seq, self._shared
        return bool(seq) and shared is not None and shared.done_seq[self._worker_index] == seq

    def wait_handles(self) -> list[int] | None:
        """The fds that signal the end of the call in flight; None if there is no worker."""
        if self._process is None or self._conn is None:
            return None
        return [self._fd, self._process.sentinel]

    # ----------------------------------------------------------------- internals

    def _send(self, message: bytes) -> None:
        try:
            write_frame(self._fd, message)
        except (*PIPE_ERRORS, OSError):
            pass  # the worker is dead; _receive() sees its sentinel

    def _receive(self, deadline: float | None) -> Reply | Death:
        """Wait for one reply or the worker's death, whichever comes first, up to ``deadline``.

        The reply to a fast batch is its DONE record on the shared done pipe; every wait also
        drains that pipe, since the records of the vector's other workers arrive there too,
        and they are noted for when their workers are collected.
        """
        process, shared = self._process, self._shared
        if self._is_closing.is_set():
            raise ClosedEnvironmentError(f"env {self._env_index}: closed while a call was waiting.")
        if process is None:
            return Death("unknown")
        seq = self._notify_seq
        worker_index = self._worker_index
        while True:
            if seq and shared is not None and shared.done_seq[worker_index] == seq:
                shared.done_seq[worker_index] = 0
                self._notify_seq = 0  # a late record of this batch must not answer a later one
                if shared.done_kind[worker_index] == DONE_OK:
                    return _DONE_OK_REPLY
                seq = 0  # the reply follows on our own pipe
            try:
                events = self._poller.poll(poll_ms(deadline, time.monotonic()))
            except (OSError, ValueError):
                events = [(process.sentinel, 0)]  # close() on another thread closed the pipe
            if self._is_closing.is_set():
                raise ClosedEnvironmentError(
                    f"env {self._env_index}: closed while a call was waiting."
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
                    self._notify_seq = 0
                    reply: Reply = decode(self._reader.read())
                    return reply
                except PIPE_ERRORS:
                    pass
            elif not fds:
                logger.info(  # the supervisor logs the death at WARNING
                    "env %d: worker pid %d timed out; killing it", self._env_index, process.pid
                )
                process.kill()
                process.join(5.0)
                return Death("timeout")
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
            return Death(_describe_exit(process.exitcode))


def _same_dtype(actions: Any, shared_actions: np.ndarray) -> bool:
    """Whether actions can go through shared memory uncast, as Gymnasium's vector envs pass them.

    The env must get them as the caller gave them; other dtypes are pickled.
    """
    return isinstance(actions, np.ndarray) and actions.dtype == shared_actions.dtype


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
