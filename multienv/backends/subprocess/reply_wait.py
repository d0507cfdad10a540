"""PARENT SIDE, subprocess backend: how a ``ProcessHandle`` waits for its worker's answer.

A wait ends on the worker's reply, its death or the deadline, whichever comes first:
``poll`` on the worker's pipe, its process sentinel and, when linked into a vector, its
slice's done pipe, where a fast batch's reply is its DONE record (``done_pipes``). A wait
for one of a round's batches also watches the round's other workers, and gives up the
token of one that dies. ``ReplyWait`` holds that half of ``ProcessHandle``; spawning,
sending and stopping stay in ``process_handle``.
"""

from __future__ import annotations

import logging
import select
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from gymnasium.error import ClosedEnvironmentError

from multienv.backends.subprocess.process_launch import poll_ms
from multienv.backends.subprocess.process_reaper import PIPE_ERRORS
from multienv.supervision.handles import Death
from multienv.wire.framing import DONE_OK, decode, poll_hot
from multienv.wire.protocol import Reply

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from multienv.backends.subprocess.worker_seat import WorkerSeat
    from multienv.wire.framing import MessageReader

logger = logging.getLogger(__name__)

DONE_OK_REPLY = Reply()  # what a DONE_OK record stands for


class ReplyWait:
    """The waits of a ``ProcessHandle`` (which inherits it) for its worker."""

    if TYPE_CHECKING:  # what it uses of the handle
        _process: BaseProcess | None
        _seat: WorkerSeat
        _is_closing: threading.Event
        _is_abandoned: bool
        _env_index: int
        _notify_seq: int
        _is_counted: bool
        _poller: Any
        _spin_s: float
        _fd: int
        _reader: MessageReader | None

    def _receive(self, deadline: float | None) -> Reply | Death:
        """Wait for one reply or the worker's death, whichever comes first, up to ``deadline``.

        The reply to a fast batch is its DONE record (``done_pipes``); every wait also reads
        the slice's records, since the records of the vector's other workers arrive there
        too, and they are noted for when their workers are collected. A wait for one of a
        round's batches also watches the round's other workers (``_wait_in_round``).
        """
        process, seat = self._process, self._seat
        shared = seat.shared
        if self._is_closing.is_set() or self._is_abandoned:
            raise _closed_while_waiting(self._env_index)
        if process is None:
            return Death("unknown")
        seq = self._notify_seq
        worker_number, done_read = seat.worker_number, seat.done_read
        done = None if shared is None else shared.done
        while True:
            if seq and done is not None and done.done_seq[worker_number] == seq:
                self._notify_seq = 0  # a late record of this batch must not answer a later one
                if done.take(worker_number, self._is_counted) == DONE_OK:
                    return DONE_OK_REPLY
                seq = 0  # the reply follows on our own pipe
            is_mate_late = False  # a wait in a round ended by another worker's deadline
            try:
                events = poll_hot(self._poller.poll, self._spin_s) if self._spin_s else []
                if not events:
                    wake_at = deadline
                    if seq and self._is_counted and done is not None:
                        done.drain_quiet(done_read)  # a record there wakes no one
                        if done.done_seq[worker_number] == seq:
                            continue
                        mates = done.round_deadline(worker_number)
                        if mates is not None and (wake_at is None or mates < wake_at):
                            wake_at, is_mate_late = mates, True
                        events = self._wait_in_round(poll_ms(wake_at, time.monotonic()))
                    else:
                        events = self._poller.poll(poll_ms(wake_at, time.monotonic()))
            except (OSError, ValueError):
                events = [(process.sentinel, 0)]  # close() on another thread closed the pipe
            if self._is_closing.is_set() or self._is_abandoned:
                raise _closed_while_waiting(self._env_index)
            fds = [fd for fd, _ in events]
            is_timeout = not fds
            if done is not None and (is_timeout or done_read in fds):
                done.drain(done_read)  # on a timeout too: a round's record may be in
                if done_read in fds:
                    fds.remove(done_read)
                if seq and done.done_seq[worker_number] == seq:
                    continue  # answered: taken at the top
                if not fds and not is_timeout:
                    continue  # records of other workers only
            if self._is_counted and fds:
                fds = _note_deaths_in_round(seat, fds, (self._fd, process.sentinel))
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
            elif not fds and is_mate_late:
                assert done is not None
                done.break_round(worker_number)  # it wakes the parent now; the late one is next
                continue
            elif not fds:
                logger.info(  # the supervisor logs the death at WARNING
                    "env %d: worker pid %d timed out; killing it", self._env_index, process.pid
                )
                process.kill()
                process.join(5.0)
                self._leave_round_dead()
                return Death("timeout")
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
            self._leave_round_dead()
            return Death(_describe_exit(process.exitcode))

    def _wait_in_round(self, timeout_ms: int | None) -> list[tuple[int, int]]:
        """Sleep on the worker, its slice's done pipe and the deaths of its round's others.

        A worker of the round that dies takes no token, so the one that finishes last may
        take one and wake no one; seeing the death, the parent gives its token up instead.
        """
        seat, process = self._seat, self._process
        assert seat.shared is not None
        assert process is not None
        poller = select.poll()
        for fd in (self._fd, process.sentinel, seat.done_read):
            poller.register(fd, select.POLLIN)
        for fd in seat.shared.done.round_sentinels(seat.worker_number):
            poller.register(fd, select.POLLIN)
        events: list[tuple[int, int]] = poller.poll(timeout_ms)
        return events

    def _leave_round_dead(self) -> None:
        """The worker died in a round: give its token up (a second one costs one wake-up)."""
        if self._is_counted and self._seat.shared is not None and self._process is not None:
            self._is_counted = False
            self._seat.shared.done.leave_round(
                self._seat.worker_number, sentinel=self._process.sentinel
            )


def _note_deaths_in_round(seat: WorkerSeat, fds: list[int], own: tuple[int, int]) -> list[int]:
    """Give up the tokens of the round's other workers whose death ``fds`` show.

    Returns the fds of ``fds`` that are the worker's own (``own``: its pipe and sentinel).
    """
    assert seat.shared is not None
    for fd in fds:
        if fd not in own:
            seat.shared.done.leave_round(seat.worker_number, sentinel=fd)
    return [fd for fd in fds if fd in own]


def _closed_while_waiting(env_index: int) -> ClosedEnvironmentError:
    return ClosedEnvironmentError(f"env {env_index}: closed while a call was waiting.")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
