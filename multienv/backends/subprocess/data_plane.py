"""PARENT SIDE, subprocess backend: the data plane, a vector's healthy step in one pass.

A step of every env of a vector whose workers are as the last check left them (ready, idle,
nothing lost, not recycling) reads top to bottom, like ``scripts/bare_probe.py``::

    actions, item flags, seqs  -> shared memory, one numpy write each
    W - 1 tokens               -> the token pipe, one write (``done_pipes``)
    one wake-up per worker     -> the constant PLANNED_ROUND byte on its pipe (``framing``)
    one poll                   <- the done pipe, every worker's death sentinel, the deadline
    the last worker's record   <- the done pipe, one read; the others answer in their status
    status, rewards, flags, observations, infos, counts: read and kept as arrays
    final obs and infos        <- same-step autoreset, when an episode ended: read as arrays

Nothing in it loops over workers but the wake-up. Everything the failure table promises is
detected here and handled elsewhere: a death is a sentinel in the poll, a hang past its
deadline the poll's timeout, an env error, an info with a new key or anything else a worker
answers with a message leaves its status short of the step's seq. The step is then handed
over, in flight, to the control plane: each worker's supervisor takes its part
(``WorkerSupervisor.take_planned``), and the vector collects it as any planned step
(``MultiEnv._collect_planned``), which may take as long as it needs.

A reset without seeds or per-env options, masked or not, is the same round
(``send_reset``, ``receive_reset``): the masked envs' flags reset them, the others'
skip them (``framing.IS_SKIP``); handed over, each supervisor's part is its masked envs'
resets, which the vector collects as a reset (``MultiEnv._receive_reset``).

What the step takes for granted is checked again (``_check``, once over the workers) only
after something changed a worker: a call, a general batch, a death, a recycle, close
(``WorkerSupervisor.changes``, one counter shared by the vector's workers).
"""

from __future__ import annotations

import math
import os
import select
import time
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from multienv.backends.subprocess.process_handle import ProcessHandle
from multienv.supervision.handles import PartsPlane, StepBatch, VectorParts
from multienv.wire.framing import (
    IS_INFO_COLUMNS,
    IS_RESET,
    IS_SKIP,
    IS_SLOT_1,
    PLANNED_FRAMES,
    ROUND_FRAME,
    plane_flags,
    poll_hot,
)
from multienv.wire.protocol import StepPlan
from multienv.wire.shared_memory import SharedBatch

_ALL = slice(None)
_RECORDS_BYTES = 65536  # more than any slice's records of one step
_HELD_STEPS = 256  # steps whose counts are held back before they are written


def worker_budgets(steps: np.ndarray, resets: np.ndarray, timeouts: np.ndarray) -> np.ndarray:
    """Per worker, the seconds its batch may take (inf: no deadline), vectorised.

    ``supervisor.batch_deadline``'s rule for many workers at once: each step gets the step
    timeout, each reset the reset timeout (``timeouts``: per worker, both; inf for none).
    """
    with np.errstate(invalid="ignore"):  # inf * 0: no such item, no time for it
        budgets: np.ndarray = np.where(steps > 0, steps * timeouts[:, 0], 0.0) + np.where(
            resets > 0, resets * timeouts[:, 1], 0.0
        )
    return budgets


def plane_fds(supervisors: list[Any]) -> tuple[list[int], list[int], float] | None:
    """Each worker's pipe and sentinel, and the longest spin, if all can take a planned step.

    None when one cannot as sent by a data plane: not a subprocess worker, no process or
    pipe, a recycle policy, not ready or idle, or envs that lost their episode.
    """
    wake_fds, sentinels, spins = [], [], [0.0]
    for supervisor in supervisors:
        handle = supervisor.handle
        if not isinstance(handle, ProcessHandle):
            return None
        fds = handle.plane_fds()
        if fds is None or supervisor.is_recycling or not supervisor.can_take_planned():
            return None
        wake_fds.append(fds[0])
        sentinels.append(fds[1])
        spins.append(handle.spin_s)
    return wake_fds, sentinels, max(spins)


def plane_timeouts(supervisors: list[Any]) -> np.ndarray | None:
    """Per worker, its step and reset timeouts (s; inf: none); None if no worker has one."""
    timeouts = [supervisor.timeouts for supervisor in supervisors]
    if all(pair == (None, None) for pair in timeouts):
        return None
    return np.array([[math.inf if t is None else t for t in pair] for pair in timeouts])


class DataPlane:
    """The healthy step of a vector of subprocess workers, each a run of its envs in order.

    Args:
        shared: The vector's shared batch.
        vector: The vector's workers (by worker index, all in the shared batch's one slice,
            each a run of its envs) and the state the data plane keeps for it: its
            ``needs_reset``, steps and episodes lazily.

    Raises:
        ValueError: The workers are not in one slice (the vector collects them on several
            threads); the vector then steps without a data plane.
    """

    # Slots, not a __dict__: past 30 attributes CPython looks every ``self.x`` up the slow
    # way, 1,800 instructions more per step (``tests/test_multi_env.py``).
    __slots__ = tuple(
        "_action_dtype _action_shape _actions _actions_sent _add_info _autoreset _changes "
        "_checked _copy _counters _deadline _done_read _env_slices _flags _flags_to _frame "
        "_has_finals _held _held_bytes _is_disabled _is_next_step _is_parts _is_resets_stale "
        "_is_same_step _is_unthanked _last_flags _latencies _needs_reset _no_end _obs_slots "
        "_plan_flags _poll _records_bytes _records_read _reset_flags _reset_mask _resets_held "
        "_rewards _sent_at _seq _seq_bytes _seqs _shared _sizes _spin_s _starts _status "
        "_steps_held _supervisors _target _timeouts _tokens _tokens_write _wake_fds "
        "parts".split()
    )

    def __init__(self, shared: SharedBatch, vector: VectorParts) -> None:
        """Share one change counter among the workers; nothing is checked or sent yet."""
        supervisors, env_slices = vector.supervisors, vector.env_slices
        autoreset, counters = vector.autoreset, vector.counters
        self._done_read, _, self._tokens_write, _ = shared.done.pipes()
        num_workers, num_envs = len(supervisors), shared.num_envs
        self._shared = shared
        self._supervisors = list(supervisors)
        self._env_slices = list(env_slices)
        self._autoreset = autoreset
        self._needs_reset = autoreset.needs_reset_array
        autoreset.pending = self._sync_resets
        self._is_same_step = autoreset.is_same_step
        self._is_disabled = autoreset.mode is AutoresetMode.DISABLED
        self._is_next_step = autoreset.mode is AutoresetMode.NEXT_STEP
        self._has_finals = self._is_same_step and shared.has_finals  # (``IS_FINALS``)
        self._counters = counters
        counters.pending = self._flush_counts
        self._latencies = counters.latencies
        self._copy = vector.copy
        self._add_info = vector.add_info
        self._changes = [0]
        for supervisor in supervisors:
            supervisor.changes = self._changes
        self._checked = -1  # the change count when the workers were last checked
        self._is_parts = False  # send()/recv() of some workers went by since (``parts_plane``)
        self.parts: PartsPlane | None = None  # the same workers' send()/recv(); the link's
        self._tokens = bytes(num_workers - 1)  # none for a lone worker: it wakes the parent
        self._frame = ROUND_FRAME if num_workers > 1 else PLANNED_FRAMES[False]
        self._records_bytes = 4 * num_workers + 64  # more than a step's records
        assert shared.actions is not None
        self._actions = shared.actions
        self._action_shape, self._action_dtype = shared.actions.shape, shared.actions.dtype
        # Bytes stored through memoryviews: a tenth of what a numpy ufunc costs.
        self._seqs = shared.done.seqs[:num_workers].data
        self._status = shared.status[:num_workers]
        self._seq = 0  # every worker's seq in the step in flight
        self._seq_bytes = [bytes([seq]) * num_workers for seq in range(256)]
        # The same item flags on every step, by the slot its observations go to: under
        # next-step autoreset a worker resets an env whose last result ended (``autoreset``).
        self._plan_flags = shared.plan_flags.data
        common = plane_flags(self._is_same_step, self._is_next_step, self._has_finals)
        self._flags_to = (bytes([common]) * num_envs, bytes([common | IS_SLOT_1]) * num_envs)
        # A reset of some envs (``send_reset``): theirs by slot, the others skipped.
        self._reset_flags = (
            np.uint8(IS_RESET | IS_INFO_COLUMNS),
            np.uint8(IS_RESET | IS_INFO_COLUMNS | IS_SLOT_1),
        )
        self._reset_mask: np.ndarray | None = None  # the envs of the reset in flight
        self._rewards = shared.rewards
        self._flags = shared.flags  # (2, num_envs): terminated, truncated
        self._obs_slots = shared.obs_slots  # (2, num_envs, ...) when not nested, else None
        self._starts = np.array([part.start for part in env_slices], dtype=np.intp)
        self._sizes = np.array([part.stop - part.start for part in env_slices], dtype=np.int64)
        # The counts held back since the last flush (``_flush_counts``): each step's flags,
        # a row each, and the resets due when the first of them was sent.
        self._held = np.zeros((_HELD_STEPS, 2, num_envs), dtype=np.bool_)
        self._held_bytes = self._held.view(np.uint8).reshape(-1).data
        self._steps_held = 0
        self._resets_held = np.zeros(num_envs, dtype=np.bool_)
        self._no_end = bytes(2 * num_envs)
        self._last_flags = self._no_end  # the last step's flags: its ends reset next
        self._is_resets_stale = False  # needs_reset is not brought up to _last_flags yet
        # Set by _check.
        self._wake_fds: list[int] = []
        self._poll: Any = None
        self._spin_s = 0.0
        self._timeouts: np.ndarray | None = None  # per worker: step, reset timeout (s; inf)
        self._is_unthanked = False  # a step since the check has not told the restart ledgers
        # The step in flight: what it was sent with.
        self._actions_sent: np.ndarray | None = None
        self._records_read = b""  # its DONE records, once read
        self._target = 0
        self._sent_at = 0.0
        self._deadline: float | None = None

    def send(self, actions: Any, reset_mask: np.ndarray | None = None) -> bool:
        """Send a step of every env; False, sending nothing, if this step is not a healthy one.

        The caller then steps by the general path, which checks what is not as usual and
        says what is wrong with the actions, naming the env. With ``reset_mask`` (checked),
        a reset of those envs instead (``send_reset``).
        """
        if (self._changes[0] != self._checked or self._is_parts) and not self._check():
            return False
        slot = self._shared.same_slot
        if reset_mask is not None:
            if slot is None or self._actions_sent is not None:
                return False
            target = self._plan_reset(reset_mask, slot)
        elif (
            slot is None
            or self._actions_sent is not None
            or type(actions) is not np.ndarray
            or actions.shape != self._action_shape
            or actions.dtype != self._action_dtype
            or (self._is_disabled and self._last_flags != self._no_end)
        ):
            return False  # (disabled autoreset: the general path says which env ended)
        else:
            target = 1 - slot
            self._actions[:] = actions  # a reset's action is not read
            self._plan_flags[:] = self._flags_to[target]
        seq = self._seq = self._seq % 255 + 1  # _check chose it apart from each worker's last
        self._seqs[:] = self._seq_bytes[seq]
        self._actions_sent, self._target, self._records_read = actions, target, b""
        self._sent_at = time.perf_counter()
        frame, woken = self._frame, 0
        try:
            if self._timeouts is not None:
                self._deadline = _deadline_after(self, self._sent_at, reset_mask)
            if self._tokens:
                os.write(self._tokens_write, self._tokens)
            for fd in self._wake_fds:
                try:
                    os.write(fd, frame)
                except OSError:
                    pass  # a dead worker: its sentinel ends the wait
                woken += 1
        except BaseException:
            # Ctrl-C before or among the wake-ups: wake the rest (a worker runs a seq once,
            # however often it is woken for it) and let the control plane own the step; it
            # drains the round's tokens, if they went out, before the next one.
            for fd in self._wake_fds[woken:]:
                try:
                    os.write(fd, frame)
                except OSError:
                    pass
            self.interrupt()
            raise
        return True

    def send_reset(self, mask: np.ndarray) -> bool:
        """Send a reset of the envs in ``mask`` (checked); False, sending nothing, if not healthy.

        A planned step whose other envs are skipped (``framing.IS_SKIP``): the workers reset
        theirs through their general fast batch and answer in their status as for a step,
        infos into the columns. Each new observation goes into the slot every env is on,
        over the last one of its episode, so that the batch is that slot as it is (a
        vector returns its own arrays again, as Gymnasium's do). ``receive_reset`` waits.
        """
        return self.send(self._actions, mask)

    def _plan_reset(self, mask: np.ndarray, slot: int) -> int:
        """Write the item flags of a reset of the envs in ``mask``; the slot it writes."""
        if self._steps_held and self._is_next_step:
            self._flush_counts()  # the held window's resets are those due at its start
        flags = np.where(mask, self._reset_flags[slot], np.uint8(IS_SKIP))
        self._plan_flags[:] = flags.tobytes()
        self._reset_mask = mask
        return slot

    def receive(self, timeout: float | None = None) -> StepBatch | StepPlan | None:
        """Wait for the step ``send`` sent: its batch, or the plan handed over to the vector.

        Args:
            timeout: Seconds to wait; None waits until the step is done or a worker's
                deadline passes. On expiry, None: the step stays in flight.

        Returns:
            The step's batch; or, when anything is not as usual, the ``StepPlan`` in flight,
            every worker's part taken by its supervisor, for the vector to collect.
        """
        if self._spin_s or self._deadline is not None or timeout is not None:
            events = self._wait(timeout)
        else:
            events = self._poll()
        if len(events) != 1 or events[0][0] != self._done_read:
            if not events and not self._is_late():
                return None  # the caller's timeout, not a worker's deadline
            return self._hand_over(b"")
        # The last worker's record: the others answered in their status (``done_pipes``).
        records = self._records_read = os.read(self._done_read, self._records_bytes)
        if self._status.tobytes() != self._seq_bytes[self._seq]:
            return self._hand_over(records)  # a worker answered with a message too
        # Every worker is done and idle: from here on an exception loses this step's
        # results to the caller, and nothing else (the workers answered in full).
        self._actions_sent = None
        self._shared.move_all_to(self._target)
        rewards = self._rewards.copy()
        flags = self._flags.copy()
        flag_bytes = self._last_flags = flags.tobytes()
        self._is_resets_stale = True  # needs_reset follows when it is read (_sync_resets)
        row, size = self._steps_held, len(flag_bytes)
        self._held_bytes[row * size : (row + 1) * size] = flag_bytes
        self._steps_held = row + 1
        if row + 1 == _HELD_STEPS:
            self._flush_counts()
        infos = self._shared.infos.merge({}, _ALL, self._add_info)
        if self._has_finals and flag_bytes != self._no_end:  # each ended episode's finals
            infos = self._shared.add_finals(infos, flags[0] | flags[1], self._add_info)
        if self._obs_slots is None:
            observations = self._shared.observations(None, copy=self._copy)
        elif self._copy:
            observations = self._obs_slots[self._target].copy()
        else:
            observations = self._obs_slots[self._target]
        latencies = self._latencies
        elapsed = time.perf_counter() - self._sent_at
        latencies.values[latencies.count % latencies.size] = elapsed
        latencies.count += 1
        latencies.total_s += elapsed
        if self._is_unthanked:
            self.thank_workers()
        return observations, rewards, flags[0], flags[1], infos

    def receive_reset(
        self, timeout: float | None = None
    ) -> tuple[Any, dict[str, Any]] | StepPlan | None:
        """Wait for the reset ``send_reset`` sent: its observations and infos, or its plan.

        As ``receive``: the plan, every worker's part taken by its supervisor, when anything
        is not as usual (its deadline is the workers' reset timeouts); None when ``timeout``
        passed first, the reset still in flight.
        """
        events = self._wait(timeout)
        if len(events) != 1 or events[0][0] != self._done_read:
            if not events and not self._is_late():
                return None  # the caller's timeout, not a worker's deadline
            return self._hand_over(b"")
        records = self._records_read = os.read(self._done_read, self._records_bytes)
        if self._status.tobytes() != self._seq_bytes[self._seq]:
            return self._hand_over(records)
        mask = self._reset_mask
        assert mask is not None
        self._actions_sent = self._reset_mask = None
        # The workers wrote the reset envs' flags (no end): the others' ends stay.
        self._last_flags = self._flags.tobytes()
        self._is_resets_stale = True
        if self._is_next_step:
            self._resets_held[mask] = False  # none held (send_reset): due at the next step
        infos = self._shared.infos.merge({}, np.flatnonzero(mask), self._add_info)
        observations = self._shared.observations(None, copy=self._copy)  # (the same slot)
        if self._is_unthanked:
            self.thank_workers()
        return observations, infos

    def align_slots(self) -> None:
        """Put every env's last observation on one slot, so that a step of all may go here.

        Partial batches (``send``/``recv``) leave envs on either slot; the envs that are
        behind are copied over (``SharedBatch.observations``), as the general path does.
        """
        if self._shared.same_slot is None:
            self._shared.observations(None)

    def is_in_flight(self) -> bool:
        """Whether a step was sent and not yet received."""
        return self._actions_sent is not None

    def enter_parts(self) -> bool:
        """Ready the workers for ``send``/``recv`` on the parts plane; False if they are not.

        Every worker must be idle: the parts plane calls it when none of its own is in
        flight. The counts held back are written and ``needs_reset`` brought up to date, as
        the parts plane keeps both itself from then on; the next ``send`` checks again.
        """
        if self._actions_sent is not None:
            return False
        if self._changes[0] != self._checked and not self._check():
            return False
        if not self._is_parts:
            self._flush_counts()
            self._sync_resets()
            self._is_parts = True
        return True

    @property
    def wake_fds(self) -> list[int]:
        """Each worker's pipe, which one byte wakes (valid after a check)."""
        return self._wake_fds

    @property
    def timeouts(self) -> np.ndarray | None:
        """Per worker, its step and reset timeouts (s; inf: none); None if no worker has one."""
        return self._timeouts

    def thank_workers(self) -> None:
        """A step after the check came back clean: each worker's restart ledger hears it."""
        self._is_unthanked = False
        for supervisor in self._supervisors:
            supervisor.note_success()

    def is_unthanked(self) -> bool:
        """Whether no step since the check has told the restart ledgers yet."""
        return self._is_unthanked

    def poll_until(self, wake_at: float | None) -> list[tuple[int, int]]:
        """Poll the done pipe and the sentinels until one fires or ``wake_at`` (monotonic)."""
        if self._spin_s:
            events: list[tuple[int, int]] = poll_hot(self._poll, self._spin_s)
            if events:
                return events
        if wake_at is None:
            events = self._poll()
        else:
            events = self._poll(max(0, math.ceil((wake_at - time.monotonic()) * 1000)))
        return events

    def interrupt(self) -> StepPlan | None:
        """An exception stopped the step in flight: the control plane owns it from now on.

        The workers' supervisors take their parts, so the vector's next call collects
        (and drops) what the workers answer before it sends anything; or ``recv`` collects
        them, as parts of the plan returned (None: no step was in flight).
        """
        if self._actions_sent is None:
            return None
        return self._hand_over(self._records_read)

    # ----------------------------------------------------------------- off the healthy step

    def _check(self) -> bool:
        """Check every worker can take a planned step as sent here; cache their fds."""
        if not self._autoreset.is_started:  # the general path says which env needs a reset
            return False
        if self.parts is not None and self.parts.is_busy():
            return False  # send() has envs in flight: the vector's checks refuse the step
        self._flush_counts()
        fds = plane_fds(self._supervisors)  # None once closed: the shared memory is gone
        if fds is None:
            return False
        # One seq for every worker from now on: one that none of them was just sent, and
        # none of their statuses holds. A worker that dies before it answers leaves its
        # status as it was: a round under that seq would read it as answered, with the
        # dead worker's old results (``hand_over_round``).
        used = set(self._seqs.tolist()) | set(self._status.tolist())
        free = [seq for seq in range(1, 256) if seq % 255 + 1 not in used]
        if not free:  # (128 workers or more, all apart: the general path numbers each)
            return False
        self._seq = free[0]
        wake_fds, sentinels, spin_s = fds
        poller = select.poll()
        for fd in (self._done_read, *sentinels):
            poller.register(fd, select.POLLIN)
        self._wake_fds, self._poll, self._spin_s = wake_fds, poller.poll, spin_s
        self._timeouts = plane_timeouts(self._supervisors)
        self._deadline = None
        done = self._shared.done
        done.drain_tokens()  # whatever rounds of the general path left
        done.drain(self._done_read)
        done.forget_records()  # of batches collected already
        # The ends the workers read (``resolve_next_step``) become the vector's, which a
        # crash's truncation or a reset by the caller may have changed.
        needs_reset = self._autoreset.needs_reset
        self._flags[0] = needs_reset
        self._flags[1] = False
        self._last_flags = self._flags.tobytes()
        self._resets_held[:] = needs_reset
        self._is_unthanked = True
        self._is_parts = False
        self._checked = self._changes[0]
        return True

    def _sync_resets(self) -> None:
        """Bring the vector's ``needs_reset`` up to the last step (``Autoreset.pending``)."""
        if self._is_resets_stale:
            self._is_resets_stale = False
            if not self._is_same_step:
                np.logical_or.reduce(self._last_ends(), axis=0, out=self._needs_reset)

    def _last_ends(self) -> np.ndarray:
        """The last step's terminated and truncated flags, ``(2, num_envs)``."""
        return np.frombuffer(self._last_flags, dtype=np.bool_).reshape(2, -1)

    def _flush_counts(self) -> None:
        """Write the steps and episodes held back since the last flush into the counters."""
        if self.parts is not None:
            self.parts.flush_counts()
        held = self._steps_held
        if held:
            ended = np.asarray(self._held[:held].any(axis=1))  # (held, num_envs)
            resets = self._resets_held if self._is_next_step else None
            self._counters.note_window(ended, resets)
            self._steps_held = 0

    def _wait(self, timeout: float | None) -> list[tuple[int, int]]:
        """Poll the done pipe and the sentinels until one fires, the deadline or ``timeout``."""
        wake_at = self._deadline
        if timeout is not None:
            until = time.monotonic() + timeout
            wake_at = until if wake_at is None else min(wake_at, until)
        return self.poll_until(wake_at)

    def _is_late(self) -> bool:
        deadline = self._deadline
        return deadline is not None and time.monotonic() >= deadline

    def _hand_over(self, records: bytes) -> StepPlan:
        """Give the step in flight to the control plane: each supervisor takes its part."""
        actions = self._actions_sent
        assert actions is not None
        self._actions_sent = None
        shared = self._shared
        if self._tokens:  # a round: each worker's record, wherever it is (``done_pipes``)
            records += shared.done.hand_over_round(self._status, self._seq)
        mask, self._reset_mask = self._reset_mask, None
        if mask is not None:  # a reset of some envs: those not in it are skipped
            is_reset = mask
        elif self._is_next_step:  # the envs the last step ended reset in this one
            is_reset = np.asarray(self._last_ends().any(axis=0))
        else:
            is_reset = np.zeros(len(self._needs_reset), dtype=np.bool_)
        plan = StepPlan(
            actions,
            is_reset,
            self._is_same_step and mask is None,
            shared.whole_slots(self._target),
            int(np.count_nonzero(is_reset)),
            is_counted=bool(self._tokens),
            has_finals=self._has_finals and mask is None,
            skip=None if mask is None else ~mask,
        )
        shared.done.open_round(is_written=True)
        shared.done.forget_records()  # only this step's count from here on
        for supervisor, env_slice in zip(self._supervisors, self._env_slices, strict=True):
            deadline = supervisor.take_planned(plan, env_slice, self._sent_at)
            handle = supervisor.handle
            assert isinstance(handle, ProcessHandle)
            handle.take_planned(plan, env_slice, deadline)
        shared.done.note_records(records)
        return plan


def _deadline_after(
    plane: DataPlane, sent_at: float, reset_mask: np.ndarray | None
) -> float | None:
    """When ``plane``'s first worker is late: each gets its envs' step and reset timeouts.

    (``DataPlane``'s, kept out of the class for its size.)

    ``reset_mask``: the envs of a reset of some (the others do nothing); None for a step.
    """
    assert plane._timeouts is not None
    if reset_mask is not None:
        resets = np.add.reduceat(reset_mask, plane._starts, dtype=np.int64)
        steps = resets * 0
    elif plane._is_next_step and plane._last_flags != plane._no_end:
        ends = plane._last_ends().any(axis=0)
        resets = np.add.reduceat(ends, plane._starts, dtype=np.int64)
        steps = plane._sizes - resets
    else:
        resets, steps = plane._sizes * 0, plane._sizes
    budgets = worker_budgets(steps, resets, plane._timeouts)
    # A worker with nothing to do in the round has nothing to be late with.
    earliest = float(np.where(steps + resets > 0, budgets, math.inf).min())
    return None if math.isinf(earliest) else sent_at + earliest
