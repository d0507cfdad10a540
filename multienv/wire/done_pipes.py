"""BOTH SIDES: how a vector's workers tell the parent that a fast batch is done.

A worker that finishes a fast batch (``framing``) sends a ``DONE_RECORD``: its worker index,
the batch's seq and ``DONE_OK`` or ``DONE_REPLY``. The records travel through pipes that the
workers of one *slice* share (the workers one parent thread collects; one set of pipes per
slice, because a thread that read another thread's record would leave that thread asleep):

- the *done pipe*, which the parent sleeps on: a record written there wakes it;
- the *quiet pipe*, which the parent only reads: a record there wakes nobody;
- the *token pipe*, which counts the workers of a round.

A vector's planned step is a *round*: each worker of a slice of two or more gets a counted
batch (``FAST_BATCH_COUNTED``), and the parent puts one token fewer than those workers in
the slice's token pipe (``DoneChannels.open_round``). A worker that finishes a counted batch
writes its record to the quiet pipe, then takes a token; the one that finds none is the
last, and writes its record to the done pipe as well (``DoneNotifier``). So the parent is
woken once a step, by the last worker, not once per worker: a wake-up while another worker
still steps takes that worker's core, or the parent's, for nothing. Any other batch writes
its record to the done pipe at once, as every batch did before rounds.

The rules that keep a round from losing its wake-up:

- the parent drains stale tokens before it puts a round's in, unless it collected every
  worker of the slice's last round from its counted record: each of those took a token or
  found none after its batch, so none is left (``open_round``);
- a worker of the round that will not finish a counted batch (its step falls back to a
  general batch, or is not sent, or the worker is dead) has its token given up by the
  parent (``leave_round``);
- while the parent sleeps on a counted batch, it also waits on the deaths of the round's
  other workers (``round_sentinels``), and gives a dead one's token up;
- before each sleep on a counted batch, the parent reads the quiet pipe: a worker that took
  a token which a dead or absent one left over has finished without waking anyone;
- a sleep on a counted batch ends by the earliest deadline of the round's workers still
  stepping (``round_deadline``), not only the awaited one's: a worker with no deadline of
  its own (a reset with no ``reset_timeout``) may finish quietly while another hangs. When
  another's deadline ends it, the parent takes the tokens left (``break_round``), so that
  every worker finishing from then on wakes it, and goes on to the late one, which it kills.

So the last worker still stepping always finds no token, and a worker done before the
parent gave a token up is found in the quiet pipe. A token given up twice only costs a
wake-up more.

Records are pipe data, not flags in shared memory: a pipe is ordered for every reader, so a
record read is one whose results are all in shared memory, on any CPU. The parent keeps only
the record of the batch it is waiting for from each worker (``expect``): a record from an
earlier batch, in either pipe, is dropped.

A planned step (``framing.PLANNED_STEP``) is also answered in shared memory: after its
record, a worker that has everything in shared memory writes the step's seq into its
*status* (``DoneNotifier.notify``), before it takes a token or wakes the parent. So once the
parent is woken by a round's last worker, every worker's status is visible, and a vector's
step reads them as one array (``data_plane``). The quiet pipe's write (or, for a worker
alone in its slice, the done pipe's) orders the results before the status on any CPU.

A data plane's round (``framing.PLANNED_ROUND``) goes one step further: a worker whose
answer is all in shared memory writes its status and takes a token, and writes no record in
the quiet pipe (one system call fewer per worker and step; the parent reads that pipe only
when it hands the round over). The token pipe orders its status before the last worker's
record, which the parent reads before the status. When the data plane hands a round over
to the control plane, it first takes every token left: each worker still stepping then
finds none and writes its record to the done pipe, and each one that took a token before
has its status written, which the data plane reads next and turns into its record
(``DataPlane._hand_over``). So no worker of the round is left without a record.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from multienv.wire.framing import DONE_OK, DONE_RECORD, DONE_REPLY

_DRAIN_BYTES = 65536


@dataclasses.dataclass
class _Slice:
    """The pipes of one slice of workers, each a (read, write) pair, and its round."""

    size: int
    done: tuple[int, int]
    quiet: tuple[int, int]
    tokens: tuple[int, int]
    sentinels: dict[int, int] = dataclasses.field(default_factory=dict)  # worker -> sentinel
    deadlines: dict[int, float] = dataclasses.field(default_factory=dict)  # worker -> deadline
    collected: int = 0  # workers of the round collected from their counted records


class DoneChannels:
    """PARENT SIDE: the done, quiet and token pipes of a vector's slices, and the records read.

    Args:
        slices: The worker indices of each slice (one collecting thread each).
        seqs: Where the seq each worker's batch in flight has is kept, by worker index (the
            vector's shared memory, which planned steps read); None: an array of its own.

    Attributes:
        seqs: Per worker, the seq of the batch the parent awaits (``expect``).
        done_seq: Per worker, the seq of the awaited batch once its record is read, else 0.
        done_kind: Per worker, the kind of that record.
    """

    def __init__(self, slices: Sequence[Sequence[int]], seqs: np.ndarray | None = None) -> None:
        """Open three pipes per slice; the parent's read ends and the tokens never block."""
        num_workers = sum(len(part) for part in slices)
        self._slices: list[_Slice] = []
        self._slice_of: list[_Slice | None] = [None] * num_workers
        self._by_done_read: dict[int, _Slice] = {}
        for workers in slices:
            part = _Slice(len(workers), os.pipe(), os.pipe(), os.pipe())
            for read_fd in (part.done[0], part.quiet[0], part.tokens[0]):
                os.set_blocking(read_fd, False)  # the workers' token reads too: shared flag
            self._slices.append(part)
            self._by_done_read[part.done[0]] = part
            for worker_number in workers:
                self._slice_of[worker_number] = part
        self.seqs = np.zeros(num_workers, dtype=np.uint8) if seqs is None else seqs
        self.done_seq = [0] * num_workers
        self.done_kind = [0] * num_workers

    def done_read(self, worker_number: int) -> int:
        """The read end of the done pipe of that worker's slice: the one to sleep on."""
        return self._slice_of_worker(worker_number).done[0]

    def worker_fds(self, worker_number: int) -> tuple[int, int, int]:
        """What a worker writes and reads: its slice's done and quiet write ends, token read end."""
        part = self._slice_of_worker(worker_number)
        return part.done[1], part.quiet[1], part.tokens[0]

    def expect(self, worker_number: int, seq: int) -> None:
        """The worker was sent fast batch ``seq``: only its record counts from now on."""
        self.seqs[worker_number] = seq

    def drain(self, done_read: int) -> None:
        """Read the records in the done and quiet pipes of that slice; keep the awaited ones.

        The done pipe first: a worker writes to the quiet pipe before the done pipe, so one
        pass sees every record of a round whose last record it read.
        """
        part = self._by_done_read[done_read]
        self._read_records(part.done[0])
        self._read_records(part.quiet[0])

    def drain_quiet(self, done_read: int) -> None:
        """Read the records in the quiet pipe of that slice, before the parent sleeps.

        A record in the quiet pipe wakes no one, so it is read first; one in the done pipe
        ends the sleep at once, and is read then.
        """
        self._read_records(self._by_done_read[done_read].quiet[0])

    def open_round(self, is_written: bool = False) -> None:
        """Start a round: each slice of two or more workers gets one token fewer than workers.

        ``is_written``: a vector's data plane wrote the tokens itself (fresh, after a drain)
        and hands its round over: only the bookkeeping starts here.
        """
        for part in self._slices:
            part.sentinels.clear()
            part.deadlines.clear()
            if part.size < 2 or is_written:
                part.collected = 0
                continue
            if part.collected < part.size:  # else the last round took every token
                _drain(part.tokens[0])
            part.collected = 0
            os.write(part.tokens[1], bytes(part.size - 1))

    def has_others(self, worker_number: int) -> bool:
        """Whether this worker's batch in a round is counted (its slice has two or more)."""
        return self._slice_of_worker(worker_number).size >= 2

    def join_round(self, worker_number: int, sentinel: int, deadline: float | None) -> None:
        """The worker was sent its counted batch; ``sentinel`` tells its death.

        ``deadline``: when the batch is late (``time.monotonic``); None: never.
        """
        part = self._slice_of[worker_number]  # on every step of every worker: no call
        assert part is not None
        part.sentinels[worker_number] = sentinel
        if deadline is not None:
            part.deadlines[worker_number] = deadline

    def take(self, worker_number: int, is_counted: bool) -> int:
        """The awaited record of the worker is in: take it, settling a counted batch; its kind."""
        self.done_seq[worker_number] = 0
        if is_counted:
            self.settle(worker_number, is_collected=True)
        return self.done_kind[worker_number]

    def settle(self, worker_number: int, is_collected: bool = False) -> None:
        """The round waits for the worker's counted batch no more.

        ``is_collected``: its record was read (else the worker died, or was given up).
        """
        part = self._slice_of[worker_number]  # on every step of every worker: no call
        assert part is not None
        part.sentinels.pop(worker_number, None)
        if part.deadlines:
            part.deadlines.pop(worker_number, None)
        if is_collected:
            part.collected += 1

    def round_deadline(self, worker_number: int) -> float | None:
        """The earliest deadline of the other workers of the round whose records are not in."""
        deadlines = self._slice_of_worker(worker_number).deadlines
        awaited, done_seq = self.seqs, self.done_seq
        late = [
            deadline
            for other, deadline in deadlines.items()
            if other != worker_number and done_seq[other] != awaited[other]
        ]
        return min(late) if late else None

    def break_round(self, worker_number: int) -> None:
        """Make every worker of the slice that finishes from now on wake the parent.

        A worker of the round is late while the parent waits for another: the parent takes
        the tokens left, so that the one it waits for wakes it, and it can go on to the late
        one and kill it. The round's deadlines are dropped: the wait is for one worker now.
        """
        part = self._slice_of_worker(worker_number)
        part.deadlines.clear()
        _drain(part.tokens[0])

    def round_sentinels(self, worker_number: int) -> list[int]:
        """The sentinels of the other workers of this worker's round, still counted."""
        sentinels = self._slice_of_worker(worker_number).sentinels
        return [fd for other, fd in sentinels.items() if other != worker_number]

    def leave_round(self, worker_number: int, sentinel: int | None = None) -> None:
        """The worker will not finish its counted batch: give one token of its slice up.

        ``sentinel``: a death the parent saw; forget it, so it is given up once.
        """
        part = self._slice_of_worker(worker_number)
        if sentinel is not None:
            for other in [w for w, fd in part.sentinels.items() if fd == sentinel]:
                self.settle(other)  # its death is seen: the round waits for it no more
        if part.size >= 2:
            try:
                os.read(part.tokens[0], 1)
            except BlockingIOError:
                pass  # all taken: the workers still stepping each wake the parent

    def close(self) -> None:
        """Close every pipe end the parent holds."""
        for part in self._slices:
            for pipe in (part.done, part.quiet, part.tokens):
                os.close(pipe[0])
                os.close(pipe[1])
        self._slices = []

    def _slice_of_worker(self, worker_number: int) -> _Slice:
        part = self._slice_of[worker_number]
        assert part is not None
        return part

    def _read_records(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, _DRAIN_BYTES)
            except BlockingIOError:
                return
            self.note_records(data)
            if len(data) < _DRAIN_BYTES:
                return

    def note_records(self, data: bytes) -> None:
        """Keep the awaited records among ``data``, records read from a slice's pipes."""
        awaited, done_seq, done_kind = self.seqs.tolist(), self.done_seq, self.done_kind
        for worker_number, seq, kind in DONE_RECORD.iter_unpack(data):
            if seq == awaited[worker_number]:
                done_seq[worker_number] = seq
                done_kind[worker_number] = kind

    def forget_records(self) -> None:
        """Drop every record read and not taken: none of them answers a batch in flight.

        A vector's data plane calls it when it starts its rounds and when it hands one
        over: the records it drained then are of batches already collected (the duplicate
        a round's last worker writes to the done pipe, say). Kept, one whose seq comes round
        again 255 batches later would answer that batch before its worker does.
        """
        self.done_seq[:] = [0] * len(self.done_seq)

    def pipes(self) -> tuple[int, int, int, int]:
        """The one slice's done and quiet read ends, token write end and size (``data_plane``).

        Raises:
            ValueError: The vector has several slices.
        """
        if len(self._slices) != 1:
            raise ValueError("a data plane needs the workers in one slice")
        part = self._slices[0]
        return part.done[0], part.quiet[0], part.tokens[1], part.size

    def hand_over_round(self, status: np.ndarray, seq: int) -> bytes:
        """The records of a data plane's round that the parent hands over (one slice).

        Takes the tokens left first: each worker still stepping then writes its record to
        the done pipe. Then each worker whose status says ``seq`` gets its ``DONE_OK``
        record, and the quiet pipe's records (answers with a message) are read.
        """
        part = self._slices[0]
        _drain(part.tokens[0])
        answered = np.flatnonzero(status == seq).tolist()
        records = b"".join(DONE_RECORD.pack(worker, seq, DONE_OK) for worker in answered)
        try:
            return records + os.read(part.quiet[0], _DRAIN_BYTES)
        except BlockingIOError:
            return records  # every worker done so far answered in its status

    def drain_tokens(self) -> None:
        """Drop the tokens left in every slice's pipe (``data_plane``, before its rounds)."""
        for part in self._slices:
            _drain(part.tokens[0])


class DoneNotifier:
    """WORKER SIDE: send the records of this worker's fast batches.

    Args:
        worker_number: This worker's place among the vector's workers.
        fds: Its slice's done and quiet write ends and token read end; owned.
    """

    def __init__(self, worker_number: int, fds: tuple[int, int, int]) -> None:
        """Keep the fds, and pack every record this worker can send."""
        self.worker_number = worker_number
        self._done_fd, self._quiet_fd, self._tokens_fd = fds
        # By kind, then seq: packed once, as a worker sends one on every step.
        self._records = [
            [DONE_RECORD.pack(worker_number, seq, kind) for seq in range(256)]
            for kind in (DONE_OK, DONE_REPLY)
        ]
        self.status: memoryview | None = None  # the vector's status array, once it is mapped

    def notify(
        self,
        seq: int,
        kind: int,
        is_counted: bool,
        is_planned: bool = False,
        is_round: bool = False,
    ) -> None:
        """Tell the parent batch ``seq`` is done; of a round's batches, only the last wakes it.

        ``is_planned``: a planned step, whose answer also goes into the worker's status
        (after the results, before the parent may wake): its seq when everything is in
        shared memory, else 0, which no seq is. ``is_round``: a planned step of a data
        plane's round (``framing.PLANNED_ROUND``), where that status is the whole answer:
        no record in the quiet pipe.
        """
        record = self._records[kind][seq]
        status = self.status if is_planned else None
        if is_counted:
            if not is_round or kind != DONE_OK:
                os.write(self._quiet_fd, record)
            if status is not None:
                status[self.worker_number] = seq if kind == DONE_OK else 0
            try:
                if os.read(self._tokens_fd, 1):
                    return  # another worker of the round is still stepping
            except BlockingIOError:
                pass  # the last one: wake the parent
        elif status is not None:
            status[self.worker_number] = seq if kind == DONE_OK else 0
        os.write(self._done_fd, record)

    def close(self) -> None:
        """Close the fds."""
        for fd in (self._done_fd, self._quiet_fd, self._tokens_fd):
            os.close(fd)


def _drain(read_fd: int) -> None:
    """Read and drop whatever is in a non-blocking pipe."""
    try:
        while len(os.read(read_fd, _DRAIN_BYTES)) == _DRAIN_BYTES:
            pass
    except BlockingIOError:
        pass
