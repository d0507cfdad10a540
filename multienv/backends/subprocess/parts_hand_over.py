"""PARENT SIDE, subprocess backend: what the parts plane hands the control plane.

When something on the parts plane (``parts_plane``) is not as usual (a death, a deadline,
an env's error, a reply that is more than infos, a batch that would split a worker), every
worker there goes to its supervisor, which takes its part as a planned step
(``WorkerSupervisor.take_planned``); a worker whose message its supervisor has read already
goes as its outcome. ``PartsHandOver`` holds that half of ``PartsPlane``; the usual
``send``/``recv`` stays in ``parts_plane``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from multienv.wire.framing import DONE_OK, DONE_RECORD, DONE_REPLY
from multienv.wire.protocol import BatchResult, Outcome, StepPlan

if TYPE_CHECKING:
    from multienv.supervision.handles import PlannedWorker
    from multienv.wire.autoreset import Autoreset
    from multienv.wire.shared_memory import SharedBatch

# A worker's outcome as its supervisor's ``finish`` gives it, errors by env index.
Collected = tuple[BatchResult | None, dict[int, BaseException]]
# What the control plane gets of each worker here: its part in flight, or its outcome.
Handed = StepPlan | Collected


class PartsHandOver:
    """The parts plane's workers handed to the control plane (``PartsPlane`` inherits it)."""

    __slots__ = ()

    if TYPE_CHECKING:  # what it uses of the parts plane
        _supervisors: list[PlannedWorker]
        _env_slices: list[slice]
        _shared: SharedBatch
        _autoreset: Autoreset
        _seqs: np.ndarray
        _flying: np.ndarray
        _done: np.ndarray
        _counted: np.ndarray
        _extras: dict[int, Outcome]
        _actions: np.ndarray
        _obs_rows: np.ndarray
        _slot_of_row: np.ndarray
        _resets: np.ndarray
        _sent_at: np.ndarray
        _is_next_step: bool
        _is_same_step: bool
        _has_finals: bool

        def _note_done(self, number: int) -> None: ...

        def _note_counted(self) -> None: ...

        def _forget_workers(self) -> None: ...

    def _collect_reply(self, number: int) -> dict[int, Collected] | None:
        """Have the worker's supervisor read its message; None if the worker stays here.

        It stays, done, when its message holds only infos (new keys, pickled ones, a
        same-step reset's final observation): they wait for ``_take`` in ``_extras``, and
        its supervisor has counted its steps. An env's error, a death after the record (the
        supervisor respawns and replays it) or anything else: its outcome, collected.
        """
        supervisor, env_slice = self._supervisors[number], self._env_slices[number]
        restarts = supervisor.stats.restarts
        self._take_planned(number, self._plan())
        seq = int(self._seqs[number])
        self._shared.done.note_records(DONE_RECORD.pack(number, seq, DONE_REPLY))
        env_ids = range(env_slice.start, env_slice.stop)
        try:
            result, errors = supervisor.finish()
        except Exception as exc:  # noqa: BLE001 - raised by the caller, as the pool's are
            lost: dict[int, BaseException] = dict.fromkeys(env_ids, exc)
            return {number: (None, lost)}
        by_env: dict[int, BaseException] = {env_slice.start + i: e for i, e in errors.items()}
        outcome = (result, by_env)
        if errors or result is None or supervisor.stats.restarts != restarts:
            return {number: outcome}
        for item, extra in result.extras.items():
            is_done = bool(result.terminated[item] or result.truncated[item])
            if self._autoreset.step_info(extra, is_done)[1]:  # must reset now: a crash's
                return {number: outcome}
        self._extras.update(
            {env_slice.start + item: extra for item, extra in result.extras.items()}
        )
        self._counted[number] = True
        self._note_counted()
        self._note_done(number)
        return None

    def _drained_by_control_plane(self) -> list[int]:
        """Workers whose records a supervisor's wait read: mark the done ones; the replies."""
        done = self._shared.done
        replies = []
        seqs = self._seqs.tolist()
        for number in np.flatnonzero(self._flying).tolist():
            if done.done_seq[number] == seqs[number]:
                done.done_seq[number] = 0
                if done.done_kind[number] == DONE_OK:
                    self._note_done(number)
                else:
                    replies.append(number)
        return replies

    def _plan(self) -> StepPlan:
        """The planned step whose parts the workers here are stepping, for their supervisors."""
        is_reset = self._resets.copy() if self._is_next_step else np.zeros_like(self._resets)
        return StepPlan(
            self._actions.copy(),
            is_reset,
            self._is_same_step,
            self._slot_of_row[self._obs_rows],  # as the shared slots
            int(np.count_nonzero(is_reset)),
            has_finals=self._has_finals,
        )

    def _take_planned(self, number: int, plan: StepPlan) -> None:
        """The worker's supervisor and handle take its part of ``plan``, as sent."""
        supervisor, env_slice = self._supervisors[number], self._env_slices[number]
        deadline = supervisor.take_planned(plan, env_slice, float(self._sent_at[number]))
        handle = supervisor.handle
        handle.take_planned(plan, env_slice, deadline)  # type: ignore[attr-defined]

    def _hand_over_all(self, collected: dict[int, Collected] | None = None) -> dict[int, Handed]:
        """Give every worker here to the control plane: each supervisor takes its part.

        ``collected``: a worker whose outcome its supervisor has collected already. The done
        workers' records are written anew, so that their supervisors find them answered.
        """
        handed: dict[int, Handed] = dict(collected or {})
        for number in handed:
            self._flying[number] = self._done[number] = False
        numbers = np.flatnonzero(self._flying | self._done).tolist()
        seqs = self._seqs.tolist()
        done = self._shared.done
        answered = b"".join(
            DONE_RECORD.pack(number, seqs[number], DONE_OK)
            for number in np.flatnonzero(self._done).tolist()
        )
        # A flying worker whose record a supervisor's wait read already (it drains every
        # record of the slice) keeps it: forgotten, its supervisor would wait for ever.
        answered += b"".join(
            DONE_RECORD.pack(number, seqs[number], done.done_kind[number])
            for number in np.flatnonzero(self._flying).tolist()
            if done.done_seq[number] == seqs[number]
        )
        counted = [number for number in numbers if self._counted[number]]
        self._forget_workers()
        done.forget_records()
        if numbers:
            plan = self._plan()
            for number in numbers:
                self._take_planned(number, plan)
                handed[number] = plan
        done.note_records(answered)
        # A worker whose message its supervisor read is collected: its outcome is the
        # shared memory and the infos kept here (counted already, by its supervisor).
        for number in counted:
            handed[number] = self._kept_outcome(number)
        return handed

    def _kept_outcome(self, number: int) -> Collected:
        """A done worker whose message was read: its result, as ``collect`` would give it."""
        supervisor = self._supervisors[number]
        env_slice = self._env_slices[number]
        supervisor.finish()  # the DONE_OK record written anew: it returns at once
        shared = self._shared
        shared.move_to(env_slice, self._slot_of_row[self._obs_rows[env_slice]])
        flags = shared.flags
        result = BatchResult(
            shared.rewards[env_slice].copy(),
            flags[0, env_slice].copy(),
            flags[1, env_slice].copy(),
            None,
            {},
            info_columns=True,
        )
        for env_index in range(env_slice.start, env_slice.stop):
            extra = self._extras.pop(env_index, None)
            if extra is not None:  # as the worker said it: the vector makes it an info once
                result.extras[env_index - env_slice.start] = extra
        return result, {}
