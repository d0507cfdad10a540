"""VECTOR API: fan a vector's calls out to its workers, by slices, and collect the replies.

A vector's envs are grouped by the worker hosting them (``WorkerGroup``). A call costs one
request and one reply per worker, however many envs it hosts. Workers are split into
slices; one task per slice sends to every worker of the slice, then collects every reply.
The first slice runs in the caller's thread (a thread hop costs tens of microseconds here).
Every outcome is gathered before any error is raised, so no call is left in flight.

``WorkerGroup`` is also the public internal interface that planning and evaluation use to
reach a vector's workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import gymnasium as gym
import numpy as np

from multienv.errors import EnvCrashedError, WaitTimeoutError
from multienv.supervision.handles import VectorLink
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.info_columns import contiguous_slice
from multienv.wire.protocol import Batch, BatchResult, StepPlan

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerGroup:
    """One worker's envs in a vector.

    Attributes:
        supervisor: The worker's supervisor.
        env_ids: The vector's indices of its envs here, ascending.
        positions: Their places in the worker.
        index: ``env_ids`` as a slice when contiguous, else an index array.
        position_array: ``positions`` as an index array.
        is_whole: All of the worker's envs are here, in position order.
        position_of: Each env's place in the worker, by env index.
    """

    supervisor: WorkerSupervisor
    env_ids: list[int]
    positions: list[int]
    index: Any = None
    position_array: Any = None
    is_whole: bool = False
    position_of: dict[int, int] = dataclasses.field(default_factory=dict)


def group_by_worker(
    supervisors: Sequence[WorkerSupervisor], positions: Sequence[int]
) -> list[WorkerGroup]:
    """The vector's workers, in order of their first env, with their envs in this vector.

    Args:
        supervisors: Each env's worker supervisor, by env index.
        positions: Each env's place in its worker, by env index.
    """
    groups: dict[int, WorkerGroup] = {}
    for env_index, (supervisor, position) in enumerate(zip(supervisors, positions, strict=True)):
        key = id(supervisor)
        if key not in groups:
            groups[key] = WorkerGroup(supervisor, [], [])
        groups[key].env_ids.append(env_index)
        groups[key].positions.append(position)
    for group in groups.values():
        group.position_array = np.asarray(group.positions, dtype=np.intp)
        group.position_of = dict(zip(group.env_ids, group.positions, strict=True))
        group.is_whole = group.positions == list(range(group.supervisor.num_envs))
        run = contiguous_slice(group.env_ids)
        group.index = run if run is not None else np.asarray(group.env_ids)
    return list(groups.values())


# What one worker's batch came back as: its result and errors by env index, or one error
# (e.g. EnvCrashLoopError) for all of its envs.
Collected = tuple[BatchResult | None, dict[int, BaseException]]
ByWorker = dict[int, Collected]  # each worker's, by worker number (not protocol's Outcome)
MakeBatch = Callable[[WorkerGroup], Batch | StepPlan | None]


def reset_batches(seeds: list[int | None], options: list[Any], mask: np.ndarray) -> MakeBatch:
    """How to make each worker's batch of a reset of the envs in ``mask`` (by env index)."""
    has_seeds = any(seed is not None for seed in seeds)
    has_options = any(item is not None for item in options)

    def make_batch(group: WorkerGroup) -> Batch | None:
        chosen = [k for k, env_index in enumerate(group.env_ids) if mask[env_index]]
        if not chosen:
            return None
        return Batch(
            [group.positions[k] for k in chosen],
            np.ones(len(chosen), dtype=np.bool_),
            [None] * len(chosen),
            False,
            [seeds[group.env_ids[k]] for k in chosen] if has_seeds else None,
            [options[group.env_ids[k]] for k in chosen] if has_options else None,
        )

    return make_batch


def step_batches(actions: Any, resets: np.ndarray, is_same_step: bool) -> MakeBatch:
    """How to make each worker's batch of a step of every env (arrays by env index)."""

    def make_batch(group: WorkerGroup) -> Batch:
        return Batch(
            group.position_array,
            resets[group.index],
            actions[group.index]
            if isinstance(actions, np.ndarray)
            else [actions[i] for i in group.env_ids],
            is_same_step,
            is_whole=group.is_whole,
        )

    return make_batch


def finish(group: WorkerGroup) -> Collected:
    """Collect one worker's batch: the result with its errors by env index, or one error."""
    try:
        result, errors = group.supervisor.finish()
    except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest env index first
        return None, dict.fromkeys(group.env_ids, exc)
    if not errors:  # the usual case, on every step of every worker
        return result, {}
    # By the env each error names: a batch of some of the worker's envs (send/recv) has
    # its items in another order than the group's envs.
    return result, {_env_of(group, item, error): error for item, error in errors.items()}


def _env_of(group: WorkerGroup, item: int, error: BaseException) -> int:
    """The vector's index of the env whose error this is (item ``item`` of its batch)."""
    env_index = getattr(error, "env_index", None)
    if isinstance(env_index, int) and env_index in group.position_of:
        return env_index
    return group.env_ids[item]


def submit(group: WorkerGroup, order: Batch | StepPlan | None) -> bool:
    """Send a worker its batch, or its part of a planned step; False if it has none."""
    if order is None:
        return False
    if isinstance(order, StepPlan):
        group.supervisor.submit_planned(order, group.index)
    else:
        group.supervisor.submit(order)
    return True


def run_slice(
    groups: Sequence[WorkerGroup], numbers: Sequence[int], make_batch: MakeBatch
) -> ByWorker:
    """Send every worker of the slice its batch, then collect every reply."""
    outcome: ByWorker = {}
    sent = []
    for number, group in zip(numbers, groups, strict=True):
        try:
            if submit(group, make_batch(group)):
                sent.append((number, group))
        except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest env index first
            outcome[number] = (None, dict.fromkeys(group.env_ids, exc))
    for number, group in sent:
        outcome[number] = finish(group)
    return outcome


def collect_slices(futures: list[Future[ByWorker]], timeout: float | None, name: str) -> ByWorker:
    """Wait for slices sent by ``step_async`` / ``reset_async``; on expiry they stay in flight.

    Raises:
        WaitTimeoutError: ``timeout`` passed first (both ``TimeoutError`` and
            ``multiprocessing.TimeoutError``, as AsyncVectorEnv raises).
    """
    _done, not_done = wait_futures(futures, timeout)
    if not_done:
        raise WaitTimeoutError(
            f"The call to `{name}_wait` has timed out after {timeout} second(s) with "
            f"{len(not_done)} of {len(futures)} slices still running; call {name}_wait() "
            "again, or close()."
        )
    outcome: ByWorker = {}
    for future in futures:
        outcome.update(future.result())
    return outcome


def raise_first(errors: dict[int, BaseException]) -> None:
    """Raise the lowest env index's error, after logging the others."""
    first, *others = sorted(errors)
    for env_index in others:  # its first line; a crash loop's was logged already
        if not isinstance(errors[env_index], EnvCrashedError):
            logger.error("env %d: failed too: %s", env_index, _first_line(errors[env_index]))
    raise errors[first]


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.split("\n", 1)[0] if text else type(error).__name__


@dataclasses.dataclass
class Failed:
    """A call on one env raised this (raised later, lowest env index first)."""

    error: BaseException


class FanOut:
    """The slices of a vector's workers and the thread pool that runs them.

    Args:
        groups: The vector's workers.
        num_threads: How many slices the workers are split into.
    """

    def __init__(self, groups: list[WorkerGroup], num_threads: int) -> None:
        """Split the workers into slices and start the pool (its threads start on demand)."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self.groups = groups
        self.link: VectorLink | None = None  # the backend's multi-wait, once the vector has it
        self.slices = [
            list(map(int, part))
            for part in np.array_split(np.arange(len(groups)), min(num_threads, len(groups)))
        ]
        self.executor = ThreadPoolExecutor(
            max_workers=len(self.slices), thread_name_prefix="multienv"
        )

    def link_workers(
        self, spaces: tuple[gym.Space[Any], gym.Space[Any]], shared_memory: bool | None
    ) -> VectorLink:
        """Number the workers' envs as the vector does, and link them with their backend.

        Args:
            spaces: The single-env observation and action spaces.
            shared_memory: The vector's ``shared_memory`` choice (see ``handles.OpenLink``).
        """
        env_indices = []
        for group in self.groups:
            indices = [-1] * group.supervisor.num_envs
            for env_index, position in zip(group.env_ids, group.positions, strict=True):
                indices[position] = env_index
                group.supervisor.env_indices[position] = env_index
            env_indices.append(indices)
        link = self.groups[0].supervisor.backend.open_link(
            [group.supervisor.handle for group in self.groups],
            spaces,
            env_indices,
            self.slices,
            shared_memory,
        )
        for group in self.groups:  # every worker's first message, then each one's acks
            group.supervisor.begin_link()
        joined = 0
        try:
            for group in self.groups:
                group.supervisor.join_link()
                joined += 1
        except BaseException:
            # The workers after the one that failed got their first message: finish their
            # links, or they would wait for fds and misread their owner's next call.
            for group in self.groups[joined + 1 :]:
                with contextlib.suppress(Exception):
                    group.supervisor.join_link()
            link.close()
            raise
        self.link = link
        return link

    def close_workers(self, close_env: Callable[[int], None]) -> None:
        """Close every worker's envs, workers in parallel (each close is time-bounded)."""

        def close_group(group: WorkerGroup) -> None:
            for env_index in group.env_ids:
                close_env(env_index)

        try:
            with ThreadPoolExecutor(
                max_workers=len(self.groups), thread_name_prefix="multienv-close"
            ) as pool:
                list(pool.map(close_group, self.groups))
        except RuntimeError:  # the interpreter is shutting down and starts no threads
            for group in self.groups:
                close_group(group)

    def run(self, make_batch: MakeBatch, numbers: Iterable[int] | None = None) -> ByWorker:
        """Send each worker its batch and collect it, by slices; the first runs inline."""
        groups = self.groups
        parts = self.slices
        if numbers is not None:
            wanted = set(numbers)
            parts = [[n for n in part if n in wanted] for part in parts]
            parts = [part for part in parts if part]
        futures = [
            self.executor.submit(run_slice, [groups[n] for n in part], part, make_batch)
            for part in parts[1:]
        ]
        merged = run_slice([groups[n] for n in parts[0]], parts[0], make_batch)
        if futures:
            wait_futures(futures)
            for future in futures:
                merged.update(future.result())
        return merged

    def submit_slices(self, make_batch: MakeBatch) -> list[Future[ByWorker]]:
        """Run every slice on the pool (``*_async``); ``collect_slices`` waits for them."""
        groups = self.groups
        return [
            self.executor.submit(run_slice, [groups[n] for n in part], part, make_batch)
            for part in self.slices
        ]

    def run_limited(self, make_batch: MakeBatch, max_concurrency: int) -> ByWorker:
        """Step every worker with at most ``max_concurrency`` envs in flight."""
        groups = self.groups
        queue = list(range(len(groups)))
        running: list[int] = []
        outcome: ByWorker = {}
        while queue or running:
            while queue and (
                not running
                or sum(len(groups[n].env_ids) for n in running) + len(groups[queue[0]].env_ids)
                <= max_concurrency
            ):
                number = queue.pop(0)
                group = groups[number]
                try:
                    submit(group, make_batch(group))
                    running.append(number)
                except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest first
                    outcome[number] = (None, dict.fromkeys(group.env_ids, exc))
            if not running:
                break
            ready = self.wait_any(running, None)
            for k in ready:
                outcome[running[k]] = finish(groups[running[k]])
            running = [n for k, n in enumerate(running) if k not in ready]
        return outcome

    def wait_any(self, numbers: Sequence[int], timeout: float | None) -> list[int]:
        """Wait until some of workers ``numbers`` can be collected; their places in it."""
        assert self.link is not None
        supervisors = [self.groups[n].supervisor for n in numbers]
        return self.link.wait_any(
            [s.handle for s in supervisors], [s.deadline for s in supervisors], timeout
        )

    def map(
        self, call: Callable[[int], Any], num_envs: int
    ) -> tuple[list[Any], dict[int, BaseException]]:
        """Run ``call(env_index)`` for every env, by slices; results and errors by env index."""

        def run(part: list[int]) -> dict[int, Any]:
            results: dict[int, Any] = {}
            for number in part:
                for env_index in self.groups[number].env_ids:
                    try:
                        results[env_index] = call(env_index)
                    except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest first
                        results[env_index] = Failed(exc)
            return results

        futures = [self.executor.submit(run, part) for part in self.slices[1:]]
        results = run(self.slices[0])
        wait_futures(futures)
        for future in futures:
            results.update(future.result())
        errors = {i: r.error for i, r in results.items() if isinstance(r, Failed)}
        return [results[i] for i in range(num_envs)], errors

    def shutdown(self) -> None:
        """Stop the pool's threads once their tasks are done."""
        self.executor.shutdown(wait=True)
