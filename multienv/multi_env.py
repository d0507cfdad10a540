"""VECTOR API: MultiEnv, a ``gymnasium.vector.VectorEnv`` over env proxies, run in parallel.

``MultiEnv`` knows its envs only through the backend-neutral seam of ``multienv.proxy``:
each worker's ``WorkerSupervisor`` takes one ``Batch`` (the steps and resets of its envs)
and returns one ``BatchResult``; the backend's ``VectorLink`` waits on many workers at once
and serves batched observations when they live in shared memory. Pipes, pids and signals
stay in the backend. A step costs one request and one reply per worker, however many envs
it hosts, and calls fan out by slices of workers: one task per slice sends to every worker
of the slice, then collects every reply (the first slice runs in the caller's thread).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import (
    batch_differing_spaces,
    batch_space,
    concatenate,
    create_empty_array,
    iterate,
)

from multienv import planning
from multienv.autoreset import Autoreset
from multienv.errors import (
    EnvError,
    EnvStateError,
    NoPendingCallError,
    PendingCallError,
    SpaceMismatchError,
    WaitTimeoutError,
)
from multienv.protocol import Batch, BatchResult, EnvSnapshot, StepPlan
from multienv.proxy import EnvState, RemoteEnv, VectorLink, WorkerSupervisor

logger = logging.getLogger(__name__)

# Where each backend's ``create_*_envs(env_fns, envs_per_worker=..., **options)`` lives;
# imported only when used, so MultiEnv imports no transport.
_BACKENDS = {
    "subprocess": "multienv.subprocess_env:create_subprocess_envs",
    "ray": "multienv.ray_env:create_ray_envs",
}

_ARRAY_ACTION_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)


@dataclasses.dataclass
class _Worker:
    """One worker's envs in this vector."""

    supervisor: WorkerSupervisor
    env_ids: list[int]  # vector indices, ascending
    positions: list[int]  # their places in the worker
    index: Any  # env_ids as a slice when contiguous, else an index array
    position_array: Any = None  # positions as an index array
    is_whole: bool = False  # all of the worker's envs are here, in position order
    position_of: dict[int, int] = dataclasses.field(default_factory=dict)  # by env index


# What one worker's batch came back as: its result and errors by env index, or one error
# (e.g. EnvCrashLoopError) for all of its envs.
_Collected = tuple[BatchResult | None, dict[int, BaseException]]
_SliceOutcome = dict[int, _Collected]  # by worker number


class MultiEnv(VectorEnv[Any, Any, Any]):
    """A Gymnasium vector env whose sub-envs run in worker processes and survive crashes.

    Example:
        >>> import gymnasium as gym
        >>> from multienv import MultiEnv
        >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 4, envs_per_worker=2) as envs:
        ...     obs, infos = envs.reset(seed=0)
        ...     obs, rewards, terminations, truncations, infos = envs.step(
        ...         envs.action_space.sample())
        ...     obs.shape
        (4, 4)

    Args:
        envs: Ready env proxies (e.g. from ``create_subprocess_envs``), or env factories, in
            which case MultiEnv builds subprocess proxies with ``**options``.
        autoreset_mode: Gymnasium autoreset mode: next-step (default), same-step or disabled.
        copy: Return a copy of the batched observations (as Gymnasium does) rather than the
            internal buffer that the next call overwrites.
        num_threads: How many slices the workers are split into for fan-out; the first
            slice runs in the caller's thread. Defaults to 1: with observations in shared
            memory the parent only writes and reads a few bytes per worker, which one
            thread does faster than several (``python scripts/bench.py`` measures it).
        max_concurrency: At most this many envs step at once in ``step()``/``step_async()``
            (a worker's envs start together); the next worker starts as soon as one
            finishes. None (default) steps all at once. Use it when N workers would
            oversubscribe the cores.
        envs_per_worker: With env factories, how many envs each worker process hosts (env i
            in worker ``i // envs_per_worker``); see ``create_subprocess_envs``.
        backend: With env factories, where the workers run: ``"subprocess"`` (daemon
            processes on this machine) or ``"ray"`` (Ray actors, on a cluster; needs
            ``multienv[ray]``, see ``create_ray_envs``).
        shared_memory: As ``AsyncVectorEnv`` takes it. None (default): observations of
            fixed-shape spaces travel through shared memory, others pickled; True: the same,
            but a space of dynamic shape raises TypeError, as AsyncVectorEnv does; False:
            always pickled. The Ray backend has no shared memory and ignores it.
        context: The multiprocessing start method (``"forkserver"``, ``"spawn"``,
            ``"fork"``) or context; see ``resolve_context``.
        daemon: As ``AsyncVectorEnv`` takes it: False starts the worker processes as
            non-daemons, so env code may start processes of its own (they still exit with
            this process). The Ray backend ignores it.
        worker: Accepted so that ``AsyncVectorEnv``'s arguments pass, but only None: a
            multienv worker is not a function to replace (it is an ``EnvRunner`` under a
            supervisor that respawns it), so any other value raises ValueError.
        observation_mode: ``"same"`` (default): every env has the same observation space.
            ``"different"``: spaces may differ within what Gymnasium can batch
            (``batch_differing_spaces``); observations are then pickled. A tuple
            ``(batched_space, single_space)`` sets the spaces outright.
        **options: ``SubprocessEnv`` or ``RayEnv`` options (``ray_options=RayOptions(...)``
            for Ray), used only when ``envs`` are factories.
    """

    def __init__(
        self,
        envs: Iterable[RemoteEnv | Callable[[], gym.Env[Any, Any]]],
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        num_threads: int | None = None,
        max_concurrency: int | None = None,
        envs_per_worker: int = 1,
        backend: str = "subprocess",
        shared_memory: bool | None = None,
        daemon: bool = True,
        worker: Callable[..., Any] | None = None,
        observation_mode: str | tuple[gym.Space[Any], gym.Space[Any]] = "same",
        **options: Any,
    ) -> None:
        """Build or adopt the envs, check that their spaces match, and batch the spaces."""
        if worker is not None:
            raise ValueError(
                "MultiEnv(worker=...): multienv's workers are not a function to replace (each "
                "runs an EnvRunner under a supervisor that respawns it); wrap the env instead."
            )
        if not isinstance(observation_mode, tuple) and observation_mode not in (
            "same",
            "different",
        ):
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
                f"and batch observation space, actual got {observation_mode}"
            )
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.copy = copy
        self.shared_memory = shared_memory
        self.daemon = daemon
        self.observation_mode = observation_mode
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency!r}.")
        self.max_concurrency = max_concurrency
        items = list(envs)
        if not items:
            raise ValueError("MultiEnv needs at least one env or env factory, got none.")
        is_proxy = [isinstance(item, gym.Env) for item in items]
        if all(is_proxy):
            if options or envs_per_worker != 1:
                given = sorted([*options, *(["envs_per_worker"] if envs_per_worker != 1 else [])])
                raise TypeError(
                    f"MultiEnv got ready envs and options {given!r}; options apply "
                    "only when MultiEnv builds the envs from factories."
                )
            proxies: list[Any] = items
            _check_ready(proxies)
        elif not any(is_proxy):
            if not daemon and backend == "subprocess":
                options["daemon"] = False
            proxies = _create_envs(backend, items, envs_per_worker=envs_per_worker, **options)
        else:
            first = is_proxy.index(not is_proxy[0])
            raise TypeError(
                f"env {first}: MultiEnv takes either all ready envs or all env factories, "
                "not a mix."
            )
        try:
            self._adopt(proxies, num_threads)
        except BaseException:
            if not any(is_proxy):
                for proxy in proxies:
                    proxy.close()
            raise

    def _adopt(self, proxies: list[RemoteEnv], num_threads: int | None) -> None:
        first = proxies[0]
        mode = self.observation_mode
        for env_index, proxy in enumerate(proxies):
            space = proxy.observation_space
            if mode == "same" and space != first.observation_space:
                raise SpaceMismatchError(
                    f"env {env_index}: observation_space {space!r} differs from env 0's "
                    f"{first.observation_space!r}: the sub-environments observation spaces are "
                    "not equivalent. MultiEnv(..., observation_mode='same') needs them equal. If "
                    "this is intentional, use `observation_mode='different'` instead.",
                    env_index=env_index,
                )
            if proxy.action_space != first.action_space:
                raise SpaceMismatchError(
                    f"env {env_index}: action_space {proxy.action_space!r} differs from env 0's "
                    f"{first.action_space!r}; all envs of a MultiEnv must have the same action "
                    "space.",
                    env_index=env_index,
                )
            single = mode[1] if isinstance(mode, tuple) else first.observation_space
            if mode != "same" and not _same_shape(space, single):
                given = "'different'" if mode == "different" else "custom space"
                raise SpaceMismatchError(
                    f"MultiEnv(..., observation_mode={given}) however env {env_index}'s "
                    f"observation space {space!r} does not share a common shape and dtype "
                    f"with {single!r}.",
                    env_index=env_index,
                )
        self.envs: list[Any] = proxies
        self.num_envs = len(proxies)
        self.metadata = dict(first.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first.render_mode
        self.spec = first.spec
        self.single_observation_space = first.observation_space
        self.single_action_space = first.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        shared_memory = self.shared_memory
        if isinstance(mode, tuple):
            self.observation_space, self.single_observation_space = mode
        elif mode == "different":
            spaces = [proxy.observation_space for proxy in proxies]
            self.observation_space = batch_differing_spaces(spaces)
            if any(space != spaces[0] for space in spaces):
                shared_memory = False  # one slot layout cannot hold them all

        self._workers = _group_by_worker(proxies)
        self._worker_of = [0] * self.num_envs
        for number, worker in enumerate(self._workers):
            for env_index in worker.env_ids:
                self._worker_of[env_index] = number
        self._autoreset = Autoreset(self.autoreset_mode, self.num_envs)
        self._env_obs: list[Any] = [None] * self.num_envs
        self._observations: Any = create_empty_array(
            self.single_observation_space, n=self.num_envs, fn=np.zeros
        )
        self._rewards = np.zeros(self.num_envs, dtype=np.float64)
        self._terminations = np.zeros(self.num_envs, dtype=np.bool_)
        self._truncations = np.zeros(self.num_envs, dtype=np.bool_)
        threads = num_threads or 1
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self._slices = [
            list(map(int, part))
            for part in np.array_split(
                np.arange(len(self._workers)), min(threads, len(self._workers))
            )
        ]
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._slices), thread_name_prefix="multienv"
        )
        self._pending: list[Future[_SliceOutcome]] | None = None  # step_async()
        self._pending_reset: tuple[list[Future[_SliceOutcome]], np.ndarray] | None = None
        self._plan: StepPlan | None = None  # the planned step in flight, if it is one
        self._flying: dict[int, list[int]] = {}  # workers sent a batch by send(): its envs
        self._received: dict[int, tuple[Any, ...]] = {}  # envs collected, not yet returned
        supervisors = [worker.supervisor for worker in self._workers]
        env_indices = []
        for worker in self._workers:
            indices = [-1] * len(worker.supervisor.env_indices)
            for env_index, position in zip(worker.env_ids, worker.positions, strict=True):
                indices[position] = env_index
                worker.supervisor.env_indices[position] = env_index
                proxies[env_index].env_index = env_index
            env_indices.append(indices)
        self._link: VectorLink = supervisors[0].handle.open_link(
            [supervisor.handle for supervisor in supervisors],
            (self.single_observation_space, self.single_action_space),
            env_indices,
            self._slices,
            shared_memory,
        )
        try:
            for supervisor in supervisors:
                supervisor.join_link()
        except BaseException:
            self._link.close()
            raise
        # Planned steps (one vector op for all envs) need each worker's envs as one slice,
        # in position order; the workers' step counters then become views of these.
        self._can_plan = all(
            worker.is_whole and isinstance(worker.index, slice) for worker in self._workers
        )
        self._steps = np.zeros(self.num_envs, dtype=np.int64)
        self._episodes = np.zeros(self.num_envs, dtype=np.int64)
        if self._can_plan:
            for worker in self._workers:
                supervisor, index = worker.supervisor, worker.index
                self._steps[index], self._episodes[index] = supervisor.steps, supervisor.episodes
                supervisor.steps, supervisor.episodes = self._steps[index], self._episodes[index]

    # ----------------------------------------------------------------- vector API

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all envs, or those in ``options["reset_mask"]``.

        Args:
            seed: None, an int (env i gets ``seed + i``) or one seed per env.
            options: A dict passed to every env's ``reset``, in which ``"reset_mask"`` (a
                bool array of shape ``(num_envs,)``) selects the envs to reset; or a list
                of N dicts (or None), env i getting ``options[i]`` (the env-manager
                ``reset_param`` idea), which resets every env.
        """
        self._check_idle("reset")
        make_batch, mask = self._prepare_reset(seed, options)
        return self._finish_reset(
            self._gather(self._fan_out(range(len(self._workers)), make_batch)), mask
        )

    def reset_async(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """Send a reset to the envs and return at once; ``reset_wait()`` collects it.

        The arguments are those of ``reset``; bad ones raise here, before anything is sent.
        """
        self._check_idle("reset_async")
        make_batch, mask = self._prepare_reset(seed, options)
        self._pending_reset = (self._submit_slices(make_batch), mask)

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the reset sent by ``reset_async()``.

        Args:
            timeout: Seconds to wait; on expiry ``multiprocessing.TimeoutError`` is raised (as
                AsyncVectorEnv does) and the reset stays in flight: call ``reset_wait()``
                again.

        Raises:
            gymnasium.error.NoAsyncCallError: No ``reset_async()`` is pending.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.reset_wait() called after close().")
        if self._pending_reset is None:
            raise NoPendingCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.", "reset"
            )
        futures, mask = self._pending_reset
        outcome = _collect_slices(futures, timeout, "reset")
        self._pending_reset = None
        return self._finish_reset(outcome, mask)

    def _prepare_reset(
        self, seed: Any, options: Any
    ) -> tuple[Callable[[_Worker], Batch | None], np.ndarray]:
        """Check a reset's arguments; the batch of each worker, and the mask of envs reset."""
        seeds = self._seeds(seed)
        per_env = self._options_per_env(options)
        mask = self._reset_mask(per_env.pop() if per_env else None)
        has_seeds = any(s is not None for s in seeds)
        has_options = any(item is not None for item in per_env)

        def make_batch(worker: _Worker) -> Batch | None:
            chosen = [k for k, env_index in enumerate(worker.env_ids) if mask[env_index]]
            if not chosen:
                return None
            return Batch(
                [worker.positions[k] for k in chosen],
                np.ones(len(chosen), dtype=np.bool_),
                [None] * len(chosen),
                False,
                [seeds[worker.env_ids[k]] for k in chosen] if has_seeds else None,
                [per_env[worker.env_ids[k]] for k in chosen] if has_options else None,
            )

        return make_batch, mask

    def _finish_reset(self, outcome: _SliceOutcome, mask: np.ndarray) -> tuple[Any, dict[str, Any]]:
        """The reset's batched observations and infos; raises the lowest env's error, if any."""
        infos: dict[str, Any] = {}
        errors: dict[int, BaseException] = {}
        for number, worker in enumerate(self._workers):
            if number not in outcome:
                continue
            result, worker_errors = outcome[number]
            errors.update(worker_errors)
            if result is None:
                continue
            ids = [env_index for env_index in worker.env_ids if mask[env_index]]
            self._autoreset.after_reset([i for i in ids if i not in worker_errors])
            for item, env_index in enumerate(ids):
                if env_index in worker_errors:
                    continue
                if result.obs is not None:
                    self._env_obs[env_index] = result.obs[item]
                extra = result.extras.get(item)
                if extra is not None and extra.info:
                    infos = self._add_info(infos, extra.info, env_index)
        if errors:
            self._raise_first(errors)
        return self._batched_obs(), infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every env with its action; see the module docstring of ``autoreset``."""
        make_batch = self._prepare_step(actions)
        if self._is_limited():
            return self._finish_step(self._step_limited(make_batch))
        return self._finish_step(self._gather(self._fan_out(range(len(self._workers)), make_batch)))

    def step_async(self, actions: Any) -> None:
        """Send a step to every env and return at once; ``step_wait()`` collects it."""
        make_batch = self._prepare_step(actions, "step_async")
        if self._is_limited():
            self._pending = [self._executor.submit(self._step_limited, make_batch)]
            return
        self._pending = self._submit_slices(make_batch)

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Wait for the step sent by ``step_async()``.

        Args:
            timeout: Seconds to wait; on expiry ``TimeoutError`` is raised and the step stays
                in flight, so ``step_wait()`` may be called again.
        """
        if self._pending is None:
            raise NoPendingCallError(
                "Calling `step_wait` without any prior call to `step_async`.", "step"
            )
        outcome = _collect_slices(self._pending, timeout, "step")
        self._pending = None
        return self._finish_step(outcome)

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Send a step to some envs and return at once; ``recv()`` collects the first to finish.

        EnvPool-style asynchronous stepping: keep some envs stepping while you learn from
        the others, so a slow env does not hold back the batch. The envs of one worker
        travel together: an env cannot be sent while its worker steps others.

        Example:
            >>> import gymnasium as gym, numpy as np
            >>> from multienv import MultiEnv
            >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 4) as envs:
            ...     _ = envs.reset(seed=0)
            ...     envs.send(np.zeros(4, dtype=np.int64))
            ...     obs, rewards, terminations, truncations, infos = envs.recv(batch_size=2)
            ...     envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
            ...     _ = envs.recv()  # the other two, then these two (all that are in flight)
            ...     obs.shape, len(infos["env_id"])
            ((2, 4), 2)

        Args:
            actions: One action per env of ``env_ids``, in that order.
            env_ids: The envs to step (distinct, none already in flight); default all.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.send() called after close().")
        if self._pending is not None:
            raise EnvStateError("MultiEnv.send() called while a step_async() is pending.")
        ids = self._env_ids(env_ids)
        batch_actions = self._split_actions(actions, ids)
        self._autoreset.check_can_step(ids)
        by_worker: dict[int, list[int]] = {}
        for position, env_index in enumerate(ids):
            by_worker.setdefault(self._worker_of[env_index], []).append(position)
        for number, where in by_worker.items():
            if number in self._flying:
                env_index = ids[where[0]]
                raise EnvStateError(
                    f"env {env_index}: its worker is stepping envs {self._flying[number]}; "
                    "recv() them before sending it.",
                    env_index=env_index,
                )
        for number, where in sorted(by_worker.items()):
            worker = self._workers[number]
            env_list = [ids[p] for p in where]
            positions = [worker.position_of[env_index] for env_index in env_list]
            batch = Batch(
                positions,
                self._autoreset.resets(env_list),
                _take(batch_actions, where),
                self._autoreset.is_same_step,
            )
            worker.supervisor.submit(batch)
            self._flying[number] = env_list

    def recv(
        self, batch_size: int | None = None, timeout: float | None = None
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Collect the steps of the first ``batch_size`` envs to finish among those in flight.

        Args:
            batch_size: How many envs to return; default all that are in flight.
            timeout: Seconds to wait; on expiry ``TimeoutError`` is raised and every step
                stays in flight, so nothing is lost.

        Returns:
            ``(obs, rewards, terminations, truncations, infos)`` for ``batch_size`` envs in
            ascending env order; ``infos["env_id"]`` holds their indices.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.recv() called after close().")
        in_flight = len(self._received) + sum(len(ids) for ids in self._flying.values())
        if not in_flight:
            raise EnvStateError("MultiEnv.recv() called with no env in flight; call send() first.")
        size = in_flight if batch_size is None else batch_size
        if not 1 <= size <= in_flight:
            raise ValueError(
                f"recv(batch_size={batch_size!r}) with {in_flight} envs in flight; pass a "
                f"batch_size from 1 to {in_flight}, or None for all."
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._received) < size:
            flying = sorted(self._flying)
            supervisors = [self._workers[n].supervisor for n in flying]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = self._link.wait_any(
                [s.handle for s in supervisors], [s.deadline for s in supervisors], left
            )
            if not ready:
                raise WaitTimeoutError(
                    f"recv() timed out after {timeout} s with {len(self._received)} of the "
                    f"{size} envs ready; every step is still in flight, call recv() again."
                )
            collected = {}
            for k in ready:
                number = flying[k]
                collected[number] = _finish(self._workers[number])
            errors = self._receive(collected)
            if errors:
                self._raise_first(errors)
        ids = sorted(list(self._received)[:size])
        rows = [self._received.pop(env_index) for env_index in ids]
        infos: dict[str, Any] = {}
        partial = _PartialInfos(size)
        for position, row in enumerate(rows):
            if row[3]:
                infos = partial._add_info(infos, row[3], position)  # type: ignore[misc]
        infos["env_id"] = np.asarray(ids, dtype=np.int64)
        observations: Any
        if self._link.has_shared_obs:
            observations = self._link.observations(ids, copy=True)
        else:
            observations = create_empty_array(self.single_observation_space, n=size, fn=np.zeros)
            observations = concatenate(
                self.single_observation_space, [self._env_obs[i] for i in ids], observations
            )
        return (
            observations,
            np.array([row[0] for row in rows], dtype=np.float64),
            np.array([row[1] for row in rows], dtype=np.bool_),
            np.array([row[2] for row in rows], dtype=np.bool_),
            infos,
        )

    def render(self) -> tuple[Any, ...]:
        """Return every env's ``render()`` result."""
        return self._map(lambda i: self.envs[i].render())

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` on every env (or read the attribute, if not callable)."""
        return self._map(lambda i: self.envs[i].call(name, *args, **kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Return attribute ``name`` of every env."""
        return self._map(lambda i: self.envs[i].get_attr(name))

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` on every env: one value for all, or a list with one per env."""
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"set_attr({name!r}) got {len(values)} values for {self.num_envs} envs; pass "
                "one value per env, or a single value for all."
            )
        self._map(lambda i: self.envs[i].set_attr(name, values[i]))

    @property  # a tuple, as AsyncVectorEnv reports it
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """Each env's ``np_random_seed``, as Gymnasium's vector envs report them."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]  # a tuple, as AsyncVectorEnv reports it
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """Each env's ``np_random`` generator (copies, from the workers)."""
        return self.get_attr("np_random")

    # ----------------------------------------------------------------- planning

    def get_states(self) -> list[EnvSnapshot]:
        """Each env's state: opaque, picklable ``EnvSnapshot``s for ``set_states``.

        An env with ``get_state()`` / ``set_state(state)`` methods (the planning convention)
        is asked for its state; any other env is pickled whole, wrapper stack included (time
        limit counters, RNG), so restoring it and stepping it again gives the same results.
        """
        return list(self._map(lambda i: self.envs[i].get_state()))

    def set_states(self, states: Sequence[EnvSnapshot]) -> None:
        """Restore one state per env; each goes on mid-episode from there.

        A worker that dies meanwhile is respawned and the state restored into the fresh env.
        The observations the vector holds are not updated (a state carries none); the next
        ``step`` returns those of the restored envs.

        Raises:
            TypeError, ValueError: ``states`` is not one state per env of the env's class;
                raised before anything is sent.
        """
        checked = planning.check_set_states(self, states)
        self._map(lambda i: self.envs[i].set_state(checked[i]))
        self._autoreset.after_reset(np.arange(self.num_envs))

    def sync_states(self, state: EnvSnapshot) -> None:
        """Restore the same state into every env (see ``set_states``)."""
        self.set_states([state] * self.num_envs)

    def step_batch(
        self, actions: Any, states: Sequence[EnvSnapshot] | None = None, dt: Any = 1
    ) -> tuple[list[EnvSnapshot], Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        """Step M (state, action) pairs in parallel, M independent of N.

        Pair j restores ``states[j]`` into some env, repeats ``actions[j]`` up to ``dt[j]``
        times (stopping early at the episode's end), sums the rewards and returns the state
        reached. Each worker gets a contiguous share of the pairs, in proportion to its envs,
        in one round trip. A worker that dies is respawned and its share replayed from the
        pairs' states, so the results are those of an undisturbed run; their infos carry
        ``"multienv": {"restarted": True, "replayed": True, ...}``. Afterwards each env holds
        the state of the last pair it ran; ``set_states`` or ``reset`` before ``step``.

        Args:
            actions: M actions (an array with a leading axis of M for array action spaces).
            states: M states from ``get_states`` or an earlier ``step_batch``; None steps
                the envs from their current states (then M must equal N).
            dt: Steps per pair: an int, or M ints, each >= 1.

        Returns:
            ``(new_states, obs, rewards, terminated, truncated, infos)``: a list of M states,
            batched observations, float64 summed rewards and bool flags of the last step,
            each of length M, and a list of M info dicts (the last step's).

        Raises:
            ValueError, TypeError: Actions, states and ``dt`` do not agree in length or kind,
                or a state is of another env class; raised before anything is sent.
            EnvError: An env raised; the lowest pair's error, naming its env.
        """
        self._check_idle("step_batch")
        if states is None:
            count = len(actions)
            if count != self.num_envs:
                raise ValueError(
                    f"step_batch() without states steps every env from its current state: "
                    f"pass {self.num_envs} actions, got {count}."
                )
            states = self.get_states()
        return planning.step_batch(self, actions, states, dt)

    def workers_for_planning(self) -> list[_Worker]:
        """The vector's workers, with their envs' positions (for ``multienv.planning``)."""
        return self._workers

    def stats(self) -> list[dict[str, Any]]:
        """Per env: steps, episodes, restarts, recycles, last failure cause, latency p50/p99 (s).

        The latency is the round trip of the step's batch to the env's worker.
        """
        rows = []
        for proxy in self.envs:
            latencies = np.asarray(proxy.step_latencies_s, dtype=np.float64)
            p50, p99 = np.percentile(latencies, [50, 99]) if latencies.size else (np.nan, np.nan)
            rows.append(
                {
                    "env_index": proxy.env_index,
                    "steps": proxy.steps,
                    "episodes": proxy.episodes,
                    "restarts": proxy.restarts,
                    "recycles": proxy.recycles,
                    "last_failure": proxy.last_failure,
                    "step_latency_p50_s": float(p50),
                    "step_latency_p99_s": float(p99),
                }
            )
        return rows

    def close_extras(self, timeout: float | None = None, **kwargs: Any) -> None:
        """Close every worker in parallel, each bounded by ``timeout`` seconds.

        ``terminate`` and other keywords of ``AsyncVectorEnv.close`` are accepted; the
        workers are always stopped within ``timeout`` (then killed).
        """
        if "_link" not in self.__dict__:
            return
        for pending, state in ((self._pending, "step"), (self._pending_reset, "reset")):
            if pending is not None:
                warnings.warn(
                    f"Calling `close` while waiting for a pending call to `{state}` to complete.",
                    UserWarning,
                    stacklevel=3,
                )

        def close_worker(worker: _Worker) -> None:
            for env_index in worker.env_ids:
                self.envs[env_index].close(timeout=timeout)

        try:
            with ThreadPoolExecutor(
                max_workers=len(self._workers), thread_name_prefix="multienv-close"
            ) as pool:
                list(pool.map(close_worker, self._workers))
        except RuntimeError:  # the interpreter is shutting down and starts no threads
            for worker in self._workers:
                close_worker(worker)
        self._link.close()
        if self._pending is not None:
            wait_futures(self._pending, timeout=5.0)  # the workers are gone, so they end now
            self._pending = None
        if self._pending_reset is not None:
            wait_futures(self._pending_reset[0], timeout=5.0)
            self._pending_reset = None
        self._executor.shutdown(wait=True)

    def __enter__(self) -> MultiEnv:
        """Return self; the envs are closed on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the envs."""
        self.close()

    def __del__(self) -> None:
        """Close the envs if the object was fully constructed."""
        if "_link" in self.__dict__ and not self.closed:
            self.close(timeout=1.0)

    # ----------------------------------------------------------------- internals

    def _check_idle(self, name: str) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"MultiEnv.{name}() called after close().")
        for pending, state in ((self._pending, "step"), (self._pending_reset, "reset")):
            if pending is not None:
                raise PendingCallError(
                    f"Calling `{name}` while waiting for a pending call to `{state}` to complete "
                    f"(call {state}_wait() first).",
                    state,
                )
        if self._flying or self._received:
            flying = sorted([*self._received, *(i for ids in self._flying.values() for i in ids)])
            raise EnvStateError(
                f"MultiEnv.{name}() called while envs {flying} are in flight "
                "after send(); call recv() until none is left."
            )

    def _env_ids(self, env_ids: Sequence[int] | np.ndarray | None) -> list[int]:
        if env_ids is None:
            ids = list(range(self.num_envs))
        else:
            ids = [int(i) for i in np.asarray(env_ids).reshape(-1)]
        if not ids:
            raise ValueError("send() got no env_ids; pass at least one.")
        seen: set[int] = set()
        flying = {i for ids_ in self._flying.values() for i in ids_} | set(self._received)
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env {i}: no such env; env_ids must be in [0, {self.num_envs}).")
            if i in seen:
                raise ValueError(f"env {i}: appears twice in env_ids; pass each env once.")
            if i in flying:
                raise EnvStateError(
                    f"env {i}: already in flight; recv() it before sending it again.",
                    env_index=i,
                )
            seen.add(i)
        return ids

    def _receive(self, collected: _SliceOutcome) -> dict[int, BaseException]:
        """File collected workers' envs under ``_received``, in the order they came in."""
        errors: dict[int, BaseException] = {}
        for number, (result, worker_errors) in collected.items():
            ids = self._flying.pop(number)
            errors.update(worker_errors)
            if result is None:
                continue
            self._autoreset.after_step(ids, result.terminated, result.truncated)
            for item, env_index in enumerate(ids):
                if env_index in worker_errors:
                    continue
                if result.obs is not None:
                    self._env_obs[env_index] = result.obs[item]
                info: dict[str, Any] = {}
                terminated, truncated = bool(result.terminated[item]), bool(result.truncated[item])
                extra = result.extras.get(item)
                if extra is not None:
                    info, must_reset = self._autoreset.step_info(extra, terminated or truncated)
                    if must_reset:
                        info = self._reset_after_crash(env_index, info)
                reward = float(result.rewards[item])
                self._received[env_index] = (reward, terminated, truncated, info)
        return errors

    def _raise_first(self, errors: dict[int, BaseException]) -> None:
        first, *others = sorted(errors)
        for env_index in others:
            logger.error("env %d: failed too: %s", env_index, errors[env_index])
        raise errors[first]

    def _is_limited(self) -> bool:
        return self.max_concurrency is not None and self.max_concurrency < self.num_envs

    def _step_limited(
        self, make_batch: Callable[[_Worker], Batch | StepPlan | None]
    ) -> _SliceOutcome:
        """Step every worker with at most ``max_concurrency`` envs in flight."""
        assert self.max_concurrency is not None
        queue = list(range(len(self._workers)))
        running: list[int] = []
        outcome: _SliceOutcome = {}
        while queue or running:
            while queue and (
                not running
                or sum(len(self._workers[n].env_ids) for n in running)
                + len(self._workers[queue[0]].env_ids)
                <= self.max_concurrency
            ):
                number = queue.pop(0)
                worker = self._workers[number]
                try:
                    _submit(worker, make_batch(worker))
                    running.append(number)
                except Exception as exc:  # noqa: BLE001 - raised by _gather, lowest index first
                    outcome[number] = (None, dict.fromkeys(worker.env_ids, exc))
            if not running:
                break
            supervisors = [self._workers[n].supervisor for n in running]
            ready = self._link.wait_any(
                [s.handle for s in supervisors], [s.deadline for s in supervisors], None
            )
            for k in ready:
                outcome[running[k]] = _finish(self._workers[running[k]])
            running = [n for k, n in enumerate(running) if k not in ready]
        return outcome

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        """One seed per env (Python ints: numpy integers are converted), checked."""
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int | np.integer):
            return [int(seed) + i for i in range(self.num_envs)]
        if isinstance(seed, str | bytes) or not isinstance(seed, Sequence | np.ndarray):
            raise TypeError(
                f"reset() seed must be None, an int or one seed per env, got {type(seed).__name__}."
            )
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(
                f"reset() got {len(seeds)} seeds for {self.num_envs} envs; pass one seed per "
                "env, a single int, or None."
            )
        for env_index, item in enumerate(seeds):
            if item is not None and not isinstance(item, int | np.integer):
                raise TypeError(
                    f"env {env_index}: reset() seed must be an int or None, got "
                    f"{type(item).__name__}."
                )
        return [None if item is None else int(item) for item in seeds]

    def _options_per_env(self, options: Any) -> list[Any]:
        """Each env's reset options, then the reset mask last (None: every env)."""
        n = self.num_envs
        if options is None:
            return [None] * n + [None]
        if isinstance(options, dict):
            shared = dict(options)
            mask = shared.pop("reset_mask", None)
            return [shared or None] * n + [mask]
        if isinstance(options, str | bytes) or not isinstance(options, Sequence):
            raise TypeError(
                f"reset() options must be a dict or a list of {n} dicts (one per env), got "
                f"{type(options).__name__}."
            )
        per_env = list(options)
        if len(per_env) != n:
            raise ValueError(
                f"reset() got options for {len(per_env)} envs, but there are {n}; pass one "
                f"dict (or None) per env, or one dict for all."
            )
        for env_index, item in enumerate(per_env):
            if item is not None and not isinstance(item, dict):
                raise TypeError(
                    f"env {env_index}: reset() options must be a dict or None, got "
                    f"{type(item).__name__}."
                )
            if item is not None and "reset_mask" in item:
                raise ValueError(
                    f"env {env_index}: reset_mask goes in one options dict for all envs, not "
                    "in a per-env list."
                )
        return [*per_env, None]

    def _reset_mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_envs, dtype=np.bool_)
        if not isinstance(mask, np.ndarray):
            raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
        if mask.dtype != np.bool_:
            raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
        if mask.shape != (self.num_envs,):
            raise ValueError(
                f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {mask.shape}."
            )
        if not mask.any():
            raise ValueError(
                "`options['reset_mask']` must contain a boolean array with at least one True "
                f"value, got reset_mask={mask}"
            )
        return mask

    def _prepare_step(
        self, actions: Any, name: str = "step"
    ) -> Callable[[_Worker], Batch | StepPlan | None]:
        """Check the actions and the envs; return how to make each worker's batch."""
        self._check_idle(name)
        batch_actions = self._split_actions(actions, None)
        autoreset = self._autoreset
        autoreset.check_can_step(slice(None))
        resets = autoreset.resets(slice(None))
        is_same_step = autoreset.is_same_step

        if self._can_plan and isinstance(batch_actions, np.ndarray):
            plan = self._link.plan_step(batch_actions, resets, is_same_step)
            if plan is not None:
                self._plan = plan
                return lambda worker: plan

        def make_batch(worker: _Worker) -> Batch:
            return Batch(
                worker.position_array,
                resets[worker.index],
                batch_actions[worker.index]
                if isinstance(batch_actions, np.ndarray)
                else _take(batch_actions, worker.env_ids),
                is_same_step,
                is_whole=worker.is_whole,
            )

        return make_batch

    def _split_actions(self, actions: Any, env_ids: list[int] | None) -> Any:
        """The actions as one array (array spaces) or list, checked; errors name the env."""
        ids = list(range(self.num_envs)) if env_ids is None else env_ids
        n, space = len(ids), self.single_action_space
        if not isinstance(space, _ARRAY_ACTION_SPACES):
            batch_space_n = self.action_space if n == self.num_envs else batch_space(space, n)
            try:
                per_env = list(iterate(batch_space_n, actions))
            except Exception as exc:  # whatever iterate makes of a bad batch
                raise TypeError(
                    f"expected a batch of {n} actions in {batch_space_n!r}; iterating it "
                    f"raised {type(exc).__name__}: {exc}"
                ) from exc
            if len(per_env) != n:
                raise ValueError(f"expected {n} actions (one per env), got {len(per_env)}.")
            return per_env
        if isinstance(actions, np.ndarray) and actions.shape == (n, *(space.shape or ())):
            batch = actions  # the usual case; the checks below only name what is wrong
        else:
            self._check_action_shapes(actions, ids)
            batch = np.asarray(actions)
        if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete) and not (
            np.issubdtype(batch.dtype, np.integer)
        ):
            raise ValueError(f"expected integer actions for {space!r}, got dtype {batch.dtype}.")
        return batch

    def _check_action_shapes(self, actions: Any, env_ids: list[int]) -> None:
        n, space = len(env_ids), self.single_action_space
        try:
            count = len(actions)
        except TypeError:
            raise TypeError(
                f"expected a batch of {n} actions (one per env), got a {type(actions).__name__}."
            ) from None
        if count != n:
            raise ValueError(
                f"expected {n} actions (one per env, batch shape {(n, *(space.shape or ()))}), "
                f"got {count}."
            )
        for position, env_index in enumerate(env_ids):
            shape = np.shape(actions[position])
            if shape != space.shape:
                raise ValueError(
                    f"env {env_index}: action has shape {shape}; expected {space.shape} "
                    f"(single_action_space {space!r})."
                )

    def _finish_step(self, outcome: _SliceOutcome) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Assemble the workers' results into the vector's batch, then raise the first error."""
        rewards, terminations, truncations = self._rewards, self._terminations, self._truncations
        infos: dict[str, Any] = {}
        errors: dict[int, BaseException] = {}
        autoreset = self._autoreset
        plan, self._plan = self._plan, None
        clean = [
            n
            for n, (result, worker_errors) in outcome.items()
            if result is None and not worker_errors
        ]
        if clean:
            assert plan is not None
            if len(clean) == len(self._workers):
                self._commit(plan, slice(None))  # the usual case: one op for all envs
            else:
                for number in clean:
                    self._commit(plan, self._workers[number].index)
        for number, (result, worker_errors) in outcome.items():
            errors.update(worker_errors)
            if result is None:
                continue
            worker = self._workers[number]
            index = worker.index
            rewards[index] = result.rewards
            terminations[index] = result.terminated
            truncations[index] = result.truncated
            autoreset.after_step(index, result.terminated, result.truncated)
            if result.obs is not None:
                for item, env_index in enumerate(worker.env_ids):
                    if env_index not in worker_errors:  # an env that raised keeps its obs
                        self._env_obs[env_index] = result.obs[item]
            for item, extra in result.extras.items():
                env_index = worker.env_ids[item]
                if env_index in worker_errors:
                    continue
                is_done = bool(result.terminated[item] or result.truncated[item])
                info, must_reset = autoreset.step_info(extra, is_done)
                if must_reset:
                    info = self._reset_after_crash(env_index, info)
                if info:
                    infos = self._add_info(infos, info, env_index)
        if errors:  # an env that raised did not step: no reward, no flags
            failed = np.array(sorted(errors))
            rewards[failed], terminations[failed], truncations[failed] = 0.0, False, False
            autoreset.after_step(failed, terminations[failed], truncations[failed])
        batch = self._batched_obs(), rewards.copy(), terminations.copy(), truncations.copy(), infos
        if errors:
            for error in errors.values():  # the other envs did step: their results go along
                if isinstance(error, EnvError):
                    error.results, error.failed_env_ids = batch, sorted(errors)
            self._raise_first(errors)
        return batch

    def _commit(self, plan: StepPlan, index: slice) -> None:
        """Take the results of envs ``index`` of a planned step from shared memory."""
        rewards, terminated, truncated = self._link.commit(plan, index)
        self._rewards[index] = rewards
        self._terminations[index] = terminated
        self._truncations[index] = truncated
        self._autoreset.after_step(index, terminated, truncated)
        stepped = ~plan.is_reset[index]
        self._steps[index] += stepped
        self._episodes[index] += stepped & (terminated | truncated)

    def _reset_after_crash(self, env_index: int, info: dict[str, Any]) -> dict[str, Any]:
        """SAME_STEP: reset an env whose worker died mid-step; report the crash's final obs."""
        proxy = self.envs[env_index]
        final_obs = proxy.supervisor.read_obs(proxy.position)
        obs, reset_info = proxy.reset()
        self._env_obs[env_index] = obs
        return Autoreset.crash_info(final_obs, info, reset_info)

    def _batched_obs(self) -> Any:
        if self._link.has_shared_obs:
            return self._link.observations(None, copy=self.copy)
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        return deepcopy(self._observations) if self.copy else self._observations

    def _submit_slices(
        self, make_batch: Callable[[_Worker], Batch | StepPlan | None]
    ) -> list[Future[_SliceOutcome]]:
        """Run every slice of workers on the pool (``*_async``); ``_collect_slices`` waits."""
        workers = self._workers
        return [
            self._executor.submit(_run_slice, [workers[n] for n in part], part, make_batch)
            for part in self._slices
        ]

    def _fan_out(
        self, numbers: Iterable[int], make_batch: Callable[[_Worker], Batch | StepPlan | None]
    ) -> list[Future[_SliceOutcome] | _SliceOutcome]:
        """Send each worker its batch and collect it, by slices; the first slice runs inline."""
        wanted = set(numbers)
        parts = [[n for n in part if n in wanted] for part in self._slices]
        parts = [part for part in parts if part]
        futures: list[Future[_SliceOutcome] | _SliceOutcome] = [
            self._executor.submit(_run_slice, [self._workers[n] for n in part], part, make_batch)
            for part in parts[1:]
        ]
        futures.insert(0, _run_slice([self._workers[n] for n in parts[0]], parts[0], make_batch))
        return futures

    def _gather(self, outcomes: list[Future[_SliceOutcome] | _SliceOutcome]) -> _SliceOutcome:
        """Wait for every slice, then raise the lowest env index's error, if any."""
        futures = [o for o in outcomes if isinstance(o, Future)]
        if futures:
            wait_futures(futures)
        merged: _SliceOutcome = {}
        for outcome in outcomes:
            merged.update(outcome.result() if isinstance(outcome, Future) else outcome)
        return merged

    def _map(self, call: Callable[[int], Any]) -> tuple[Any, ...]:
        self._check_idle("call")

        def run(part: list[int]) -> dict[int, Any]:
            results: dict[int, Any] = {}
            for number in part:
                for env_index in self._workers[number].env_ids:
                    try:
                        results[env_index] = call(env_index)
                    except Exception as exc:  # noqa: BLE001 - raised below, lowest index first
                        results[env_index] = _Failed(exc)
            return results

        futures = [self._executor.submit(run, part) for part in self._slices[1:]]
        results = run(self._slices[0])
        wait_futures(futures)
        for future in futures:
            results.update(future.result())
        errors = {i: r.error for i, r in results.items() if isinstance(r, _Failed)}
        if errors:
            self._raise_first(errors)
        return tuple(results[i] for i in range(self.num_envs))


@dataclasses.dataclass
class _Failed:
    error: BaseException


class _PartialInfos:
    """Merges the infos of a partial batch the Gymnasium way, with arrays of its own size."""

    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def _take(values: Any, index: Sequence[int]) -> Any:
    if isinstance(values, np.ndarray):
        return values[list(index)]
    return [values[i] for i in index]


def _finish(worker: _Worker) -> _Collected:
    """Collect one worker's batch: the result with its errors by env index, or one error."""
    try:
        result, errors = worker.supervisor.finish()
    except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest env index first
        return None, dict.fromkeys(worker.env_ids, exc)
    return result, {worker.env_ids[item]: error for item, error in errors.items()}


def _submit(worker: _Worker, order: Batch | StepPlan | None) -> bool:
    """Send a worker its batch, or its part of a planned step; False if it has none."""
    if order is None:
        return False
    if isinstance(order, StepPlan):
        worker.supervisor.submit_planned(order, worker.index)
    else:
        worker.supervisor.submit(order)
    return True


def _collect_slices(
    futures: list[Future[_SliceOutcome]], timeout: float | None, name: str
) -> _SliceOutcome:
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
    outcome: _SliceOutcome = {}
    for future in futures:
        outcome.update(future.result())
    return outcome


def _run_slice(
    workers: Sequence[_Worker],
    numbers: Sequence[int],
    make_batch: Callable[[_Worker], Batch | StepPlan | None],
) -> _SliceOutcome:
    """Send every worker of the slice its batch, then collect every reply."""
    outcome: _SliceOutcome = {}
    sent = []
    for number, worker in zip(numbers, workers, strict=True):
        try:
            if _submit(worker, make_batch(worker)):
                sent.append((number, worker))
        except Exception as exc:  # noqa: BLE001 - raised by the caller, lowest env index first
            outcome[number] = (None, dict.fromkeys(worker.env_ids, exc))
    for number, worker in sent:
        outcome[number] = _finish(worker)
    return outcome


def _create_envs(backend: str, env_fns: list[Any], **options: Any) -> list[RemoteEnv]:
    """Build ready proxies for ``env_fns`` with the named backend."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}.")
    module, _, name = _BACKENDS[backend].partition(":")
    envs: list[RemoteEnv] = getattr(importlib.import_module(module), name)(env_fns, **options)
    return envs


def _group_by_worker(proxies: Sequence[RemoteEnv]) -> list[_Worker]:
    """The vector's workers, in order of their first env, with their envs in this vector."""
    workers: dict[int, _Worker] = {}
    for env_index, proxy in enumerate(proxies):
        key = id(proxy.supervisor)
        if key not in workers:
            workers[key] = _Worker(proxy.supervisor, [], [], None)
        workers[key].env_ids.append(env_index)
        workers[key].positions.append(proxy.position)
    for worker in workers.values():
        worker.position_array = np.asarray(worker.positions, dtype=np.intp)
        worker.position_of = dict(zip(worker.env_ids, worker.positions, strict=True))
        worker.is_whole = worker.positions == list(range(len(worker.supervisor.env_indices)))
        first, count = worker.env_ids[0], len(worker.env_ids)
        if worker.env_ids == list(range(first, first + count)):
            worker.index = slice(first, first + count)
        else:
            worker.index = np.asarray(worker.env_ids)
    return list(workers.values())


def _same_shape(space: gym.Space[Any], other: gym.Space[Any]) -> bool:
    """Whether two observation spaces share their shape and dtype (so they batch together)."""
    if isinstance(space, gym.spaces.Dict) and isinstance(other, gym.spaces.Dict):
        return space.spaces.keys() == other.spaces.keys() and all(
            _same_shape(space[key], other[key]) for key in space.spaces
        )
    if isinstance(space, gym.spaces.Tuple) and isinstance(other, gym.spaces.Tuple):
        return len(space) == len(other) and all(
            _same_shape(a, b) for a, b in zip(space, other, strict=True)
        )
    return type(space) is type(other) and space.shape == other.shape and space.dtype == other.dtype


def _check_ready(proxies: Sequence[Any]) -> None:
    seen: set[int] = set()
    for env_index, proxy in enumerate(proxies):
        if not isinstance(proxy, RemoteEnv):
            raise TypeError(
                f"env {env_index}: expected a SubprocessEnv (or another multienv proxy) or an "
                f"env factory, got {type(proxy).__name__}."
            )
        if id(proxy) in seen:
            raise ValueError(f"env {env_index}: the same proxy appears twice; pass each once.")
        seen.add(id(proxy))
        state = proxy.state
        if state is not EnvState.READY:
            raise EnvStateError(
                f"env {env_index}: is in state {state.name}; pass ready envs (start() and "
                "initialize() done, as create_subprocess_envs() returns them).",
                env_index=env_index,
            )
