"""PARENT SIDE, subprocess backend: ``WorkerSeat``, one worker's place in a vector's shared batch.

A ``ProcessHandle`` owns the process and its pipe; its seat owns what the worker shares with
its vector (``shm_link.SubprocessLink`` sets it): which of the vector's envs it hosts, the
slots its batch in flight writes, how a batch's actions go into shared memory and travel as
a few bytes (``framing``), and how its results come back out. An unlinked worker has an
empty seat, and its batches travel pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from multienv.backends.subprocess.process_launch import LinkPayload
from multienv.wire import framing
from multienv.wire.framing import encode, frame
from multienv.wire.info_columns import contiguous_slice
from multienv.wire.protocol import (
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
from multienv.wire.shared_memory import SharedBatch


class WorkerSeat:
    """Which envs of a vector one worker hosts, and its batch in flight in shared memory.

    Args:
        shared: The vector's shared batch; None for a worker not linked to one.
        worker_number: The worker's index in the vector.
        env_indices: The vector's index of each of the worker's envs, by position.
    """

    def __init__(
        self, shared: SharedBatch | None, worker_number: int, env_indices: Sequence[int]
    ) -> None:
        """Remember the worker's envs; a contiguous run of them is kept as a slice."""
        self.shared = shared
        self.worker_number = worker_number
        self.env_indices = list(env_indices)
        self._env_index_array = np.asarray(self.env_indices, dtype=np.intp)
        self._env_slice = contiguous_slice(self.env_indices)
        self.done_read = -1 if shared is None else shared.done.done_read(worker_number)
        # Its batches in a round are counted: its slice has other workers (``done_pipes``).
        self.has_others = shared is not None and shared.done.has_others(worker_number)
        self._own_seq = 0  # the seq of an unlinked seat (a linked one's is in shared memory)
        self._batch: Batch | None = None  # None for a planned step's slice
        self._is_planned = False  # the batch in flight is a planned step's slice
        self._env_ids: Any = None  # the batch's env indices (array or slice); None if pickled
        self._slots: np.ndarray | None = None  # and the slots it writes
        self._plan_slots: np.ndarray | None = None  # a planned step's slots, of every env

    @property
    def seq(self) -> int:
        """The seq of the last fast batch (1 to 255; 0 before the first)."""
        if self.shared is None:
            return self._own_seq
        return int(self.shared.done.seqs[self.worker_number])

    @seq.setter
    def seq(self, seq: int) -> None:
        if self.shared is None:
            self._own_seq = seq
        else:
            self.shared.done.expect(self.worker_number, seq)

    def next_seq(self) -> int:
        """Number the next fast batch; only its record counts from now on."""
        seq = self.seq % 255 + 1
        self.seq = seq
        return seq

    def link_payload(self, pid: int) -> LinkPayload:
        """What ATTACH gives worker ``pid``: the payload, the memory fd and the done pipe fds."""
        shared = self.shared
        assert shared is not None
        assert shared.fd is not None
        payload = (shared.layout, self.worker_number, self.env_indices)
        return payload, shared.fd, shared.done.worker_fds(self.worker_number), pid

    def has_record(self, seq: int) -> bool:
        """Whether the DONE record of fast batch ``seq`` has been read already."""
        shared = self.shared
        return bool(seq) and shared is not None and shared.done.done_seq[self.worker_number] == seq

    def read_obs(self, position: int) -> Any:
        """The observation the env at ``position`` is on in shared memory; None if unlinked."""
        if self.shared is None or self.env_indices[position] < 0:
            return None
        return self.shared.read(self.env_indices[position])

    def batch_frame(self, batch: Batch) -> tuple[bytes, int]:
        """The message that sends ``batch``, and the seq of its DONE record (0: it is pickled).

        A batch travels as a few bytes when its actions fit the shared memory as they are;
        otherwise it is pickled, each item naming the slot its observation goes to.
        """
        self._batch, self._is_planned = batch, False
        shared = self.shared
        if shared is None:
            self._env_ids = None
            return frame(encode(Request(Command.BATCH, -1, batch.orders()))), 0
        size = len(batch.positions)
        # A whole worker of contiguous envs, or a single env, is a slice: no fancy indexing.
        env_ids: Any
        if batch.is_whole and self._env_slice is not None:
            env_ids = self._env_slice
        elif size == 1:
            env_index = self.env_indices[batch.positions[0]]
            env_ids = slice(env_index, env_index + 1)
        else:
            env_ids = self._env_index_array[batch.positions]
        slots = shared.next_slots(env_ids)
        self._env_ids, self._slots = env_ids, slots
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
            return frame(encode(Request(Command.BATCH, -1, orders))), 0
        if shared.actions is not None and num_resets < size:
            if not num_resets:
                shared.actions[env_ids] = batch.actions
            else:
                steps = ~is_reset
                shared.actions[np.arange(shared.num_envs)[env_ids][steps]] = np.asarray(
                    batch.actions
                )[steps]
        seq = self.next_seq()
        flags = framing.item_flags(is_reset, slots, batch.autoreset, batch.keep_np_randoms)
        return framing.fast_batch_frame(seq, framing.encode_items(batch.positions, flags)), seq

    def take_planned(self, plan: StepPlan, env_slice: slice) -> None:
        """This worker's slice of a planned step is in flight; its seq is already numbered.

        Of a plan that skips envs (a data plane's reset of some), only the others are its.
        """
        self._is_planned, self._slots, self._plan_slots = True, None, plan.wire
        if plan.skip is None:
            self._batch, self._env_ids = None, env_slice
        else:
            self._batch = plan.batch(env_slice)
            self._env_ids = env_slice.start + np.asarray(self._batch.positions, dtype=np.intp)

    def result(self, reply: Reply) -> BatchResult:
        """The result of the batch in flight, from its reply and the shared memory."""
        batch, env_ids, is_planned = self._batch, self._env_ids, self._is_planned
        if reply.schemas and self.shared is not None:
            self.shared.infos.register(self.worker_number, reply.schemas)
        if batch is None:  # a planned step's slice
            assert isinstance(env_ids, slice)
            count = env_ids.stop - env_ids.start
            batch = self._batch = Batch(
                list(range(count)), np.zeros(count, dtype=np.bool_), None, is_whole=True
            )
        if reply.failure is not None:  # the request itself failed; blame every item
            return failed_batch(len(batch.positions), reply.failure, env_ids is None)
        shared = self.shared
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
        if self._slots is None:  # a planned step's: sliced only when a reply comes
            assert self._plan_slots is not None
            self._slots = self._plan_slots[env_ids]
        if result.extras:
            ok = np.array(
                [
                    item not in result.extras or result.extras[item].failure is None
                    for item in range(len(batch.positions))
                ]
            )
            shared.move_to(np.arange(shared.num_envs)[env_ids][ok], self._slots[ok])
        else:
            shared.move_to(env_ids, self._slots)
        return result


def _same_dtype(actions: Any, shared_actions: np.ndarray) -> bool:
    """Whether actions can go through shared memory uncast, as Gymnasium's vector envs pass them.

    The env must get them as the caller gave them; other dtypes are pickled.
    """
    return isinstance(actions, np.ndarray) and actions.dtype == shared_actions.dtype
