"""PARENT SIDE, backend-neutral: the handle Protocols, the worker supervisor and the env proxy.

A backend brings a ``WorkerHandle`` (the transport to one worker process or actor hosting k
envs: spawn, submit, collect, kill, stop) and a ``VectorLink`` (what a vector shares with
its workers: a multi-wait, and batched observations when they live in shared memory).
Everything else lives here, the same for every backend:

- ``WorkerSupervisor``, one per worker: the lifecycle (``EnvState``), the failure table of
  DESIGN.md and the ``RestartPolicy``. A worker is the unit that dies, so it is also the
  unit that respawns and spends the restart budget; each of its envs counts the restart.
- ``RemoteEnv``, one per env: a ``gymnasium.Env`` that addresses its env by its position in
  its worker, and keeps that env's stats.

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

import copy
import dataclasses
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector.utils import batch_space, create_empty_array, iterate

from multienv.errors import (
    EnvCrashedError,
    EnvCrashLoopError,
    EnvError,
    EnvStateError,
    env_error_class,
)
from multienv.log_limit import failure_log
from multienv.protocol import (
    PLANNED_OK,
    Batch,
    BatchResult,
    Command,
    EnvDescription,
    EnvSnapshot,
    Outcome,
    RemoteFailure,
    RemoteTraceback,
    Reply,
    Request,
    StepPlan,
)
from multienv.recycle import RecyclePolicy
from multienv.restart import RestartPolicy

logger = logging.getLogger(__name__)

_EARLY_EXIT_HINT = (
    "\nA worker that exits before multienv's worker code runs in it, for example while it "
    "imports your script, writes to this process's stderr instead: look above. If your "
    'script creates envs at its top level, move that under `if __name__ == "__main__":`.'
)


class EnvState(enum.Enum):
    """Lifecycle of one worker and its envs; legal moves are listed in _TRANSITIONS."""

    CREATED = "created"  # object exists, no process yet
    STARTED = "started"  # worker alive, envs not built yet
    READY = "ready"  # initialize() succeeded; reset/step/call allowed
    BROKEN = "broken"  # restart budget spent; calls raise EnvCrashLoopError
    CLOSED = "closed"  # terminal; calls raise ClosedEnvironmentError


_TRANSITIONS: dict[EnvState, set[EnvState]] = {
    EnvState.CREATED: {EnvState.STARTED, EnvState.CLOSED},
    # Any move back to STARTED is a respawn.
    EnvState.STARTED: {EnvState.STARTED, EnvState.READY, EnvState.BROKEN, EnvState.CLOSED},
    EnvState.READY: {EnvState.STARTED, EnvState.BROKEN, EnvState.CLOSED},
    EnvState.BROKEN: {EnvState.CLOSED},
    EnvState.CLOSED: set(),
}


@dataclasses.dataclass(frozen=True)
class Death:
    """The worker is gone (or was killed for a timeout); ``cause`` says how."""

    cause: str


class WorkerHandle(Protocol):
    """The transport to one worker hosting k envs; one call in flight at a time."""

    @property
    def pid(self) -> int | None:
        """Process id of the current worker (on its node); None before ``spawn()``."""

    def spawn(self) -> None:
        """Start a new worker, which starts building its envs; returns without waiting."""

    def handshake(self, deadline: float | None) -> Reply | Death:
        """Wait for the worker's envs: ``Reply(list[EnvDescription])`` or a failure, or death.

        A handle that shares memory with a vector attaches the new worker to it here too.
        """

    def submit(self, request: Request) -> None:
        """Send one call; a dead worker is noticed by ``collect``."""

    def collect(self, deadline: float | None) -> Reply | Death:
        """Wait for the call's reply, the worker's death or the deadline (then kill it)."""

    def submit_batch(self, batch: Batch) -> None:
        """Send the steps and resets of some of the worker's envs, as one request."""

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        """Wait for the batch's result (``obs`` None when in shared memory), or the death."""

    def submit_planned(self, plan: StepPlan, env_slice: slice) -> None:
        """Send this worker's part (its envs are ``env_slice`` of the vector) of a plan."""

    def collect_planned(self, deadline: float | None) -> BatchResult | Death | None:
        """Wait for this worker's part of a plan: None when everything is in shared memory."""

    @property
    def is_linked(self) -> bool:
        """Whether observations travel through a vector's shared memory."""

    def join_link(self, deadline: float | None) -> Death | None:
        """Give the current worker what its vector's link shares; None when done."""

    def read_obs(self, position: int) -> Any:
        """The observation the env at ``position`` is on, when it lives in shared memory."""

    def kill(self) -> None:
        """Kill the worker at once and reap it."""

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout_s``. Idempotent."""

    def prestart(self) -> None:
        """Start a standby worker, which the next ``spawn()`` takes over; idempotent."""

    def retire(self) -> None:
        """Ask the current worker to close its envs and exit, without waiting for it."""

    def rss_mb(self) -> float | None:
        """Resident memory of the current worker in MiB; None if it cannot be read."""

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines the current (or last) worker wrote to stderr."""

    def open_link(
        self,
        handles: Sequence[WorkerHandle],
        spaces: tuple[gym.Space[Any], gym.Space[Any]],
        env_indices: Sequence[Sequence[int]],
        worker_groups: Sequence[Sequence[int]],
        shared_memory: bool | None = None,
    ) -> VectorLink:
        """Link ``handles`` (this one among them) into one vector.

        Args:
            handles: The vector's handles, by worker index.
            spaces: The single-env observation and action spaces.
            env_indices: Per worker, the vector's index of each env, by position (-1: none).
            worker_groups: The workers each collecting thread of the vector serves.
            shared_memory: Batch observations in shared memory: None when the space
                allows, True (TypeError if it does not) or False. Backends without shared
                memory ignore it.
        """


class VectorLink(Protocol):
    """What a vector shares with its workers: a multi-wait, and maybe batched observations."""

    has_shared_obs: bool  # observations come from ``observations()``, not from outcomes

    def wait_any(
        self,
        handles: Sequence[WorkerHandle],
        deadlines: Sequence[float | None],
        timeout: float | None,
    ) -> list[int]:
        """Wait until some of ``handles`` can be collected without blocking.

        A handle counts as ready when its reply is in, its worker died, its deadline passed
        (collecting it then kills the worker) or it has nothing in flight. Returns their
        positions in ``handles``, ascending; empty if ``timeout`` passed first.
        """

    def observations(self, env_ids: Sequence[int] | None, copy: bool) -> Any:
        """The batched observations of ``env_ids`` (all envs when None)."""

    def plan_step(self, actions: Any, is_reset: np.ndarray, autoreset: bool) -> StepPlan | None:
        """Prepare a whole step for every env at once, or None if this link cannot."""

    def commit(self, plan: StepPlan, index: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Finish ``index`` of a plan whose workers all came back clean.

        Returns:
            Those envs' rewards, terminated and truncated flags: views that the next step
            overwrites, so read them at once.
        """

    def close(self) -> None:
        """Release what the link holds (shared memory, pipes)."""


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


def subset(batch: Batch, items: Sequence[int]) -> Batch:
    """The batch of only ``items`` of ``batch``."""
    return Batch(
        [batch.positions[item] for item in items],
        batch.is_reset[list(items)],
        [batch.actions[item] for item in items],
        batch.autoreset,
        None if batch.seeds is None else [batch.seeds[item] for item in items],
        None if batch.options is None else [batch.options[item] for item in items],
    )


def _empty_result(size: int) -> BatchResult:
    return BatchResult(
        np.zeros(size, dtype=np.float64),
        np.zeros(size, dtype=np.bool_),
        np.zeros(size, dtype=np.bool_),
        None,
        {},
    )


def _merge(into: BatchResult, part: BatchResult, items: Sequence[int]) -> None:
    """Write ``part``, the result of ``items`` of a batch, into the batch's result."""
    index = list(items)
    into.rewards[index] = part.rewards
    into.terminated[index] = part.terminated
    into.truncated[index] = part.truncated
    if into.obs is not None and part.obs is not None:
        for item, obs in zip(index, part.obs, strict=True):
            into.obs[item] = obs
    for item, extra in part.extras.items():
        into.extras[index[item]] = extra


class WorkerSupervisor:
    """Lifecycle, failure table and restart budget of one worker hosting k envs.

    Args:
        handle: The transport to the worker.
        env_indices: The index of each of the worker's envs, by position, for messages.
        restart_policy: How many respawns are allowed, and how fast; None for the default.
        step_timeout: Seconds one env's step may take; a batch of m steps gets m times that.
        reset_timeout: Seconds one env's reset may take; likewise per batch.
        init_timeout: Seconds the worker may take to build its envs.
        restart_on_error: Treat an exception raised by env code as a death.
        close_timeout_s: Seconds ``close()`` waits for the worker to exit before killing it.
        recycle: When to replace the worker by a fresh one at an episode boundary, and when
            to kill it for its memory; None never recycles.
    """

    def __init__(
        self,
        handle: WorkerHandle,
        env_indices: Sequence[int],
        *,
        restart_policy: RestartPolicy | None = None,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        init_timeout: float | None = 60.0,
        restart_on_error: bool = False,
        close_timeout_s: float = 5.0,
        recycle: RecyclePolicy | None = None,
    ) -> None:
        """Create the supervisor; no worker is started yet."""
        self.handle = handle
        self.env_indices = list(env_indices)
        self.proxies: list[RemoteEnv] = []  # by position, filled by the proxies themselves
        self.descriptions: list[EnvDescription] = []
        self._restart_policy = restart_policy if restart_policy is not None else RestartPolicy()
        self._step_timeout = step_timeout
        self._reset_timeout = reset_timeout
        self._init_timeout = init_timeout
        self._restart_on_error = restart_on_error
        self._close_timeout_s = close_timeout_s
        self._state = EnvState.CREATED
        self._init_deadline: float | None = None
        self._pending: _Pending | None = None
        self._planned = _Pending(None, None, None, {}, None, None, 0.0)  # see submit_planned
        self._lost: dict[int, str] = {}  # positions whose episode a death cut, not yet told
        self._last_obs: list[Any] = [None] * len(self.env_indices)  # when not in shared memory
        self._restart_times: list[float] = []
        self._consecutive_restarts = 0  # respawns since the last successful call
        self._deaths = 0  # over the worker's whole life, for the failure log
        self._broken_error: EnvCrashedError | None = None
        self._is_closing = threading.Event()
        self.steps = np.zeros(len(self.env_indices), dtype=np.int64)  # per position
        self.episodes = np.zeros(len(self.env_indices), dtype=np.int64)
        self.step_latencies_s: deque[float] = deque(maxlen=1000)  # of the worker's batches
        self._recycle = recycle
        self.recycles = 0  # workers replaced at a boundary (each of its envs counts them)
        self._recycle_reason: str | None = None  # the limit the worker has reached
        self._recycled: dict[int, str] = {}  # positions whose next reset a recycle started
        self._rngs: dict[int, Any] = {}  # their old envs' np_random, for those resets
        self._end_rngs: dict[int, Any] = {}  # np_random as the last step ended the episode
        self._is_holding_autoreset = False  # the batch in flight was sent without it
        self._born_at = (0, 0)  # the steps and episodes counted when the worker started
        self._rss_mb: float | None = None
        self._next_rss_check = 0.0
        self._has_standby = False  # a replacement was started for the current worker

    # ----------------------------------------------------------------- lifecycle

    @property
    def state(self) -> EnvState:
        """Where the worker is in its lifecycle."""
        return self._state

    @property
    def deadline(self) -> float | None:
        """The deadline of the call in flight, if any."""
        return None if self._pending is None else self._pending.deadline

    def start(self, name: str = "start") -> None:
        """Launch the worker, which starts building its envs; returns without waiting."""
        self.require(EnvState.CREATED, name, self.env_indices[0])
        self._spawn()

    def initialize(self) -> None:
        """Wait until the worker has built its envs (respawning it if it dies meanwhile).

        Raises:
            EnvError: An ``env_fn`` raised in the worker, which has exited.
            EnvCrashLoopError: The worker kept dying or timing out while building its envs.
        """
        self.require(EnvState.STARTED, "initialize", self.env_indices[0])
        cause = self._handshake()
        if cause is None:
            self._set_state(EnvState.READY)
        else:
            self._respawn(cause)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker; idempotent and bounded in time."""
        if self._state is EnvState.CLOSED:
            return
        self._is_closing.set()
        self.handle.stop(self._close_timeout_s if timeout is None else timeout)
        self._pending = None
        self._set_state(EnvState.CLOSED)
        failure_log.flush()  # the failures still counted, not yet told

    def join_link(self) -> None:
        """Give the worker what its vector's link shares (respawning it if it dies meanwhile)."""
        self._last_obs = [None] * len(self.env_indices)
        deadline = None if self._init_timeout is None else time.monotonic() + self._init_timeout
        death = self.handle.join_link(deadline)
        if death is not None:
            self._lose_all(death.cause)
            self._respawn(death.cause)

    def require(self, wanted: EnvState, name: str, env_index: int) -> None:
        """Raise the error that explains why ``name()`` is not allowed now, if it is not."""
        state = self._state
        if state is wanted:
            return
        if state is EnvState.CLOSED:
            raise ClosedEnvironmentError(
                f"env {env_index}: {name}() called after close(); create a new env."
            )
        if state is EnvState.BROKEN and self._broken_error is not None:
            raise copy.copy(self._broken_error)
        hints = {
            EnvState.CREATED: (
                "call start() and initialize() first, or use create_subprocess_envs()"
            ),
            EnvState.STARTED: "call initialize() first",
            EnvState.READY: f"{name}() may be called only once",
        }
        raise EnvStateError(
            f"env {env_index}: {name}() called in state {state.name}; {hints[state]}.",
            env_index=env_index,
        )

    # ----------------------------------------------------------------- batches

    def submit(self, batch: Batch) -> None:
        """Send the steps and resets of some of the worker's envs; ``finish()`` collects them.

        A step of an env whose episode an earlier death cut is not sent: it comes back as
        that death's truncation.
        """
        if self._state is not EnvState.READY:
            first = self.env_indices[batch.positions[0]] if len(batch.positions) else 0
            self.require(EnvState.READY, "step", first)
        if self._pending is not None:
            self._discard_pending()
        if self._recycle is not None:
            batch = self._recycle_before(batch)
        lost: dict[int, str] = {}
        sent, sent_items = batch, None
        if self._lost:
            for item, position in enumerate(batch.positions):
                if batch.is_reset[item]:
                    self._lost.pop(position, None)
                elif position in self._lost:
                    lost[item] = self._lost.pop(position)
            if lost:
                sent_items = [item for item in range(len(batch.positions)) if item not in lost]
                sent = subset(batch, sent_items)
        num_resets = int(np.count_nonzero(sent.is_reset))
        deadline = self._batch_deadline(len(sent.positions) - num_resets, num_resets)
        self._pending = _Pending(batch, sent, sent_items, lost, None, deadline, time.perf_counter())
        if len(sent.positions):
            self.handle.submit_batch(sent)

    def submit_planned(self, plan: StepPlan, env_slice: slice) -> None:
        """Send this worker's part of a vector's planned step (its envs are ``env_slice``).

        Falls back to ``submit()`` of the same envs when the worker has anything unusual to
        sort out first (a call in flight, envs that lost their episode, not ready).
        """
        if (
            self._state is not EnvState.READY
            or self._pending is not None
            or self._lost
            or (self._recycle is not None and (self._watch_recycle() or self._has_standby))
        ):
            self.submit(plan.batch(env_slice))
            return
        deadline = None
        if self._step_timeout is not None or self._reset_timeout is not None:
            num_resets = int(np.count_nonzero(plan.is_reset[env_slice]))
            num_steps = env_slice.stop - env_slice.start - num_resets
            deadline = self._batch_deadline(num_steps, num_resets)
        pending = self._planned  # reused: this runs for every worker on every step
        pending.batch = pending.sent = None
        pending.plan, pending.plan_slice, pending.deadline = plan, env_slice, deadline
        pending.sent_at = time.perf_counter()
        self._pending = pending
        self.handle.submit_planned(plan, env_slice)

    def finish(self) -> tuple[BatchResult | None, dict[int, Exception]]:
        """Collect the batch ``submit()`` sent: its result, and ``EnvError``s by item index.

        The result is ``PLANNED_OK`` (None) for a clean planned step: everything is in the
        vector's shared memory, and the vector reads it (and counts it) for all envs at once.

        Raises:
            EnvCrashLoopError: The worker died and the restart budget is spent.
        """
        pending = self._pending
        if pending is not None and pending.plan is not None:
            assert pending.plan_slice is not None
            planned = self.handle.collect_planned(pending.deadline)
            if planned is PLANNED_OK:
                self._pending = None
                self._consecutive_restarts = 0
                self.step_latencies_s.append(time.perf_counter() - pending.sent_at)
                return PLANNED_OK, {}
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
                else _empty_result(0)
            )
        batch = pending.batch
        assert batch is not None
        self._pending = None
        if isinstance(collected, Death):
            return self._recover_batch(batch, collected.cause)
        if pending.sent_items is None:
            result = collected
        else:
            result = self._blank_result(len(batch.positions))
            _merge(result, collected, pending.sent_items)
            for item, cause in pending.lost.items():
                self._truncate(result, batch, item, cause)
        self._note(batch, result, time.perf_counter() - pending.sent_at, pending.lost)
        if self._recycle is not None:
            self._recycle_after(batch, result)
        failed = [item for item, extra in result.extras.items() if extra.failure is not None]
        if not failed:
            self._consecutive_restarts = 0
            return result, {}
        if self._restart_on_error:
            self.handle.kill()
            cause = f"error: {result.extras[failed[0]].failure.type_name}"  # type: ignore[union-attr]
            retried, retry_errors = self._recover_batch(subset(batch, failed), cause)
            _merge(result, retried, failed)
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

    def request(self, position: int, command: Command, payload: Any, steps: int = 0) -> Any:
        """Run one call on one env; a death respawns the worker and replays the call once more.

        Raises:
            EnvError: The env raised.
            EnvCrashLoopError: The worker kept dying and the restart budget is spent.
        """
        self.send_request(position, command, payload, steps)
        return self.finish_request()

    def send_request(self, position: int, command: Command, payload: Any, steps: int = 0) -> None:
        """Send one call on one env; ``finish_request()`` waits for it.

        Args:
            position: The env's place in the worker.
            command: What to do.
            payload: The command's data.
            steps: Env steps the call makes (for ``STEP_PAIRS``): it may take that many
                ``step_timeout``s before the worker is killed. 0: no deadline.
        """
        env_index = self.env_indices[position]
        if self._state is not EnvState.READY:
            self.require(EnvState.READY, command.name.lower(), env_index)
        if self._pending is not None:
            self._discard_pending()
        request = Request(command, position, payload)
        self._end_rngs.clear()  # the call may draw from a generator
        deadline = self._batch_deadline(steps, 0) if steps else None
        self._pending = _Pending(None, None, None, {}, request, deadline, time.perf_counter())
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
            self._lose_all(reply.cause)
            self._respawn(reply.cause)
            return self.request(position, command, payload)
        if reply.failure is not None:
            if self._restart_on_error:
                self.handle.kill()
                cause = f"error: {reply.failure.type_name}"
                self._lose_all(cause)
                self._respawn(cause)
                return self.request(position, command, payload)
            raise self.env_error(reply.failure, command.name.lower(), position)
        self._consecutive_restarts = 0
        if command is Command.SET_STATE:
            self._lost.pop(position, None)  # restored: that env's episode goes on from here
        return reply.value

    def read_obs(self, position: int) -> Any:
        """The observation the caller last saw for the env at ``position``."""
        obs = self._last_obs[position]
        if obs is None:
            obs = self.handle.read_obs(position)
        if obs is None:  # nothing seen yet: zeros of the observation's shape
            space = self.descriptions[position].observation_space
            obs = next(iter(iterate(batch_space(space, 1), create_empty_array(space, 1))))
        return obs

    def env_error(
        self,
        failure: RemoteFailure,
        name: str,
        position: int | None,
        advice: str = "The worker is still alive.",
    ) -> EnvError:
        """The ``EnvError`` for a failure in the worker, with its traceback chained."""
        env_index = self.env_indices[position if position is not None else 0]
        remote = RemoteTraceback(failure.traceback)
        cause: BaseException = failure.exception if failure.exception is not None else remote
        if cause is not remote:
            cause.__cause__ = remote
        error_class = env_error_class(
            type(failure.exception) if failure.exception is not None else None
        )
        error = error_class(
            f"env {env_index}: worker (pid {self.handle.pid}) raised {failure.type_name} in "
            f"{name}(): {failure.message}; see the worker traceback above. {advice}",
            env_index=env_index,
        )
        error.__cause__ = cause
        return error

    # ----------------------------------------------------------------- internals

    def _batch_deadline(self, num_steps: int, num_resets: int) -> float | None:
        budget = 0.0
        for count, timeout in ((num_steps, self._step_timeout), (num_resets, self._reset_timeout)):
            if count:
                if timeout is None:
                    return None
                budget += count * timeout
        return time.monotonic() + budget if budget else None

    def _note(
        self, batch: Batch, result: BatchResult, elapsed: float, lost: dict[int, str]
    ) -> None:
        """Count steps and episodes, keep the latency and (unshared) observations."""
        failed = [item for item, extra in result.extras.items() if extra.failure is not None]
        if len(batch.positions) == 1:  # one env (send/recv at k=1): scalars are faster
            position = batch.positions[0]
            if not failed and not batch.is_reset[0]:
                self.steps[position] += 1
                if result.terminated[0] or result.truncated[0]:
                    self.episodes[position] += 1
                self.step_latencies_s.append(elapsed)
            if result.obs is not None and not failed and 0 not in lost:
                self._last_obs[position] = result.obs[0]
            return
        done = result.terminated | result.truncated
        if batch.is_whole and not failed and not np.count_nonzero(batch.is_reset):
            self.steps += 1  # the common case: every env of the worker stepped
            if np.count_nonzero(done):
                self.episodes[done] += 1
            self.step_latencies_s.append(elapsed)
        else:
            is_step = ~batch.is_reset
            is_step[failed] = False
            if np.count_nonzero(is_step):
                positions = np.asarray(batch.positions)  # distinct in a batch, so += counts
                self.steps[positions[is_step]] += 1
                self.episodes[positions[is_step & done]] += 1
                self.step_latencies_s.append(elapsed)
        if result.obs is not None:
            for item, position in enumerate(batch.positions):
                if item not in lost and item not in failed:
                    self._last_obs[position] = result.obs[item]

    def _blank_result(self, size: int) -> BatchResult:
        result = _empty_result(size)
        if not self.handle.is_linked:
            result.obs = [None] * size
        return result

    def _truncate(self, result: BatchResult, batch: Batch, item: int, cause: str) -> None:
        """Make ``item`` of ``result`` the flagged truncation a death gives a step."""
        position = batch.positions[item]
        proxy = self.proxies[position] if position < len(self.proxies) else None
        restarts = proxy.restarts if proxy is not None else 0
        result.rewards[item] = 0.0
        result.terminated[item] = False
        result.truncated[item] = True
        info = {"multienv": {"restarted": True, "cause": cause, "restarts": restarts}}
        result.extras[item] = Outcome(info=info)
        if result.obs is not None:
            result.obs[item] = self.read_obs(position)

    def _recover_batch(self, batch: Batch, cause: str) -> tuple[BatchResult, dict[int, Exception]]:
        """After a death during a batch: respawn, truncate its steps, replay its resets."""
        self._lose_all(cause)
        self._respawn(cause)
        result = self._blank_result(len(batch.positions))
        errors: dict[int, Exception] = {}
        resets = [item for item in range(len(batch.positions)) if batch.is_reset[item]]
        for item, position in enumerate(batch.positions):
            if not batch.is_reset[item]:
                self._lost.pop(position, None)
                self._truncate(result, batch, item, cause)
        self._note(batch, result, 0.0, {})
        if resets:
            replayed, replay_errors = self.run(subset(batch, resets))
            _merge(result, replayed, resets)
            errors = {resets[item]: error for item, error in replay_errors.items()}
        return result, errors

    # ----------------------------------------------------------------- recycling

    def _watch_recycle(self) -> bool:
        """Read the worker's memory when due and check its budgets; True if action is due.

        Runs before every step of a recycling worker, so it avoids NumPy where it can.
        """
        policy = self._recycle
        assert policy is not None
        if self._recycle_reason is not None:
            return True
        if policy.reads_memory:
            now = time.monotonic()
            if now >= self._next_rss_check:
                self._next_rss_check = now + policy.check_every_s
                self._rss_mb = self.handle.rss_mb()
            if policy.is_over_hard_cap(self._rss_mb):
                return True
        if len(self.env_indices) == 1:
            steps, episodes = int(self.steps[0]), int(self.episodes[0])
        else:
            steps, episodes = int(self.steps.sum()), int(self.episodes.sum())
        steps -= self._born_at[0]
        episodes -= self._born_at[1]
        self._recycle_reason = policy.reason(steps, episodes, self._rss_mb)
        if not self._has_standby and (
            self._recycle_reason is not None or policy.is_near(steps, episodes, self._rss_mb)
        ):
            self.handle.prestart()
            self._has_standby = True
        return self._recycle_reason is not None

    def _recycle_before(self, batch: Batch) -> Batch:
        """Before a batch: kill for memory, or swap at a boundary; return the batch to send."""
        policy = self._recycle
        assert policy is not None
        self._is_holding_autoreset = False  # a death may have left it set
        if not self._watch_recycle():
            if self._rngs:
                batch = self._with_rngs(batch)
            return self._keeping_rngs(batch) if self._has_standby else batch
        if policy.is_over_hard_cap(self._rss_mb):
            logger.warning(
                "%s: worker pid %s holds %.0f MiB, over hard_rss_mb=%g; killing it",
                self._envs_text(),
                self.handle.pid,
                self._rss_mb,
                policy.hard_rss_mb,
            )
            self.handle.kill()
            self._lose_all("rss")
            self._respawn("rss")
            return batch
        reason = self._recycle_reason
        assert reason is not None
        is_boundary = len(batch.positions) == len(self.env_indices) and bool(np.all(batch.is_reset))
        if is_boundary and not self._lost:
            self._swap(reason)
            return self._with_rngs(batch)
        if batch.autoreset:  # same-step: let episodes end unreset, so the swap can follow
            self._is_holding_autoreset = True
            batch = dataclasses.replace(batch, autoreset=False)
        return self._keeping_rngs(batch)

    def _keeping_rngs(self, batch: Batch) -> Batch:
        """The batch, asking each env whose episode it ends for its ``np_random``.

        Sent while a replacement waits, so that a swap at the boundary takes the generators
        from the step that ended the episodes instead of fetching them in a round trip. A
        same-step autoreset would draw from the generator first, so those batches do not ask.
        """
        for position in batch.positions:
            self._end_rngs.pop(position, None)  # the env runs again: its generator moves on
        if batch.autoreset:
            return batch
        return dataclasses.replace(batch, keep_np_randoms=True)

    def _with_rngs(self, batch: Batch) -> Batch:
        """The batch, its resets carrying the np_random of the envs a recycle replaced."""
        rngs = [
            self._rngs.pop(position, None) if batch.is_reset[item] else None
            for item, position in enumerate(batch.positions)
        ]
        if not any(rng is not None for rng in rngs):
            return batch
        return dataclasses.replace(batch, np_randoms=rngs)

    def _recycle_after(self, batch: Batch, result: BatchResult) -> None:
        """After a batch: flag the resets a recycle started; hand held same-step resets back."""
        if batch.keep_np_randoms:
            for item, extra in result.extras.items():
                if extra.np_random is not None:
                    self._end_rngs[batch.positions[item]] = extra.np_random
        if self._is_holding_autoreset:
            # Sent without same-step autoreset: the vector resets each ended episode (as
            # after a crash); when every env of the worker ended, the swap comes first.
            self._is_holding_autoreset = False
            done = result.terminated | result.truncated
            failed = [item for item, extra in result.extras.items() if extra.failure is not None]
            for item in np.flatnonzero(done).tolist():
                extra = result.extras.setdefault(item, Outcome())
                if extra.failure is None:
                    extra.reset = None
            reason = self._recycle_reason
            if (
                reason is not None
                and len(batch.positions) == len(self.env_indices)
                and bool(np.all(done))
                and not failed
                and not self._lost
            ):
                self._swap(reason)
            return
        if not self._recycled:
            return
        for item, position in enumerate(batch.positions):
            if batch.is_reset[item] and position in self._recycled:
                reason = self._recycled.pop(position)
                extra = result.extras.setdefault(item, Outcome())
                extra.info = {**extra.info, "multienv": {"recycled": True, "reason": reason}}

    def _swap(self, reason: str) -> None:
        """Replace the worker by its (pre-started) successor; every env is at a boundary."""
        began = time.perf_counter()
        old_pid = self.handle.pid
        kept, self._end_rngs = self._end_rngs, {}
        rngs = [
            kept[position] if position in kept else self._get_rng(position)
            for position in range(len(self.env_indices))
        ]
        self.handle.retire()
        self._spawn()
        cause = self._handshake()
        if cause is None:
            self._set_state(EnvState.READY)
        else:
            self._respawn(cause)
        self._rngs = {position: rng for position, rng in enumerate(rngs) if rng is not None}
        self.recycles += 1
        for proxy in self.proxies:
            proxy.recycles += 1
        self._recycled = dict.fromkeys(range(len(self.env_indices)), reason)
        logger.info(
            "%s: recycled worker pid %s (%s) for pid %s in %.1f ms",
            self._envs_text(),
            old_pid,
            reason,
            self.handle.pid,
            1e3 * (time.perf_counter() - began),
        )

    def _get_rng(self, position: int) -> Any:
        """The env's ``np_random``, so its next episodes draw as the old env's would."""
        try:
            return self.request(position, Command.GET_ATTR, "np_random")
        except EnvError:  # no np_random (an old-API env, say): the fresh env keeps its own
            return None

    def _lose_all(self, cause: str) -> None:
        """Every env of the worker lost its episode; each is told on its next step."""
        for position in range(len(self.env_indices)):
            self._lost[position] = cause

    def _discard_pending(self) -> None:
        pending = self._pending
        logger.debug("env %d: discarding an interrupted call", self.env_indices[0])
        if pending is None:
            return
        if pending.batch is not None or pending.plan is not None:
            self.finish()
            return
        reply = self.handle.collect(pending.deadline)
        self._pending = None
        if isinstance(reply, Death):
            self._lose_all(reply.cause)
            self._respawn(reply.cause)

    def _spawn(self) -> None:
        self.handle.spawn()
        self._born_at = (int(self.steps.sum()), int(self.episodes.sum()))
        self._recycle_reason = None
        self._rss_mb = None
        self._next_rss_check = 0.0
        self._has_standby = False
        self._end_rngs.clear()
        self._init_deadline = (
            None if self._init_timeout is None else time.monotonic() + self._init_timeout
        )
        self._set_state(EnvState.STARTED)

    def _handshake(self) -> str | None:
        """Wait for the worker's envs; return a cause of death, or None when ready."""
        reply = self.handle.handshake(self._init_deadline)
        if isinstance(reply, Death):
            return reply.cause
        if reply.failure is not None:
            if self._restart_on_error:
                return f"error: {reply.failure.type_name}"
            raise self.env_error(
                reply.failure,
                "initialize",
                reply.failure.position,
                "The worker has exited; initialize() again tries env_fn in a new worker.",
            )
        self.descriptions = reply.value
        return None

    def _respawn(self, cause: str) -> None:
        """Replace a dead worker, under the restart budget, until one is ready."""
        while True:
            if self._is_closing.is_set():  # a worker seen dying as close() stops it
                raise ClosedEnvironmentError(f"{self._envs_text()}: closed during a respawn.")
            self._bury(cause)
            self._spawn()
            next_cause = self._handshake()
            if next_cause is None:
                self._set_state(EnvState.READY)
                return
            cause = next_cause

    def _bury(self, cause: str) -> None:
        """Reap the dead worker, then wait out the backoff or raise if the budget is spent."""
        pid = self.handle.pid
        self.handle.kill()
        for proxy in self.proxies:
            proxy.last_failure = cause
        now = time.monotonic()
        policy = self._restart_policy
        delay = policy.next_delay(self._restart_times, now, self._consecutive_restarts)
        if delay is None:
            self._become_broken(pid, cause)
        self._restart_times = [*policy.recent(self._restart_times, now), now]
        self._consecutive_restarts += 1
        self._deaths += 1
        for proxy in self.proxies:
            proxy.restarts += 1
        what = "timed out and was killed" if cause == "timeout" else f"died ({cause})"
        failure_log.report(
            env_index=self.env_indices[0],
            failure_number=self._deaths,
            cause=cause,
            message=f"{self._envs_text()}: worker pid {pid} {what}; respawning "
            f"({len(self._restart_times)}/{policy.max_restarts} in {policy.window_s:g} s)",
            is_repeat_failure=self._consecutive_restarts > 1,
        )
        if delay and self._is_closing.wait(delay):
            raise ClosedEnvironmentError(f"{self._envs_text()}: closed during a respawn.")

    def _become_broken(self, pid: int | None, cause: str) -> None:
        tail = self.handle.stderr_tail()
        policy = self._restart_policy
        stderr_text = "\n".join(tail) if tail else "(nothing)"
        if not tail and cause.startswith("exit code"):
            stderr_text += _EARLY_EXIT_HINT
        env_index = self.env_indices[0]
        hosted = "" if len(self.env_indices) == 1 else f" hosting {self._envs_text()}"
        error: EnvCrashedError
        if policy.is_never:
            error = EnvCrashedError(
                f"env {env_index}: worker (pid {pid}){hosted} died ({cause}) and "
                "RestartPolicy.never() is set; its last stderr lines follow. Fix the crash or "
                f"allow restarts.\n{stderr_text}",
                env_index=env_index,
            )
        else:
            deaths = len(policy.recent(self._restart_times, time.monotonic())) + 1
            error = EnvCrashLoopError(
                f"env {env_index}: worker{hosted} died {deaths} times in {policy.window_s:g} s "
                f"(RestartPolicy max_restarts={policy.max_restarts}, "
                f"window_s={policy.window_s:g}); "
                f"last cause {cause}; its last stderr lines follow. Fix the crash or loosen "
                f"the policy.\n{stderr_text}",
                env_index=env_index,
                restarts=deaths,
                cause=cause,
                stderr_tail=tail,
            )
            logger.error("%s", error)
        self._broken_error = error
        self._set_state(EnvState.BROKEN)
        raise error

    def _envs_text(self) -> str:
        first, last = self.env_indices[0], self.env_indices[-1]
        return f"env {first}" if len(self.env_indices) == 1 else f"envs {first}-{last}"

    def _set_state(self, new: EnvState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise EnvStateError(
                f"{self._envs_text()}: illegal state move {self._state.name} -> {new.name}",
                env_index=self.env_indices[0],
            )
        logger.debug("%s: %s -> %s", self._envs_text(), self._state.name, new.name)
        self._state = new


class RemoteEnv(gym.Env[Any, Any]):
    """A ``gymnasium.Env`` whose env is the one at ``position`` in a supervised worker.

    Backends subclass it (``SubprocessEnv``); see the module docstring for what happens when
    the worker dies, hangs or raises.

    Args:
        supervisor: The worker hosting the env.
        position: The env's place in its worker.
    """

    def __init__(self, supervisor: WorkerSupervisor, position: int) -> None:
        """Register with the supervisor; the env is described once it is initialized."""
        self._supervisor = supervisor
        self.position = position
        self.env_index = supervisor.env_indices[position]
        self._is_closed = False
        self._sent: str | None = None  # "step" or "reset": what send_*() sent, for recv_*()
        self.restarts = 0
        self.recycles = 0  # times its worker was replaced at an episode boundary
        self.last_failure: str | None = None
        while len(supervisor.proxies) <= position:
            supervisor.proxies.append(self)
        supervisor.proxies[position] = self

    @property
    def supervisor(self) -> WorkerSupervisor:
        """The supervisor of the worker hosting this env."""
        return self._supervisor

    @property
    def steps(self) -> int:
        """Steps this env has returned (crash truncations included)."""
        return int(self._supervisor.steps[self.position])

    @property
    def episodes(self) -> int:
        """Episodes of this env that ended (terminated or truncated)."""
        return int(self._supervisor.episodes[self.position])

    @property
    def step_latencies_s(self) -> deque[float]:
        """Recent round-trip times of the steps of this env's worker, in seconds."""
        return self._supervisor.step_latencies_s

    @property
    def pid(self) -> int | None:
        """Process id of the worker hosting this env; None before ``start()``."""
        return self._supervisor.handle.pid

    @property
    def state(self) -> EnvState:
        """Where this env is in its lifecycle (its worker's, until it is closed)."""
        return EnvState.CLOSED if self._is_closed else self._supervisor.state

    def start(self) -> None:
        """Launch the worker, which starts building the env; returns without waiting."""
        self._check_open("start")
        self._supervisor.start()

    def initialize(self) -> None:
        """Wait until the worker has built the env, then cache spaces, metadata and spec.

        Raises:
            EnvError: ``env_fn`` raised in the worker.
            EnvCrashLoopError: The worker kept dying or timing out while building the env.
        """
        self._check_open("initialize")
        if self._supervisor.state is not EnvState.READY:
            self._supervisor.initialize()
        self.describe()

    def describe(self) -> None:
        """Cache the spaces, metadata, render mode and spec of the initialized env."""
        description = self._supervisor.descriptions[self.position]
        self.observation_space = description.observation_space
        self.action_space = description.action_space
        self.metadata = description.metadata
        self.render_mode = description.render_mode
        self.spec = description.spec

    def close(self, timeout: float | None = None) -> None:
        """Close this env; its worker stops once all of its envs are closed. Idempotent.

        Args:
            timeout: Seconds to wait for the worker's clean exit before it is killed.
        """
        if self._is_closed:
            return
        self._is_closed = True
        if all(proxy._is_closed for proxy in self._supervisor.proxies):
            self._supervisor.close(timeout)

    def __del__(self) -> None:
        """Close the env if the proxy was fully constructed."""
        if "_is_closed" in self.__dict__:
            self.close(timeout=1.0)

    # ----------------------------------------------------------------- env API

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the remote env; replayed on a fresh worker if the worker dies."""
        self.send_reset(seed=seed, options=options)
        obs, info = self.recv_reset()
        return self._supervisor.read_obs(self.position) if obs is None else obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Step the remote env; a worker death comes back as a flagged truncation."""
        self.send_step(action)
        obs, reward, terminated, truncated, info = self.recv_step()
        if obs is None:
            obs = self._supervisor.read_obs(self.position)
        return obs, reward, terminated, truncated, info

    def get_state(self) -> EnvSnapshot:
        """A snapshot of the remote env: its own ``get_state()``, or the whole env pickled."""
        snapshot: EnvSnapshot = self._request(Command.GET_STATE, None)
        return snapshot

    def set_state(self, snapshot: EnvSnapshot) -> None:
        """Restore a snapshot of ``get_state()`` (replayed on a fresh worker if it dies)."""
        if not isinstance(snapshot, EnvSnapshot):
            raise TypeError(
                f"env {self.env_index}: set_state() takes an EnvSnapshot from get_state(), "
                f"got {type(snapshot).__name__}"
            )
        env_type = self._supervisor.descriptions[self.position].env_type
        if snapshot.env_type != env_type:
            raise ValueError(
                f"env {self.env_index}: the state is of a {snapshot.env_type} env; this env is "
                f"a {env_type}"
            )
        self._request(Command.SET_STATE, snapshot)

    def render(self) -> Any:
        """Return the remote env's ``render()`` result."""
        return self._request(Command.RENDER, None)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the remote env's method ``name`` (or return the attribute, if not callable)."""
        return self._request(Command.CALL, (name, args, kwargs))

    def get_attr(self, name: str) -> Any:
        """Return the remote env's attribute ``name`` (searched through its wrappers)."""
        return self._request(Command.GET_ATTR, name)

    def set_attr(self, name: str, value: Any) -> None:
        """Set the remote env's attribute ``name`` (on the wrapper that has it)."""
        self._request(Command.SET_ATTR, (name, value))

    def is_wrapped(self, wrapper_class: type) -> bool:
        """Whether the remote env's wrapper stack has a ``wrapper_class``, checked in the worker."""
        return bool(self._request(Command.IS_WRAPPED, wrapper_class))

    # ------------------------------------------- split-phase calls, for single-env users

    def send_reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Send a reset without waiting; ``recv_reset()`` collects it."""
        batch = Batch([self.position], _TRUE, [None], False, [seed], [options])
        self._send(batch, "reset")

    def recv_reset(self) -> tuple[Any, dict[str, Any]]:
        """Wait for the reset; obs is None when it is in shared memory."""
        result = self._recv("reset")
        extra = result.extras.get(0)
        return None if result.obs is None else result.obs[0], {} if extra is None else extra.info

    def send_step(self, action: Any) -> None:
        """Send a step without waiting; ``recv_step()`` collects it."""
        self._send(Batch([self.position], _FALSE, [action]), "step")

    def recv_step(self) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Wait for the step; obs is None when it is in shared memory."""
        result = self._recv("step")
        extra = result.extras.get(0)
        return (
            None if result.obs is None else result.obs[0],
            float(result.rewards[0]),
            bool(result.terminated[0]),
            bool(result.truncated[0]),
            {} if extra is None else extra.info,
        )

    # ----------------------------------------------------------------- internals

    def _check_open(self, name: str) -> None:
        if self._is_closed:
            raise ClosedEnvironmentError(
                f"env {self.env_index}: {name}() called after close(); create a new env."
            )

    def _send(self, batch: Batch, kind: str) -> None:
        self._check_open(kind)
        supervisor = self._supervisor
        if supervisor.state is not EnvState.READY:
            supervisor.require(EnvState.READY, kind, self.env_index)
        self._sent = None
        supervisor.submit(batch)
        self._sent = kind

    def _recv(self, kind: str) -> BatchResult:
        self._check_open(f"recv_{kind}")
        sent, self._sent = self._sent, None
        if sent != kind:
            raise EnvStateError(
                f"env {self.env_index}: no {kind} is in flight; call send_{kind}() first.",
                env_index=self.env_index,
            )
        result, errors = self._supervisor.finish()
        if errors:
            raise errors[0]
        assert result is not None  # a single env's batch is never a planned step
        return result

    def _request(self, command: Command, payload: Any) -> Any:
        self._check_open(command.name.lower())
        return self._supervisor.request(self.position, command, payload)


_TRUE = np.ones(1, dtype=np.bool_)
_FALSE = np.zeros(1, dtype=np.bool_)
