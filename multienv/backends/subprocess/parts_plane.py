"""PARENT SIDE, subprocess backend: ``send``/``recv`` of whole workers, in one pass each.

EnvPool's asynchronous pattern (send some envs, receive the first to finish) on the data
plane's shared memory and pipes (``data_plane``), for a vector whose workers are as its
last check left them::

    send   actions, item flags  -> the sent envs' rows of shared memory, one numpy write each
           the sent workers' seqs -> each one on, one array operation
           one wake-up per sent worker (the PLANNED_STEP byte, uncounted: each answers alone)
    recv   one poll             <- the done pipe, every worker's death sentinel, the deadline
           the records read as one array; the first workers to finish taken whole; their
           rewards, flags, observations, infos and counts read as arrays

The usual loop sends back the envs the last ``recv`` returned: what that ``send`` writes
(each env's next slot and flags, whether it resets) is worked out when they are returned,
and the workers are counted and woken in one Python loop; a ``recv`` keeps the workers in
the order they finished and reads their records without numpy, as they come a few at a time.

Only whole workers travel this way: ``send`` of every env of some workers (any order), and
``recv`` of a batch that the first workers to finish fill exactly. Everything else is
handed over to the control plane: ``send`` declines, before it writes anything, what it
cannot send (a worker split, an env in flight, actions of another dtype; the vector's
checks then say what is wrong); ``recv`` hands every worker in flight over when a worker
dies, passes its deadline, answers with more than infos (an env's error) or would have to
be split. A message of infos only (a new key, a same-step reset's final observation that
did not fit shared memory) is read by the worker's supervisor and kept for ``_take``. Each
supervisor then takes its worker's part as a planned step
(``WorkerSupervisor.take_planned``), and the vector's ``InFlight`` collects it like any
batch it sent. That half of the class is ``parts_hand_over``.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.vector import AutoresetMode

from multienv.backends.subprocess.data_plane import worker_budgets
from multienv.backends.subprocess.parts_hand_over import Handed, PartsHandOver
from multienv.errors import WaitTimeoutError
from multienv.wire.framing import (
    DONE_OK,
    DONE_RECORD,
    IS_SLOT_1,
    PLANNED_FRAMES,
    plane_flags,
)
from multienv.wire.protocol import Outcome

if TYPE_CHECKING:
    from multienv.backends.subprocess.data_plane import DataPlane
    from multienv.supervision.handles import StepBatch, VectorParts
    from multienv.wire.shared_memory import SharedBatch

_RECORDS_BYTES = 4 * 16384  # whole records: a record is written atomically
_NO_IDS = b"\xff"  # no batch returned that a send could repeat (no ids' bytes are one byte)
_WAKE = PLANNED_FRAMES[False]
_HELD_BATCHES = 64  # batches returned before their steps are counted, at most


class PartsPlane(PartsHandOver):
    """``send``/``recv`` of whole workers of a vector with a data plane.

    Args:
        plane: The vector's data plane: it checks the workers and holds their fds.
        shared: The vector's shared batch.
        vector: The vector's workers and the state it keeps (``VectorParts``).
    """

    # Slots, not a __dict__: past 30 attributes CPython looks every ``self.x`` up the slow
    # way (as ``DataPlane``'s, ``tests/test_multi_env.py``).
    __slots__ = tuple(
        "_action_dtype _action_shape _actions _add_info _any_counted _autoreset "
        "_busy_envs _changes _counted _counters _deadlines _done _done_envs _done_mv "
        "_done_read _env_ranges _env_slices _extras _flag_of_row _flag_of_slot "
        "_flying _flying_mv _has_finals _held _id_bytes _info_ids _is_disabled "
        "_is_next_step _is_same_step _is_unthanked _is_wide _needs_reset _next _obs_flat "
        "_obs_rows _order _other_row _plan_flags _plane _resets _returned _rewards "
        "_sent_at _sent_mv _seqs _seqs_mv _shared _size_list _sizes _slot _slot_of_row "
        "_starts _supervisors _terminated _timeouts _truncated _wake_fds _worker_of "
        "resent sent".split()
    )

    def __init__(self, plane: DataPlane, shared: SharedBatch, vector: VectorParts) -> None:
        """Nothing in flight."""
        self._plane = plane
        self._shared = shared
        self._supervisors = list(vector.supervisors)
        self._env_slices = list(vector.env_slices)
        self._autoreset = vector.autoreset
        self._counters = vector.counters
        self._add_info = vector.add_info
        num_workers, num_envs = len(self._supervisors), shared.num_envs
        self._done_read = shared.done.pipes()[0]
        self._starts = np.array([part.start for part in self._env_slices], dtype=np.intp)
        self._sizes = np.array([part.stop - part.start for part in self._env_slices], np.int64)
        self._worker_of = np.repeat(np.arange(num_workers), self._sizes)
        self._seqs = shared.done.seqs[:num_workers]  # each worker's seq, as the workers read
        # Each worker's env ids, and as an array's bytes: a batch's ids are their join.
        self._env_ranges = [np.arange(part.start, part.stop) for part in self._env_slices]
        self._id_bytes = [ids.tobytes() for ids in self._env_ranges]
        self._size_list = self._sizes.tolist()
        self._changes = self._supervisors[0].changes  # one counter, which the plane shares
        mode = vector.autoreset.mode
        self._is_next_step = mode is AutoresetMode.NEXT_STEP
        self._is_disabled = mode is AutoresetMode.DISABLED
        self._is_same_step = mode is AutoresetMode.SAME_STEP
        self._has_finals = self._is_same_step and shared.has_finals  # (``IS_FINALS``)
        common = plane_flags(self._is_same_step, self._is_next_step, self._has_finals)
        self._flag_of_slot = np.array([common, common | IS_SLOT_1], dtype=np.uint8)
        assert shared.actions is not None  # a data plane's vector has array actions
        self._actions = shared.actions
        self._action_shape = shared.actions.shape[1:]
        self._action_dtype = shared.actions.dtype
        # Actions of more than one number are written by slice when they can be: an index
        # array writes rows at four times a slice's cost (one number: a fifth less).
        self._is_wide = len(self._action_shape) > 0
        self._plan_flags = shared.plan_flags
        # Both slots of every env's observation as rows of one array: env e's slot s is row
        # s * num_envs + e (None when nested). The step in flight writes each env's row in
        # ``_obs_rows``; a row's slot, the other slot's row and its item flags are looked up.
        obs_slots = shared.obs_slots
        self._obs_flat = None if obs_slots is None else obs_slots.reshape(-1, *obs_slots.shape[2:])
        rows = np.arange(2 * num_envs)
        self._slot_of_row = (rows >= num_envs).astype(np.int8)  # as the shared slots
        self._other_row = (rows + num_envs) % (2 * num_envs)
        self._flag_of_row = self._flag_of_slot[self._slot_of_row]
        self._obs_rows = np.arange(num_envs, dtype=np.intp)
        self._slot = np.empty(0, dtype=np.int8)  # each env's shared slot, once ``_enter``ed
        self._wake_fds: list[int] = []
        self._timeouts: np.ndarray | None = None
        self._is_unthanked = False
        self._rewards = shared.rewards
        self._terminated, self._truncated = shared.flags  # (2, num_envs): two rows
        self._info_ids = shared.infos.schema_ids
        self._needs_reset = vector.autoreset.needs_reset_array
        # By worker: stepping (sent, no record read), done (its record read, not returned),
        # when each was sent, its deadline, and the order the done ones finished in.
        self._flying = np.zeros(num_workers, dtype=np.bool_)
        self._done = np.zeros(num_workers, dtype=np.bool_)
        self._sent_at = np.zeros(num_workers)
        self._deadlines = np.full(num_workers, np.inf)
        self._order: list[int] = []  # the done workers, in the order they finished
        # The same, read and written one worker at a time: a tenth of numpy's cost.
        self._flying_mv, self._done_mv = self._flying.data, self._done.data
        self._seqs_mv = self._seqs.data
        self._sent_mv: Any = self._sent_at.data  # of floats, which memoryview's type lacks
        self._busy_envs = self._done_envs = 0  # envs of the flying and done workers; done
        # By env, for the step in flight: whether it resets (only under next-step
        # autoreset; else never set).
        self._resets = np.zeros(num_envs, dtype=np.bool_)
        # Done workers whose messages their supervisors read (and counted), and what the
        # messages said beyond the shared arrays, by env (made infos when returned).
        self._counted = np.zeros(num_workers, dtype=np.bool_)
        self._any_counted = False  # whether any is
        # The steps returned and not yet counted, as the bytes of their ids, resets (under
        # next-step autoreset) and ends: the counters take them together (``flush_counts``),
        # before anyone reads them. (Bytes: their join costs a tenth of ``np.concatenate``.)
        self._held: list[tuple[bytes, bytes, bytes]] = []
        self._extras: dict[int, Outcome] = {}
        # The batch ``recv`` returned last, as a send of those envs would find it: the bytes
        # of its env ids, the change count then, and what ``_send_returned`` writes.
        self._returned = _NO_IDS
        self._next: tuple[Any, ...] = ()
        self.sent = 0  # batches of workers sent this way
        self.resent = 0  # of which the envs the last recv returned (``_send_returned``)

    def is_busy(self) -> bool:
        """Whether any worker is in flight here, or done and not yet returned."""
        return self._busy_envs > 0

    def num_busy(self) -> int:
        """How many envs are in flight here, or done and not yet returned."""
        return self._busy_envs

    def env_ids(self) -> list[int]:
        """The envs in flight here or done and not yet returned, ascending."""
        busy = self._flying | self._done
        return np.flatnonzero(busy[self._worker_of]).tolist()

    def send(self, actions: Any, env_ids: Any) -> bool:
        """Step every env of some workers; False, sending nothing, if it cannot go this way.

        Args:
            actions: One action per env of ``env_ids``, in that order.
            env_ids: The envs to step: all of some workers, in any order; None for all.
        """
        if (
            type(env_ids) is np.ndarray
            and env_ids.dtype == np.int64
            and env_ids.tobytes() == self._returned
            and self._changes[0] == self._next[0]
            and type(actions) is np.ndarray
            and actions.dtype == self._action_dtype
            and actions.shape == self._next[1]
        ):
            return self._send_returned(actions)
        self._returned = _NO_IDS
        num_envs = len(self._worker_of)
        if env_ids is None:
            ids = np.arange(num_envs)
        else:
            ids = env_ids if type(env_ids) is np.ndarray else np.asarray(env_ids)
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                return False  # (bools, floats: the vector's checks say what is wrong)
        if (
            type(actions) is not np.ndarray
            or actions.dtype != self._action_dtype
            or actions.shape != (len(ids), *self._action_shape)
            or not len(ids)
            or int(ids.min()) < 0
            or int(ids.max()) >= num_envs
        ):
            return False
        sent = np.zeros(num_envs, dtype=np.bool_)
        sent[ids] = True
        workers = np.logical_and.reduceat(sent, self._starts)
        if (
            np.count_nonzero(sent) != len(ids)  # an env twice
            or (workers != np.logical_or.reduceat(sent, self._starts)).any()  # split
            or (workers & (self._flying | self._done)).any()
        ):
            return False
        if not self._busy_envs and not self._enter():
            return False
        needs_reset = self._autoreset.needs_reset_array
        if self._is_disabled and needs_reset[ids].any():
            return False  # the vector's checks say which env must be reset first
        targets = 1 - self._slot[ids]
        self._actions[ids] = actions  # a reset's action is not read
        self._plan_flags[ids] = self._flag_of_slot[targets]
        self._obs_rows[ids] = targets * num_envs + ids
        if self._is_next_step:  # the worker resets an env whose last step ended
            self._resets[ids] = needs_reset[ids]
        self._start(np.flatnonzero(workers).tolist(), len(ids))
        return True

    def _send_returned(self, actions: np.ndarray) -> bool:
        """``send`` of the envs the last ``recv`` returned, as it worked them out then."""
        _, _, ids, where, numbers, rows, plan_flags, resets, ended = self._next
        self._returned = _NO_IDS
        if not self._busy_envs and not self._enter():
            return False
        if self._is_disabled and ended:
            return False  # the vector's checks say which env must be reset first
        self._actions[where] = actions  # a reset's action is not read
        self._plan_flags[ids] = plan_flags
        self._obs_rows[ids] = rows
        if resets is not None:
            self._resets[ids] = resets
        self.resent += 1
        self._start(numbers, len(plan_flags))
        return True

    def _enter(self) -> bool:
        """Ready the workers for the parts plane, from none in flight (``enter_parts``)."""
        plane = self._plane
        if not plane.enter_parts():
            return False
        self._slot = self._shared.loose_slots()
        # As the plane's check left them: it checks again only when none is in flight here.
        self._wake_fds, self._timeouts = plane.wake_fds, plane.timeouts
        self._is_unthanked = plane.is_unthanked()
        return True

    def _start(self, numbers: list[int], num_envs: int) -> None:
        """These workers' envs are written: number their step, note when, wake each."""
        now = time.perf_counter()
        seqs, flying, sent_at = self._seqs_mv, self._flying_mv, self._sent_mv
        for number in numbers:
            seqs[number] = seqs[number] % 255 + 1
            flying[number] = True
            sent_at[number] = now
        timeouts = self._timeouts
        if timeouts is not None:
            workers = np.zeros(len(self._flying), dtype=np.bool_)
            workers[numbers] = True
            resets = np.add.reduceat(self._resets, self._starts, dtype=np.int64)[workers]
            steps = self._sizes[workers] - resets  # each late after its envs' timeouts
            self._deadlines[workers] = now + worker_budgets(steps, resets, timeouts[workers])
        self._busy_envs += num_envs
        self.sent += 1
        wake_fds = self._wake_fds
        woken = 0
        try:
            for number in numbers:
                try:
                    os.write(wake_fds[number], _WAKE)
                except OSError:
                    pass  # a dead worker: its sentinel ends the wait
                woken += 1
        except BaseException:
            # Ctrl-C among the wake-ups: wake the rest (a worker runs a seq once, however
            # often it is woken for it); ``recv`` finds them in flight as usual.
            for number in numbers[woken:]:
                try:
                    os.write(wake_fds[number], _WAKE)
                except OSError:
                    pass
            raise

    def receive(
        self, size: int, timeout: float | None, min_size: int | None = None, is_ready: bool = False
    ) -> StepBatch | dict[int, Handed]:
        """The first ``size`` envs to finish, ascending; or every worker, handed over.

        At ``timeout``, the workers done so far, if their envs are ``min_size`` or more
        (None: ``size``); fewer raise ``WaitTimeoutError``. ``is_ready``: as soon as
        ``min_size`` envs are done, the workers done then, first done first, up to ``size``.

        Returns:
            The batch; or, when something is not as usual, what ``hand_over`` returns, with
            the worker that was collected already given as its outcome.

        Raises:
            WaitTimeoutError: ``timeout`` passed first; every step stays in flight.
        """
        until = None if timeout is None else time.monotonic() + timeout
        need = min_size if is_ready and min_size is not None else size
        while self._done_envs < need:
            wake_at = until
            if self._timeouts is not None:
                deadline = float(self._deadlines[self._flying].min())
                if deadline != np.inf:
                    late = time.monotonic() + (deadline - time.perf_counter())
                    wake_at = late if wake_at is None else min(wake_at, late)
            events = self._plane.poll_until(wake_at)
            if not events:
                if self._is_late():
                    return self._hand_over_all()
                if until is not None and time.monotonic() >= until:
                    ready = self._done_envs
                    if min_size is not None and ready >= min_size:  # the deadline's batch
                        order = self._order[:]
                        del self._order[:]
                        return self._take(sorted(order))
                    raise WaitTimeoutError(
                        f"recv() timed out after {timeout} s with {ready} of the {need} envs "
                        "ready; every step is still in flight, call recv() again."
                    )
                continue
            if len(events) != 1 or events[0][0] != self._done_read:
                return self._hand_over_all()  # a worker died
            flying, seqs, replies = self._flying_mv, self._seqs_mv, []
            done, order, sizes = self._done_mv, self._order, self._size_list
            for number, seq, kind in DONE_RECORD.iter_unpack(
                os.read(self._done_read, _RECORDS_BYTES)
            ):
                if flying[number] and seq == seqs[number]:
                    if kind == DONE_OK:  # ``_note_done``, inline: a call costs as much
                        flying[number] = False
                        done[number] = True
                        order.append(number)
                        self._done_envs += sizes[number]
                    else:
                        replies.append(number)
            while replies:  # answered with a message too: its supervisor reads it, in order
                collected = self._collect_reply(replies.pop(0))
                if collected is not None:
                    return self._hand_over_all(collected)
                replies += self._drained_by_control_plane()
        order, sizes, filled, count = self._order, self._size_list, 0, 0
        if is_ready:
            count = _whole_workers(order, sizes, need, size)
        else:  # (inline: the usual loop's)
            while filled < size:
                filled += sizes[order[count]]
                count += 1
            count *= filled == size
        if not count:  # the batch would split a worker
            return self._hand_over_all()
        first = sorted(order[:count])
        del order[:count]
        return self._take(first)

    def forget_returned(self) -> None:
        """The envs the last ``recv`` returned were sent another way: no short ``send``."""
        self._returned = _NO_IDS

    def hand_over(self) -> dict[int, Handed]:
        """Give every worker here to its supervisor, as a planned step's part; by worker."""
        return self._hand_over_all()

    # ----------------------------------------------------------------- the usual cycle's parts

    def _take(self, numbers: list[int]) -> StepBatch:
        """Return the steps of these done workers (taken off ``_order``), in env order."""
        done = self._done_mv
        if len(numbers) == 1:
            number = numbers[0]
            ids, returned = self._env_ranges[number], self._id_bytes[number]
            where: Any = self._env_slices[number] if self._is_wide else ids
            done[number] = False
        else:  # (half ``np.concatenate``'s cost)
            id_bytes = self._id_bytes
            returned = b"".join([id_bytes[number] for number in numbers])
            ids = where = np.frombuffer(returned, dtype=np.int64)  # read-only
            for number in numbers:
                done[number] = False
        size = len(ids)
        self._done_envs -= size
        self._busy_envs -= size
        rows = self._obs_rows[ids]
        self._slot[ids] = self._slot_of_row[rows]
        rewards = self._rewards[ids]
        terminated = self._terminated[ids]
        truncated = self._truncated[ids]
        ended = terminated | truncated
        if not self._is_same_step:
            self._needs_reset[ids] = ended
        next_rows = self._other_row[rows]
        self._next = (
            self._changes[0],
            (size, *self._action_shape),
            ids,
            where,
            numbers,
            next_rows,
            self._flag_of_row[next_rows],
            ended if self._is_next_step else None,
            self._is_disabled and bool(ended.any()),
        )
        self._returned = returned
        resets = self._resets[ids] if self._is_next_step else None
        if self._any_counted:  # their supervisors counted them (``_collect_reply``)
            uncounted = ~self._counted[self._worker_of[ids]]
            self._counted[numbers] = False
            self._any_counted = bool(self._counted.any())
            self._held.append(
                (
                    ids[uncounted].tobytes(),
                    b"" if resets is None else resets[uncounted].tobytes(),
                    ended[uncounted].tobytes(),
                )
            )
        else:
            self._held.append(
                (returned, b"" if resets is None else resets.tobytes(), ended.tobytes())
            )
        if len(self._held) == _HELD_BATCHES:
            self.flush_counts()
        if self._obs_flat is not None:
            observations = self._obs_flat.take(rows, axis=0)
        else:
            observations = self._shared.observations(ids.tolist(), copy=True)
        if self._extras or self._has_finals or np.count_nonzero(self._info_ids[ids]):
            infos = self._infos(ids, ended)
        else:
            infos = {}
        infos["env_id"] = ids.copy()
        latencies, now, sent_at = self._counters.latencies, time.perf_counter(), self._sent_mv
        values, count, window = latencies.values, latencies.count, latencies.size
        for number in numbers:
            values[count % window] = now - sent_at[number]
            count += 1
        latencies.count = count
        if self._is_unthanked:
            self._is_unthanked = False
            self._plane.thank_workers()
        return observations, rewards, terminated, truncated, infos

    def _infos(self, ids: np.ndarray, ended: np.ndarray) -> dict[str, Any]:
        """The infos of these envs' steps: their rows, and the messages kept in ``_extras``."""
        shared = self._shared
        if not self._extras and not self._has_finals:
            infos = shared.infos.rows_columns(ids)
            if infos is not None:  # the usual: one schema, nothing pickled
                return infos
        pickled = {}
        if self._extras:
            step_info = self._autoreset.step_info
            for row, env_index in enumerate(ids.tolist()):
                extra = self._extras.pop(env_index, None)
                if extra is not None:
                    pickled[env_index] = step_info(extra, bool(ended[row]))[0]
        if self._has_finals and np.count_nonzero(ended):  # those not pickled: in shared memory
            in_memory = [env for env in ids[ended].tolist() if env not in pickled]
            if in_memory:
                pickled.update(shared.finals(np.array(in_memory, dtype=np.intp)))
        return _rows(shared.infos.merge(pickled, ids, self._add_info), ids)

    def flush_counts(self) -> None:
        """Count the steps and episodes of the batches returned since the last flush."""
        held = self._held
        if not held:
            return
        self._held = []
        ids, resets, ended = (b"".join(column) for column in zip(*held, strict=True))
        self._counters.note_batches(
            np.frombuffer(ids, dtype=np.int64),
            np.frombuffer(resets, dtype=np.bool_) if self._is_next_step else None,
            np.frombuffer(ended, dtype=np.bool_),
        )

    def _forget_workers(self) -> None:
        """No worker is in flight or done here any more (they were handed over)."""
        self._flying[:] = False
        self._done[:] = False
        self._counted[:] = False
        self._any_counted = False
        self._order.clear()
        self._busy_envs = self._done_envs = 0
        self._returned = _NO_IDS

    def _note_done(self, number: int) -> None:
        """The worker's record says all its results are in shared memory."""
        self._flying_mv[number] = False
        self._done_mv[number] = True
        self._order.append(number)
        self._done_envs += self._size_list[number]

    def _note_counted(self) -> None:
        """A done worker's steps were counted by its supervisor (``_collect_reply``)."""
        self._any_counted = True

    def _is_late(self) -> bool:
        flying = self._flying
        return bool(flying.any()) and float(self._deadlines[flying].min()) <= time.perf_counter()


def _whole_workers(order: list[int], sizes: list[int], least: int, most: int) -> int:
    """How many done workers, first done first, make ``least`` to ``most`` envs; else 0.

    0: only a split worker would (the batch goes the general way).
    """
    filled = count = 0
    while count < len(order) and filled + sizes[order[count]] <= most:
        filled += sizes[order[count]]
        count += 1
    return count if filled >= least else 0


def _rows(infos: dict[str, Any], ids: np.ndarray) -> dict[str, Any]:
    """The rows ``ids`` of a vector's merged infos (arrays of every env), nested dicts too."""
    return {
        key: _rows(value, ids) if isinstance(value, dict) else value[ids]
        for key, value in infos.items()
    }
