"""PARENT SIDE, backend-neutral: one worker's supervisor, which keeps the failure table.

``WorkerSupervisor``, one per worker, sends its calls and batches with their deadlines and
keeps the death -> respawn -> replay table below: what a death means for the call in
flight. Getting a worker ready again, under the ``RestartPolicy`` budget, is its
``WorkerLife``'s job (``lifecycle``). A worker is the unit that dies, so it is also
the unit that respawns and spends the restart budget; each of its envs counts the restart.
It talks to the worker only through a ``WorkerHandle`` (``multienv.supervision.handles``), counts
through ``WorkerStats`` and leaves recycling decisions to its ``Recycler``.

Failure semantics, for a worker hosting k envs:

- It dies during a batch of steps (signal, exit, OOM kill, or a ``step_timeout`` kill): no
  exception. It is respawned and re-initialized, and each step of the batch returns a
  truncation: the last observation the caller saw, ``reward=0.0``, ``terminated=False``,
  ``truncated=True``, ``info["multienv"] = {"restarted": True, "cause": ..., "restarts":
  k}``. Its other envs, not in that batch, lost their episode too: each returns the same
  flagged truncation on its next step, without stepping. The caller's next reset (an
  autoreset's, or its own) starts the new episodes.
- It dies during a reset, ``render``, ``call``, ``get_attr`` or ``set_attr``: respawned, and
  the command is replayed on the fresh env; the worker's other envs lost their episode.
- It dies while building its envs: respawned, under the same budget.
- Env code raises: ``EnvError`` naming the env, the remote type and message, with the
  worker's traceback chained; the worker stays alive and the other envs of the batch keep
  their results (if ``env_fn`` raised, the worker has exited). With
  ``restart_on_error=True`` the error is treated as a death of the worker instead.
- Respawns beyond the ``RestartPolicy``: ``EnvCrashLoopError`` now and on every later call
  (``EnvCrashedError`` under ``RestartPolicy.never()``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from multienv.errors import (
    EnvStateError,
)
from multienv.restart import RestartPolicy
from multienv.supervision.failures import RestartLedger, call_advice
from multienv.supervision.handles import Backend, Death, SharedMemoryHandle, WorkerHandle
from multienv.supervision.lifecycle import EnvState, WorkerLife
from multienv.supervision.log_limit import failure_log
from multienv.supervision.options import SupervisorOptions
from multienv.supervision.recycler import Recycler
from multienv.supervision.truncation import CutEpisodes
from multienv.supervision.worker_stats import WorkerStats
from multienv.wire.protocol import (
    DONE_OK_RESULT,
    Batch,
    BatchResult,
    Command,
    EnvDescription,
    Request,
    StepPlan,
)

logger = logging.getLogger(__name__)


# The defaults of every backend's ``init_timeout`` and ``close_timeout_s``: how long a worker
# may take to build its envs, and how long ``close()`` waits for it before killing it.
_DEFAULTS = SupervisorOptions()


def batch_deadline(
    num_steps: int, num_resets: int, timeouts: tuple[float | None, float | None]
) -> float | None:
    """When steps and resets must be done, given the (step, reset) timeouts; None: never."""
    budget = 0.0
    for count, timeout in zip((num_steps, num_resets), timeouts, strict=True):
        if count:
            if timeout is None:
                return None
            budget += count * timeout
    return time.monotonic() + budget if budget else None


def items_deadline(
    is_reset: np.ndarray, timeouts: tuple[float | None, float | None]
) -> float | None:
    """``batch_deadline`` of a batch whose items reset where ``is_reset`` is set, else step."""
    if timeouts == (None, None):
        return None  # skips the count on every step of a vector without timeouts
    num_resets = int(np.count_nonzero(is_reset))
    return batch_deadline(len(is_reset) - num_resets, num_resets, timeouts)


def planned_deadline(
    plan: StepPlan, env_slice: slice, timeouts: tuple[float | None, float | None]
) -> float | None:
    """``items_deadline`` of one worker's slice of a plan; no slice to count in the usual case."""
    if timeouts == (None, None):
        return None
    if plan.skip is not None:  # a reset of the envs not skipped
        return batch_deadline(0, int(np.count_nonzero(~plan.skip[env_slice])), timeouts)
    if plan.num_resets:
        return items_deadline(plan.is_reset[env_slice], timeouts)
    return batch_deadline(env_slice.stop - env_slice.start, 0, timeouts)


@dataclasses.dataclass
class _Pending:
    """The call in flight on a worker."""

    batch: Batch | None  # a batch as asked, or None for a call
    sent: Batch | None  # what of it was sent
    sent_items: list[int] | None  # which items of it were sent; None: all
    lost: dict[int, str]  # items not sent: their env lost its episode to an earlier death
    request: Request | None
    deadline: float | None
    sent_at: float
    plan: StepPlan | None = None  # a planned step: this worker's envs are plan_slice
    plan_slice: slice | None = None
    budget: tuple[int, int] = (0, 0)  # a call's env steps and resets, for its deadline


class WorkerSupervisor:
    """Lifecycle, failure table and restart budget of one worker hosting k envs.

    Args:
        handle: The transport to the worker.
        env_indices: The index of each of the worker's envs, by position, for messages.
        backend: The backend the handle belongs to (a vector links its handles with it).
        options: Its deadlines and policies (``SupervisorOptions``). A batch of m steps gets
            m times ``step_timeout``, and m resets m times ``reset_timeout``.
    """

    def __init__(
        self,
        handle: WorkerHandle,
        env_indices: Sequence[int],
        backend: Backend,
        options: SupervisorOptions = _DEFAULTS,
    ) -> None:
        """Create the supervisor; no worker is started yet."""
        restart_policy, recycle = options.restart_policy, options.recycle
        init_timeout, restart_on_error = options.init_timeout, options.restart_on_error
        self.handle = handle
        # The optional shared-memory part of the handle, when the backend has one.
        self._shm_handle = handle if isinstance(handle, SharedMemoryHandle) else None
        self.backend = backend
        self.env_indices = list(env_indices)
        self._open_positions = set(range(len(self.env_indices)))  # envs whose proxy is open
        self._ledger = RestartLedger(
            restart_policy if restart_policy is not None else RestartPolicy(), self.env_indices
        )
        self._timeouts = (options.step_timeout, options.reset_timeout)
        self._init_timeout = init_timeout
        self._restart_on_error = restart_on_error
        self._close_timeout_s = options.close_timeout_s
        self._pending: _Pending | None = None
        self._planned = _Pending(None, None, None, {}, None, None, 0.0)  # see submit_planned
        self._cuts = CutEpisodes(
            len(self.env_indices),
            lambda position: (
                None if self._shm_handle is None else self._shm_handle.read_obs(position)
            ),
            lambda position: self.descriptions[position].observation_space,
        )
        self.stats = WorkerStats(len(self.env_indices))
        self._recycler = None if recycle is None else Recycler(recycle, self)
        self._life = WorkerLife(
            handle,
            self.env_indices,
            self._ledger,
            self.stats,
            init_timeout=init_timeout,
            restart_on_error=restart_on_error,
            on_spawn=(lambda: None) if self._recycler is None else self._recycler.on_spawn,
        )
        self.env_error = self._life.env_error  # the EnvError of a failure in the worker
        # Counts what takes the worker out of the state a vector's data plane checked: a
        # call, a general batch, a planned step the data plane did not send itself, a death,
        # a recycle, close. A vector's workers share one counter (``data_plane``).
        self.changes = [0]

    # ----------------------------------------------------------------- lifecycle

    @property
    def state(self) -> EnvState:
        """Where the worker is in its lifecycle."""
        return self._life.state

    @property
    def descriptions(self) -> list[EnvDescription]:
        """What the worker's envs are (spaces, metadata), by position, once it is ready."""
        return self._life.descriptions

    @property
    def timeouts(self) -> tuple[float | None, float | None]:
        """The worker's (step, reset) timeouts, per env of a batch."""
        return self._timeouts

    @property
    def deadline(self) -> float | None:
        """The deadline of the call in flight, if any."""
        return None if self._pending is None else self._pending.deadline

    def start(self, name: str = "start") -> None:
        """Launch the worker, which starts building its envs; returns without waiting."""
        self._life.require(EnvState.CREATED, name, self.env_indices[0])
        self._life.spawn()

    def initialize(self) -> None:
        """Wait until the worker has built its envs (respawning it if it dies meanwhile).

        Raises:
            EnvError: An ``env_fn`` raised in the worker, which has exited.
            EnvCrashLoopError: The worker kept dying or timing out while building its envs.
        """
        self._life.require(EnvState.STARTED, "initialize", self.env_indices[0])
        self._life.become_ready()

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker; idempotent and bounded in time."""
        self.changes[0] += 1
        if self._life.state is EnvState.CLOSED:
            return
        self._life.is_closing.set()
        self.handle.stop(self._close_timeout_s if timeout is None else timeout)
        self._pending = None
        self._life.set_state(EnvState.CLOSED)
        failure_log.flush()  # the failures still counted, not yet told

    def abandon(self) -> bool:
        """Kill the worker and close, waiting for nothing; whether it was open (``WorkerLife``)."""
        self.changes[0] += 1
        self._open_positions.clear()
        return self._life.abandon()

    def abandon_env(self, position: int) -> bool:
        """One env's proxy was dropped unclosed: abandon the worker once all its envs are gone.

        Returns whether the worker was abandoned now.
        """
        self._open_positions.discard(position)
        return not self._open_positions and self._life.abandon()

    def close_env(self, position: int, timeout: float | None = None) -> None:
        """One env's proxy is closed; the worker stops once all of its envs are."""
        self._open_positions.discard(position)
        if not self._open_positions:
            self.close(timeout)

    def begin_link(self) -> None:
        """Start giving the worker its vector's link; ``join_link`` finishes (no wait here)."""
        if self._shm_handle is not None and self._life.state is EnvState.READY:
            self._shm_handle.begin_link()

    def join_link(self) -> None:
        """Give the worker what its vector's link shares (respawning it if it dies meanwhile)."""
        self._cuts.forget_obs()
        if self._shm_handle is None:
            return
        deadline = None if self._init_timeout is None else time.monotonic() + self._init_timeout
        death = self._shm_handle.join_link(deadline)
        if death is not None:
            self._restart(death.cause)

    def require(self, wanted: EnvState, name: str, env_index: int) -> None:
        """Raise the error that explains why ``name()`` is not allowed now, if it is not."""
        self._life.require(wanted, name, env_index)

    # ----------------------------------------------------------------- batches

    def submit(self, batch: Batch) -> None:
        """Send the steps and resets of some of the worker's envs; ``finish()`` collects them.

        A step of an env whose episode an earlier death cut is not sent: it comes back as
        that death's truncation.
        """
        self.changes[0] += 1
        if self._life.state is not EnvState.READY:
            first = self.env_indices[batch.positions[0]] if len(batch.positions) else 0
            self.require(EnvState.READY, "step", first)
        if self._pending is not None:
            self._discard_pending()
        if self._recycler is not None:
            batch = self._recycler.before(batch)
        sent, sent_items, lost = self._cuts.split(batch)
        deadline = items_deadline(sent.is_reset, self._timeouts)
        self._pending = _Pending(batch, sent, sent_items, lost, None, deadline, time.perf_counter())
        if len(sent.positions):
            self.handle.submit_batch(sent)

    def submit_planned(self, plan: StepPlan, env_slice: slice) -> None:
        """Send this worker's part of a vector's planned step (its envs are ``env_slice``).

        Falls back to ``submit()`` of the same envs when the worker has anything unusual to
        sort out first (a call in flight, envs that lost their episode, not ready).
        """
        if not self.can_take_planned() or (self._recycler is not None and self._recycler.is_busy()):
            if plan.is_counted and self._shm_handle is not None:
                self._shm_handle.leave_round()  # its answer will not be counted
            self.submit(plan.batch(env_slice))
            return
        assert self._shm_handle is not None
        deadline = self.take_planned(plan, env_slice, time.perf_counter())
        self._shm_handle.submit_planned(plan, env_slice, deadline)

    def can_take_planned(self) -> bool:
        """Whether the worker's part of a planned step can go as is: ready, idle, nothing lost.

        Recycling is not asked here: a vector's data plane takes no worker that recycles.
        """
        return (
            self._life.state is EnvState.READY
            and self._pending is None
            and not self._cuts.has_lost()
            and self._shm_handle is not None
        )

    @property
    def is_recycling(self) -> bool:
        """Whether the worker has a recycle policy (consulted around every batch)."""
        return self._recycler is not None

    def note_success(self) -> None:
        """A planned step the vector's data plane collected came back clean."""
        self._ledger.note_success()

    def take_planned(self, plan: StepPlan, env_slice: slice, sent_at: float) -> float | None:
        """The worker's part of a planned step is in flight: ``finish()`` collects it.

        ``submit_planned`` sends it; a vector's data plane sent it itself and hands the step
        over here when something is not as usual. Returns its deadline.
        """
        self.changes[0] += 1
        deadline = planned_deadline(plan, env_slice, self._timeouts)
        if deadline is not None:  # counted from the send (``perf_counter``), not from now:
            deadline -= time.perf_counter() - sent_at  # a hand-over gives it no second budget
        pending = self._planned  # reused: this runs for every worker on every step
        pending.batch = pending.sent = None
        pending.plan, pending.plan_slice, pending.deadline = plan, env_slice, deadline
        pending.sent_at = sent_at
        self._pending = pending
        return deadline

    def finish(self) -> tuple[BatchResult | None, dict[int, Exception]]:
        """Collect the batch ``submit()`` sent: its result, and ``EnvError``s by item index.

        The result is ``DONE_OK_RESULT`` (None) for a clean planned step: everything is in the
        vector's shared memory, and the vector reads it (and counts it) for all envs at once.

        Raises:
            EnvCrashLoopError: The worker died and the restart budget is spent.
        """
        pending = self._pending
        if pending is not None and pending.plan is not None:
            assert pending.plan_slice is not None
            assert self._shm_handle is not None
            planned = self._shm_handle.collect_planned(pending.deadline)
            if planned is DONE_OK_RESULT:
                self._pending = None
                self._ledger.note_success()
                self.stats.note_latency(time.perf_counter() - pending.sent_at)
                return DONE_OK_RESULT, {}
            pending.batch = pending.sent = pending.plan.batch(pending.plan_slice)
            collected: BatchResult | Death = planned
        elif pending is None or pending.batch is None:
            raise EnvStateError(
                f"env {self.env_indices[0]}: no step or reset is in flight; send one first.",
                env_index=self.env_indices[0],
            )
        else:
            sent = pending.sent
            assert sent is not None
            collected = (
                self.handle.collect_batch(pending.deadline)
                if len(sent.positions)
                else BatchResult.empty(0)
            )
        batch = pending.batch
        assert batch is not None
        self._pending = None
        if isinstance(collected, Death):
            return self._recover_batch(batch, collected.cause)
        if pending.sent_items is None:
            result = collected
        else:
            result = _blank_result(self._shm_handle, len(batch.positions))
            result.merge(collected, pending.sent_items)
            for item, cause in pending.lost.items():
                self._cuts.truncate(result, batch, item, cause, self.stats.restarts)
        failed = [item for item, extra in result.extras.items() if extra.failure is not None]
        self._note(batch, result, time.perf_counter() - pending.sent_at, pending.lost, failed)
        if self._recycler is not None:
            self._recycler.after(batch, result)
        if not failed:
            self._ledger.note_success()
            return result, {}
        if self._restart_on_error:
            self.handle.kill()
            cause = f"error: {result.extras[failed[0]].failure.type_name}"  # type: ignore[union-attr]
            retried, retry_errors = self._recover_batch(batch.subset(failed), cause)
            result.merge(retried, failed)
            return result, retry_errors
        errors: dict[int, Exception] = {}
        for item in failed:
            failure = result.extras[item].failure
            assert failure is not None
            name = "reset" if batch.is_reset[item] else "step"
            errors[item] = self.env_error(failure, name, batch.positions[item])
        return result, errors

    def run(self, batch: Batch) -> tuple[BatchResult, dict[int, Exception]]:
        """``submit()`` then ``finish()``."""
        self.submit(batch)
        result, errors = self.finish()
        assert result is not None
        return result, errors

    def request(
        self, position: int, command: Command, payload: Any, steps: int = 0, resets: int = 0
    ) -> Any:
        """Run one call on one env; a death respawns the worker and replays the call once more.

        Raises:
            EnvError: The env raised.
            EnvCrashLoopError: The worker kept dying and the restart budget is spent.
        """
        self.send_request(position, command, payload, steps, resets)
        return self.finish_request()

    def send_request(
        self, position: int, command: Command, payload: Any, steps: int = 0, resets: int = 0
    ) -> None:
        """Send one call on one env; ``finish_request()`` waits for it.

        Args:
            position: The env's place in the worker.
            command: What to do.
            payload: The command's data.
            steps: Env steps the call makes (for ``STEP_PAIRS``): it may take that many
                ``step_timeout``s before the worker is killed. 0 and no ``resets``: no
                deadline. A replay after a death gets the same deadline.
            resets: Env resets the call makes: that many ``reset_timeout``s more.
        """
        self.changes[0] += 1
        env_index = self.env_indices[position]
        if self._life.state is not EnvState.READY:
            self.require(EnvState.READY, command.name.lower(), env_index)
        if self._pending is not None:
            self._discard_pending()
        request = Request(command, position, payload)
        if self._recycler is not None:
            self._recycler.forget_end_rngs()  # the call may draw from a generator
        deadline = batch_deadline(steps, resets, self._timeouts) if steps or resets else None
        now = time.perf_counter()
        self._pending = _Pending(
            None, None, None, {}, request, deadline, now, budget=(steps, resets)
        )
        self.handle.submit(request)

    def finish_request(self) -> Any:
        """Wait for the call ``send_request()`` sent; replay it on a fresh worker if it died."""
        pending = self._pending
        if pending is None or pending.request is None:
            raise EnvStateError(
                f"env {self.env_indices[0]}: no call is in flight; send one first.",
                env_index=self.env_indices[0],
            )
        request = pending.request
        position, command, payload = request.position, request.command, request.payload
        reply = self.handle.collect(pending.deadline)
        self._pending = None
        if isinstance(reply, Death):
            self._restart(reply.cause)
            return self.request(position, command, payload, *pending.budget)
        if reply.failure is not None:
            if self._restart_on_error:
                self.handle.kill()
                cause = f"error: {reply.failure.type_name}"
                self._restart(cause)
                return self.request(position, command, payload, *pending.budget)
            advice = call_advice(command)
            raise self.env_error(reply.failure, command.name.lower(), position, advice)
        self._ledger.note_success()
        if command is Command.SET_STATE:
            self._cuts.restored(position)
        return reply.value

    def read_obs(self, position: int) -> Any:
        """The observation the caller last saw for the env at ``position``."""
        return self._cuts.last_obs(position)

    # ----------------------------------------------------------------- internals

    def _note(
        self,
        batch: Batch,
        result: BatchResult,
        elapsed: float,
        lost: dict[int, str],
        failed: Sequence[int],
    ) -> None:
        """Count the batch, and keep the observations the caller saw (when not shared)."""
        self.stats.note_batch(batch, result, elapsed, failed)
        self._cuts.note_obs(batch, result, lost, failed)

    def _recover_batch(self, batch: Batch, cause: str) -> tuple[BatchResult, dict[int, Exception]]:
        """After a death during a batch: respawn, truncate its steps, replay its resets."""
        self._restart(cause)
        result = _blank_result(self._shm_handle, len(batch.positions))
        errors: dict[int, Exception] = {}
        resets = [item for item in range(len(batch.positions)) if batch.is_reset[item]]
        for item in range(len(batch.positions)):
            if not batch.is_reset[item]:
                self._cuts.truncate(result, batch, item, cause, self.stats.restarts)
        self._note(batch, result, 0.0, {}, [])
        if resets:
            replayed, replay_errors = self.run(batch.subset(resets))
            result.merge(replayed, resets)
            errors = {resets[item]: error for item, error in replay_errors.items()}
        return result, errors

    # ----------------------------------------------------------------- for the recycler

    @property
    def num_envs(self) -> int:
        """How many envs the worker hosts."""
        return len(self.env_indices)

    def has_lost_episodes(self) -> bool:
        """Whether a death cut an episode that the caller has not been told of yet."""
        return self._cuts.has_lost()

    def kill_for(self, cause: str) -> None:
        """Kill the worker now and respawn it: a death with this cause."""
        self.changes[0] += 1
        self.handle.kill()
        self._restart(cause)

    def replace_worker(self) -> None:
        """Retire the worker and hand over to a new one (the standby, when it is ready)."""
        self.changes[0] += 1
        self.handle.retire()
        self._life.spawn()
        self._life.become_ready()

    # ----------------------------------------------------------------- deaths

    def _restart(self, cause: str) -> None:
        """After a death: every env of the worker lost its episode; respawn the worker."""
        self.changes[0] += 1
        self._cuts.lose_all(cause)
        self._life.respawn(cause)

    def _discard_pending(self) -> None:
        pending = self._pending
        assert pending is not None
        logger.debug("env %d: discarding an interrupted call", self.env_indices[0])
        if pending.batch is not None or pending.plan is not None:
            self.finish()
            return
        reply = self.handle.collect(pending.deadline)
        self._pending = None
        if isinstance(reply, Death):
            self._restart(reply.cause)

    def envs_text(self) -> str:
        """``env 3`` or ``envs 3-5``: the worker's envs, for messages."""
        return self._life.envs_text()


def _blank_result(shm_handle: Any, size: int) -> BatchResult:
    """A result of ``size`` items to fill; observations too when there is no shared memory."""
    result = BatchResult.empty(size)
    if shm_handle is None or not shm_handle.is_linked:
        result.obs = [None] * size
    return result
