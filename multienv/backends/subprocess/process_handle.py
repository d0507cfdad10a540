"""PARENT SIDE, subprocess backend: ``ProcessHandle``, the transport to one worker process.

It spawns the worker (or takes over a standby started ahead for a recycle), sends requests
on its pipe, waits for the reply and the process's death together (``reply_wait``), kills
it, and keeps the last lines it wrote to stderr. Linked into a vector
(``shm_link.SubprocessLink``), it sends what its ``WorkerSeat`` encodes (a step as a few
bytes, its actions in the vector's shared memory); the worker answers with one record on
the done pipe.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from multienv.backends.subprocess.cpu_claims import CpuClaim
from multienv.backends.subprocess.forking import module_server
from multienv.backends.subprocess.process_launch import (
    LinkPayload,
    Standby,
    WorkerRecipe,
    attach,
    send_attach,
)
from multienv.backends.subprocess.process_reaper import (
    PIPE_ERRORS,
    RETIRE_TIMEOUT_S,
    kill_now,
    reaper,
    stop_process,
)
from multienv.backends.subprocess.reply_wait import DONE_OK_REPLY, ReplyWait
from multienv.backends.subprocess.stderr_relay import StderrPipe
from multienv.backends.subprocess.worker_seat import WorkerSeat
from multienv.supervision.handles import Death
from multienv.wire.framing import (
    DONE_OK,
    PLANNED_FRAMES,
    MessageReader,
    encode,
    frame,
    write_frame,
)
from multienv.wire.procfs import resident_mb
from multienv.wire.protocol import (
    DONE_OK_RESULT,
    Batch,
    BatchResult,
    Reply,
    Request,
    StepPlan,
)
from multienv.wire.shared_memory import SharedBatch

logger = logging.getLogger(__name__)


class ProcessHandle(ReplyWait):
    """The transport to one daemon worker process hosting k envs (``WorkerHandle``).

    Args:
        recipe: How to start the worker process.
        spin_s: How long a wait for the worker polls without sleeping first, yielding the
            core between polls (``wait="spin"`` with a core to spare; see
            ``worker_settings``); 0 sleeps at once.
        cpu_claim: The CPU the worker is pinned to, held until the handle stops for good
            (respawns keep it; ``cpu_claims``).
    """

    def __init__(
        self, recipe: WorkerRecipe, spin_s: float = 0.0, cpu_claim: CpuClaim | None = None
    ) -> None:
        """Keep what a spawn needs; no process is started yet."""
        self._recipe = recipe
        self._spin_s = spin_s
        self._cpu_claim = cpu_claim
        self._env_index = recipe.env_index
        self._process: BaseProcess | None = None  # None once reaped
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._fd = -1  # self._conn's fd, where replies come
        # Once attached, requests go through a pipe of their own (``attach``); else conn.
        self._requests: Connection | None = None
        self._request_fd = -1  # where requests are written, directly
        self._reader: MessageReader | None = None
        self._poller: Any = None  # select.poll over the pipe, the sentinel and the done pipe
        self._stderr: StderrPipe | None = None
        # The last worker's StderrPipe.last_lines, kept once its pipe is closed.
        self._stderr_last_lines: Callable[[], tuple[str, ...]] = tuple
        self._is_attach_sent = False  # begin_link sent ATTACH to the current worker
        self._is_closing = threading.Event()
        # Set by abandon(), which may not take the Event's lock; read with _is_closing.
        self._is_abandoned = False
        self._standby: Standby | None = None  # a recycle's replacement, started ahead
        self._ready_reply: Reply | None = None  # a standby's, for the handshake after spawn
        self._reaped: list[threading.Event] = []  # set when a retired worker is gone
        self._seat = WorkerSeat(None, -1, [])  # its place in a vector (SubprocessLink's)
        self._notify_seq = 0  # the in-flight fast batch's seq; 0 when its reply is a message
        self._is_counted = False  # the in-flight batch is one of a round's (``done_pipes``)

    @property
    def pid(self) -> int | None:
        """Process id of the current worker; None before ``spawn()``."""
        return self._pid

    @property
    def is_linked(self) -> bool:
        """Whether observations travel through a vector's shared memory."""
        return self._seat.shared is not None

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines the current (or last) worker wrote to stderr."""
        return self._stderr_last_lines()

    # ----------------------------------------------------------------- process

    def spawn(self, *, is_quiet: bool = False) -> None:
        """Start a new worker process (or take the standby); its envs are built meanwhile.

        ``is_quiet``: its stderr is kept for the crash report, not forwarded (a crash loop's).
        """
        self._release()
        standby, self._standby = self._standby, None
        ready: Reply | None = None
        taken = None if standby is None else standby.take()
        if taken is not None:
            launched, ready = taken
        else:
            launched = self._recipe.launch(is_quiet=is_quiet)
        self._ready_reply = ready
        process = launched.process
        self._process, self._conn, self._pid = process, launched.conn, process.pid
        self._fd = launched.conn.fileno()
        self._requests = launched.requests  # a standby's, attached ahead
        self._request_fd = self._fd if self._requests is None else self._requests.fileno()
        self._reader = launched.reader
        # Registered once per worker: a poll() per reply is one syscall, where
        # multiprocessing.connection.wait() builds a new selector on every call.
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(process.sentinel, select.POLLIN)
        if self._seat.shared is not None:
            self._poller.register(self._seat.done_read, select.POLLIN)
        self._stderr, self._stderr_last_lines = launched.stderr, launched.stderr.last_lines

    def prestart(self) -> None:
        """Start a standby worker, which the next ``spawn()`` takes over; idempotent."""
        if self._standby is None and not self._is_closing.is_set():
            self._standby = Standby(self._recipe, self._standby_link, self._is_closing)

    def _standby_link(self, pid: int) -> LinkPayload | None:
        return None if self._seat.shared is None else self._seat.link_payload(pid)

    def retire(self) -> None:
        """Ask the current worker to close its envs and exit; reaped on a background thread.

        The handle can ``spawn()`` at once; ``stop()`` waits for the retired workers.
        """
        process, conn, stderr = self._process, self._conn, self._stderr
        if process is None or conn is None:
            return
        requests, self._requests = self._requests, None
        self._process = self._conn = self._stderr = None
        self._reaped = [gone for gone in self._reaped if not gone.is_set()]  # a week of them
        self._reaped.append(reaper.stop(process, conn, stderr, requests))

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
            requests, self._requests = self._requests, None
            stop_process(process, conn, stderr, timeout_s, requests)
            self._process = self._conn = self._stderr = None
        self._release()
        for reaped in self._reaped:
            reaped.wait(max(0.0, timeout_s - (time.monotonic() - began)) + RETIRE_TIMEOUT_S)
        self._reaped.clear()
        if self._cpu_claim is not None:
            self._cpu_claim.release()

    def abandon(self) -> None:
        """Kill the worker and its standby now, with no lock, thread or wait (``WorkerHandle``).

        The worker is not reaped here: a served worker's server reaps it, and
        multiprocessing reaps its own children at their next start or at exit. The pipes
        close with their objects, once no thread waits on them.
        """
        self._is_abandoned = True
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.abandon()
        process = self._process
        if process is not None:
            kill_now(process)
        if self._cpu_claim is not None:
            self._cpu_claim.release()

    def _release(self) -> None:
        self._is_attach_sent = False
        if self._requests is not None:
            self._requests.close()
            self._requests = None
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
        self._is_counted = False
        self._send(frame(encode(request)))

    def collect(self, deadline: float | None) -> Reply | Death:
        """Wait for the call's reply, the worker's death, or the deadline (then kill it)."""
        return self._receive(deadline)

    def submit_batch(self, batch: Batch) -> None:
        """Send a batch: as a few bytes when everything fits in shared memory, else pickled."""
        message, self._notify_seq = self._seat.batch_frame(batch)
        self._is_counted = False
        self._send(message)

    def submit_planned(self, plan: StepPlan, env_slice: slice, deadline: float | None) -> None:
        """Send this worker's slice of a planned step: its items are in shared memory.

        In a round (``plan.is_counted``), its batch is counted when its slice has others;
        ``deadline`` is when it is late (``collect_planned`` gets the same).
        """
        self._seat.next_seq()
        self.take_planned(plan, env_slice, deadline)
        self._send(PLANNED_FRAMES[self._is_counted])

    def take_planned(self, plan: StepPlan, env_slice: slice, deadline: float | None) -> None:
        """This worker's slice of a planned step is in flight under its seq; join its round."""
        seat = self._seat
        assert seat.shared is not None
        is_counted = plan.is_counted and seat.has_others
        if is_counted:
            done, process = seat.shared.done, self._process
            if process is None:  # no worker to take a token: give it up now
                done.leave_round(seat.worker_number)
                is_counted = False
            else:
                done.join_round(seat.worker_number, process.sentinel, deadline)
        seat.take_planned(plan, env_slice)
        self._notify_seq = seat.seq
        self._is_counted = is_counted

    def plane_fds(self) -> tuple[int, int] | None:
        """The fds a vector's data plane writes and watches: the pipe and the sentinel."""
        process = self._process
        if process is None or self._conn is None:
            return None
        return self._request_fd, process.sentinel

    @property
    def spin_s(self) -> float:
        """How long a wait for the worker polls before it sleeps (0: it sleeps at once)."""
        return self._spin_s

    def leave_round(self) -> None:
        """This worker's part of a round goes as a general batch, or not at all (``done_pipes``)."""
        seat = self._seat
        if seat.shared is not None:
            seat.shared.done.leave_round(seat.worker_number)

    def collect_planned(self, deadline: float | None) -> BatchResult | Death | None:
        """Wait for this worker's slice of a plan: None when all of it is in shared memory."""
        shared, worker_number, seq = self._seat.shared, self._seat.worker_number, self._notify_seq
        if shared is not None and seq and shared.done.done_seq[worker_number] == seq:
            if shared.done.done_kind[worker_number] == DONE_OK:  # the usual case: no wait at all
                self._notify_seq = 0
                shared.done.take(worker_number, self._is_counted)
                return DONE_OK_RESULT
        reply = self._receive(deadline)
        if reply is DONE_OK_REPLY:
            return DONE_OK_RESULT
        return reply if isinstance(reply, Death) else self._seat.result(reply)

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        """Wait for the batch's result, or the worker's death."""
        reply = self._receive(deadline)
        return reply if isinstance(reply, Death) else self._seat.result(reply)

    def read_obs(self, position: int) -> Any:
        """The observation the env at ``position`` is on in shared memory; None if unlinked."""
        return self._seat.read_obs(position)

    # ----------------------------------------------------------------- the vector's link

    def begin_link(self) -> None:
        """Send the worker the ATTACH command now; ``join_link`` waits for its ack.

        A vector sends it to all its workers before it joins them one by one, so that their
        acks cost one round trip, not one each.
        """
        if self._seat.shared is None or self._conn is None or self._is_attach_sent:
            return
        send_attach(self._request_fd, self._seat.link_payload(self._pid or 0))
        self._is_attach_sent = True

    def join_link(self, deadline: float | None) -> Death | None:
        """Send the shared memory and done pipe to the worker; two round trips (one if begun)."""
        if self._seat.shared is None:
            return None
        assert self._conn is not None
        self._notify_seq = 0
        is_sent, self._is_attach_sent = self._is_attach_sent, False
        attached = attach(
            self._conn,
            self._seat.link_payload(self._pid or 0),
            lambda: self._receive(deadline),
            is_sent,
            self._request_fd,
        )
        if isinstance(attached, Death):
            return attached
        if self._requests is not None:  # a new link: the worker reads the new pipe now
            self._requests.close()
        self._requests, self._request_fd = attached, attached.fileno()
        return None

    def set_link(
        self, shared: SharedBatch | None, worker_number: int, env_indices: Sequence[int]
    ) -> None:
        """Take this worker's place in a vector (``SubprocessLink`` calls it)."""
        old, self._seat = self._seat, WorkerSeat(shared, worker_number, env_indices)
        self._seat.seq = old.seq  # a late record of the old seat's batch must not answer
        if self._poller is None:
            return
        if old.shared is not None:
            try:
                self._poller.unregister(old.done_read)
            except KeyError:
                pass
        if shared is not None:
            self._poller.register(self._seat.done_read, select.POLLIN)

    @property
    def done_read(self) -> int:
        """The read end of the done pipe of this worker's slice; -1 when not linked."""
        return self._seat.done_read

    def has_record(self) -> bool:
        """Whether the DONE record of the in-flight fast batch has been read already."""
        return self._seat.has_record(self._notify_seq)

    def wait_handles(self) -> list[int] | None:
        """The fds that signal the end of the call in flight; None if there is no worker."""
        if self._process is None or self._conn is None:
            return None
        return [self._fd, self._process.sentinel]

    # ----------------------------------------------------------------- internals

    def _send(self, message: bytes) -> None:
        try:
            write_frame(self._request_fd, message)
        except (*PIPE_ERRORS, OSError):
            pass  # the worker is dead; _receive() sees its sentinel
