"""WORKER SIDE: the usual planned step, in one loop over the worker's envs, like the probe's.

A vector's healthy step wakes every worker with the same byte (``framing.PLANNED_STEP``);
the worker finds the step's seq and its envs' item flags in shared memory. On nearly every
step those flags are the same for all its envs: step each one (or, under next-step
autoreset, reset those whose last result ended; under same-step autoreset, reset at once
each one whose step ended, its final obs and info into rows of their own), observations
into one slot, infos into the info columns. ``PlannedStep.run`` runs that step as
``scripts/bare_probe.py``'s worker does, top to bottom, with the worker's rows of the shared
buffers mapped once (``PlannedRows``) and no per-env objects::

    seq, flags            <- the worker's byte and its envs' flags, one read each
    ends of the last step <- two rows, only under next-step autoreset
    actions               <- one copy of its envs' rows
    envs that mostly wait -> their steps (or resets) started first, each on its thread
                             (``waiting``), taken at their turn below
    each env              -> step (or reset), check its observation, reward and flags
                             stored, info into its row of cells
    observations          -> the step's slot, one numpy write (one per env when large)
    done                  -> its status and the done pipes (``DoneNotifier``)

Anything else is handed to the general fast batch before any env moves: flags that differ
between envs (a masked reset, a replay after a death), explicit resets, envs left out
of the step (``IS_SKIP``, all of a worker's envs left out of a masked reset), same-step
autoreset whose finals may not go into shared memory (``framing.IS_FINALS`` unset: only the
data plane sets it). What goes wrong in the loop is answered as the general batch answers
it: an env's exception, an info that the columns cannot hold, a new info schema or a
generator to keep go back in a ``Reply`` on the worker's pipe (``DONE_REPLY``), and so do
the step's finals then; the other envs step on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from multienv.wire.framing import (
    DONE_OK,
    DONE_REPLY,
    IS_AUTORESET,
    IS_FINALS,
    IS_INFO_COLUMNS,
    IS_KEEP_NP_RANDOM,
    IS_NEXT_STEP,
    IS_RESET,
    IS_SKIP,
    IS_SLOT_1,
    PLANNED_FRAMES,
    PLANNED_ROUND,
    PLANNED_STEP,
    PLANNED_STEP_COUNTED,
    ROUND_FRAME,
    hot_poll,
    poll_hot,
    write_message,
)
from multienv.wire.protocol import Outcome, Reply
from multienv.wire.shared_memory import PlannedRows, SlotWriter
from multienv.worker.runner import EnvRunner, encode_reply, np_random_or_none, package_failure
from multienv.worker.waiting import WaitingEnvs

_perf_counter = time.perf_counter
_READ_BYTES = 65536  # as ``MessageReader`` reads
_KIND_OF_FRAME = {
    PLANNED_FRAMES[False]: PLANNED_STEP,
    PLANNED_FRAMES[True]: PLANNED_STEP_COUNTED,
    ROUND_FRAME: PLANNED_ROUND,
}
GeneralBatch = Callable[[int, list[tuple[int, int]], bool, bool, bool], None]


class PlannedStep:
    """Runs the worker's planned steps; the unusual ones through ``general``.

    Args:
        rows: The worker's rows of the shared buffers (``SlotWriter.planned_rows``).
        writer: The worker's writer: its info columns, done notifier and batch times.
        runner: The worker's envs and their observation checks.
        general: The general fast batch: ``(seq, items, is_counted, is_planned, is_round)``.
        request_fd: Where the worker reads its requests, and so its wake-ups.
        fd: The worker's socket, where a reply goes.
    """

    __slots__ = (
        "_checks",
        "_envs",
        "_fd",
        "_general",
        "_is_general",
        "_no_ends",
        "_poll",
        "_positions",
        "_request_fd",
        "_rows",
        "_runner",
        "_spin_s",
        "_uniform",
        "_waiting",
        "_writer",
        "_writes_each_obs",
        "last_seq",
        "on_reset",
    )

    def __init__(
        self,
        rows: PlannedRows,
        writer: SlotWriter,
        runner: EnvRunner,
        general: GeneralBatch,
        request_fd: int,
        fd: int,
        spin_s: float = 0.0,
    ) -> None:
        """Keep what every step reads."""
        size = len(runner.envs)
        self._rows = rows
        self._envs = runner.envs
        self._checks = runner.checks
        self._runner = runner
        self._writer = writer
        self._general = general
        self._fd = fd
        self._request_fd = request_fd
        self._positions = range(size)
        self._uniform = [bytes([flags]) * size for flags in range(256)]
        # By flags byte: whether a step of them goes to the general fast batch (explicit
        # resets, envs left out; same-step autoreset unless its finals may go into shared
        # memory).
        self._is_general = [
            rows.actions is None
            or bool(flags & (IS_RESET | IS_SKIP))
            or bool(flags & IS_AUTORESET and (not flags & IS_FINALS or rows.final_obs is None))
            for flags in range(256)
        ]
        self._no_ends = bytes(size)
        # One env's large observation is written as soon as it is made (``SlotWriter``);
        # a lone env's too, as there is nothing to batch; nested ones by the writer.
        self._writes_each_obs = writer.writes_each_obs or size == 1 or rows.obs is None
        self._spin_s = spin_s
        self._poll = hot_poll(request_fd, spin_s)
        # Envs that mostly wait step at once, on threads (a lone env has none to wait with).
        if size > 1 and runner.waiting is None:
            runner.waiting = WaitingEnvs(size)
        self._waiting = runner.waiting
        self.on_reset: Callable[[], None] | None = None  # called after a step that reset
        self.last_seq = 0  # the seq of the planned step just run; 0 after any other request

    def serve(self, kind: int) -> bytes:
        """Run planned steps as long as the parent sends nothing else; what it sent then.

        Reads the worker's pipe itself, as the probe's worker does, while each read is one
        planned step's wake-up; the first read that is anything else is returned, for the
        worker's general loop (``MessageReader.push``).

        Args:
            kind: The first step's kind (``framing.PLANNED_KINDS``).

        Raises:
            EOFError: The parent's end of the pipe closed.
        """
        fd, kinds = self._request_fd, _KIND_OF_FRAME
        while True:
            if self.run(kind) and self.on_reset is not None:
                self.on_reset()
            if self._poll is not None:  # hot: keep the core awake for the next wake-up
                poll_hot(self._poll, self._spin_s)
            data = os.read(fd, _READ_BYTES)
            next_kind = kinds.get(data)
            if next_kind is not None:
                kind = next_kind
            elif data:
                return data
            else:
                raise EOFError("the other end of the pipe closed")

    def run(self, kind: int) -> bool:
        """Run the planned step the parent sent, of that kind; whether it reset any env.

        A parent interrupted while it woke the workers may wake one twice for a seq: the
        second wake-up finds the seq run already and does nothing.
        """
        began = _perf_counter()
        rows = self._rows
        seq = rows.seq[0]
        if seq == self.last_seq:
            return False
        self.last_seq = seq
        is_counted, is_round = kind != PLANNED_STEP, kind == PLANNED_ROUND
        plan = rows.plan.tobytes()
        flags = plan[0]
        if plan != self._uniform[flags] or self._is_general[flags]:
            self._general(seq, self._writer.planned_items()[1], is_counted, True, is_round)
            return False
        ended: bytes | list[int] = self._no_ends
        if flags & IS_NEXT_STEP:  # an env whose last result ended resets instead
            terminated_row, truncated_row = rows.ends[0].tobytes(), rows.ends[1].tobytes()
            if terminated_row != ended or truncated_row != ended:
                ended = [a | b for a, b in zip(terminated_row, truncated_row, strict=True)]
        assert rows.actions is not None  # else every step goes to the general batch
        actions: Any = rows.actions if rows.is_discrete else rows.actions.copy()
        slot = 1 if flags & IS_SLOT_1 else 0
        obs_rows = None if rows.obs is None else rows.obs[slot]
        writer = self._writer
        write_info = writer.infos.write if flags & IS_INFO_COLUMNS else None
        keeps_np_random = flags & IS_KEEP_NP_RANDOM
        is_same_step = flags & IS_AUTORESET  # and IS_FINALS: the finals go to shared memory
        finals: list[tuple[int, Any, Any, Any]] | None = None  # position, obs, info, reset info
        envs, checks, first = self._envs, self._checks, rows.first
        rewards, terminations, truncations = rows.rewards, rows.terminated, rows.truncated
        info_ids = rows.info_ids
        writes_each_obs = self._writes_each_obs
        observations: list[Any] = []
        waiting = self._waiting  # the envs that wait start first, on their threads
        call = None if waiting is None else waiting.begin(envs, actions, ended)
        reward: Any
        extras: dict[int, Outcome] | None = None
        resets: set[int] | None = None
        for position in self._positions:
            env, env_index = envs[position], first + position
            try:
                if ended[position]:
                    resets = {position} if resets is None else resets | {position}
                    obs, info = env.reset() if call is None else call(position, env.reset)
                    reward, terminated, truncated = 0.0, False, False
                else:
                    obs, reward, terminated, truncated, info = (
                        env.step(actions[position])
                        if call is None
                        else call(position, env.step, actions[position])
                    )
                    if is_same_step and (terminated or truncated):  # reset it at once
                        check = checks[position]
                        if check is not None and check(obs) is not None:
                            self._runner.check(position, obs)
                        final_obs, final_info = obs, info
                        obs, info = env.reset() if call is None else call(position, env.reset)
                        finals = [] if finals is None else finals
                        finals.append((position, final_obs, final_info, info))
                check = checks[position]
                if check is not None and check(obs) is not None:
                    self._runner.check(position, obs)  # raises, naming the space
                rewards[env_index] = reward  # first: a reward that is no number raises here
                terminations[env_index] = terminated
                truncations[env_index] = truncated
            except Exception as exc:  # noqa: BLE001 - reported for this env only; siblings go on
                if finals and finals[-1][0] == position:  # it failed after its reset
                    finals.pop()
                extras = {} if extras is None else extras
                extras[position] = Outcome(failure=package_failure(exc, position))
                info_ids[env_index] = 0
                writes_each_obs = True  # the others' rows no longer follow each other
                continue
            if write_info is None:
                if info:
                    extras = {} if extras is None else extras
                    extras[position] = Outcome(info=info)
            elif not info:
                info_ids[env_index] = 0
            elif not write_info(env_index, info):
                extras = {} if extras is None else extras
                extras[position] = Outcome(info=info)
            if keeps_np_random and (terminated or truncated):
                extras = {} if extras is None else extras
                outcome = extras.setdefault(position, Outcome())
                outcome.np_random = np_random_or_none(env)
            if writes_each_obs:
                if obs_rows is None:
                    writer.write_obs(position, slot, obs)
                else:
                    obs_rows[position] = obs
            else:
                observations.append(obs)
        if observations:
            if len(observations) == len(envs):
                assert obs_rows is not None  # else every observation is written in the loop
                obs_rows[:] = observations
            else:  # an env failed after these were kept: each to its own row
                for position, obs in enumerate(observations):
                    writer.write_obs(position, slot, obs)
        infos = writer.infos
        if finals:
            extras = self._file_finals(finals, extras)
        schemas = infos.take_pending() if infos.pending else None
        writer.note_batch_time(_perf_counter() - began)
        if extras is None and schemas is None:
            writer.notifier.notify(seq, DONE_OK, is_counted, True, is_round)
        else:
            writer.notifier.notify(seq, DONE_REPLY, is_counted, True, is_round)
            reply = Reply({} if extras is None else extras, schemas=schemas)
            write_message(self._fd, encode_reply(reply, None, resets))
        return resets is not None

    def _file_finals(
        self, finals: list[tuple[int, Any, Any, Any]], extras: dict[int, Outcome] | None
    ) -> dict[int, Outcome] | None:
        """Same-step autoreset: where the final obs and info of the episodes that ended go.

        Into shared memory (``SharedBatch.finals``) when the step's answer is all there;
        else, as the general fast batch sends them, into the reply: its final obs, info and
        reset info each, the reset's info no longer in the env's row. Returns ``extras``.
        """
        rows, writer = self._rows, self._writer
        first, pending = rows.first, writer.infos.pending
        if extras is None and not pending:
            final_rows, write = rows.final_obs, writer.final_infos.write
            assert final_rows is not None  # else the step went to the general batch
            for position, obs, info, _ in finals:
                final_rows[position] = obs
                if not info:
                    writer.final_infos.clear(first + position)
                elif not write(first + position, info):
                    break  # not plain: every final goes into the reply
            else:
                if not pending:  # (a new schema's number goes in a reply)
                    return None
        extras = {} if extras is None else extras
        for position, obs, info, reset_info in finals:
            outcome = extras.setdefault(position, Outcome())
            outcome.obs, outcome.info, outcome.reset = obs, info, (None, reset_info)
            rows.info_ids[first + position] = 0
        return extras
