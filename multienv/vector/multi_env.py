"""VECTOR API: MultiEnv, a ``gymnasium.vector.VectorEnv`` over env proxies, run in parallel.

A call flows one way: ``vector_checks`` (input checked before anything is sent) ->
``fan_out`` (one batch per worker, by slices of workers) -> each worker's
``WorkerSupervisor`` and its handle -> ``assembly`` (the batch and infos returned).
``MultiEnv`` knows its envs only through the seam of ``multienv.supervision.handles``; it names no
backend (``handles.find_backend`` looks them up by name), and pipes, pids and signals stay
in the backend. Two groups of its methods live with the code they drive: the planning
methods in ``planning.PlanningApi``, and ``send``/``recv`` in ``send_recv.SendRecvApi``.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv

from multienv.errors import (
    ERRORS_OF_USER_CODE,
    EnvError,
    EnvStateError,
    NoPendingCallError,
    PendingCallError,
    WaitTimeoutError,
    raised_here,
)
from multienv.layout import Layout, given_layout
from multienv.supervision.env_proxy import RemoteEnv, abandon_workers
from multienv.supervision.factory import warn_unbounded_batches
from multienv.supervision.handles import DataPlane, SharedMemoryLink, VectorParts, keyword_options
from multienv.vector import vector_checks
from multienv.vector.assembly import Assembly, StepBatch
from multienv.vector.fan_out import (
    ByWorker,
    FanOut,
    MakeBatch,
    collect_slices,
    finish,
    group_by_worker,
    raise_first,
    step_batches,
)
from multienv.vector.planning import PlanningApi
from multienv.vector.resetting import ResetApi
from multienv.vector.send_recv import InFlight, SendRecvApi
from multienv.vector.timing import CallClock, TimingApi, clocked
from multienv.wire.autoreset import Autoreset
from multienv.wire.protocol import StepPlan
from multienv.wire.space_bounds import lean_batch_space

logger = logging.getLogger(__name__)


class MultiEnv(ResetApi, PlanningApi, SendRecvApi, TimingApi, VectorEnv[Any, Any, Any]):
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
            in worker ``i // envs_per_worker``); see ``create_subprocess_envs``. ``"auto"``
            times env 0 in a probe worker and chooses for this machine's cores; ``layout``
            says what it chose and why. Recommended when speed matters.
        backend: With env factories, where the workers run: ``"subprocess"`` (daemon
            processes on this machine) or ``"ray"`` (Ray actors, on a cluster; needs
            ``multienv[ray]``, see ``create_ray_envs``).
        shared_memory: As ``AsyncVectorEnv`` takes it. None (default): observations of
            fixed-shape spaces travel through shared memory, others pickled; True: the same,
            but a space of dynamic shape raises TypeError, as AsyncVectorEnv does; False:
            always pickled. The Ray backend has no shared memory and ignores it.
        daemon: As ``AsyncVectorEnv`` takes it: False starts the worker processes as
            non-daemons, so env code may start processes of its own (they still exit with
            this process). The Ray backend ignores it.
        worker: Accepted so that ``AsyncVectorEnv``'s arguments pass, but only None: a
            multienv worker is not a function to replace (it is an ``EnvRunner`` under a
            supervisor that respawns it), so any other value raises ValueError.
        env_fns: The env factories given by keyword, as ``AsyncVectorEnv(env_fns=...)`` and
            ``gymnasium.make_vec`` pass them; instead of ``envs``.
        observation_mode: ``"same"`` (default): every env has the same observation space.
            ``"different"``: spaces may differ within what Gymnasium can batch
            (``batch_differing_spaces``); observations are then pickled. A tuple
            ``(batched_space, single_space)`` sets the spaces outright.
        **options: ``SubprocessEnv`` or ``RayEnv`` options, used only when ``envs`` are
            factories: ``context`` (the multiprocessing start method, ``"forkserver"``,
            ``"spawn"`` or ``"fork"``, or a context), timeouts, policies, ``pin_cpu``,
            ``wait`` and the others ``SubprocessEnv`` documents; ``ray_options=RayOptions(...)``
            for Ray.
    """

    @raised_here
    def __init__(
        self,
        envs: Iterable[RemoteEnv | Callable[[], gym.Env[Any, Any]]] | None = None,
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        num_threads: int | None = None,
        max_concurrency: int | None = None,
        envs_per_worker: int | str = 1,
        backend: str = "subprocess",
        shared_memory: bool | None = None,
        daemon: bool = True,
        worker: Callable[..., Any] | None = None,
        observation_mode: str | tuple[gym.Space[Any], gym.Space[Any]] = "same",
        env_fns: Iterable[Callable[[], gym.Env[Any, Any]]] | None = None,
        **options: Any,
    ) -> None:
        """Build or adopt the envs, check that their spaces match, and batch the spaces."""
        envs = vector_checks.envs_given(envs, env_fns)
        vector_checks.check_constructor(worker, observation_mode, max_concurrency)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.copy = copy
        self.shared_memory = shared_memory
        self.daemon = daemon
        self.observation_mode = observation_mode
        self.max_concurrency = max_concurrency
        proxies, is_built, self._layout = vector_checks.proxies_for(
            list(envs),
            backend,
            envs_per_worker,
            daemon,
            options,
            keyword_options(MultiEnv.__init__) - {"self", "envs", "env_fns", "options"},
        )
        if is_built and self.autoreset_mode is AutoresetMode.NEXT_STEP:
            per_worker = max(len(proxy.supervisor.env_indices) for proxy in proxies)
            warn_unbounded_batches(per_worker, options)  # steps + resets
        try:
            self._adopt(proxies, num_threads)
        except BaseException:
            if is_built:
                for proxy in proxies:
                    proxy.close()
            raise

    def _adopt(self, proxies: list[RemoteEnv], num_threads: int | None) -> None:
        # Under 30 instance attributes (CPython shares at most 30 keys per class; past that
        # every ``self.x`` of the step takes the slow lookup: tests/test_multi_env.py).
        first = proxies[0]
        mode = self.observation_mode
        observation_spaces = vector_checks.observation_spaces(proxies, mode)
        self.observation_space, self.single_observation_space, is_uniform = observation_spaces
        self.envs: list[Any] = proxies
        self.num_envs = len(proxies)
        self.metadata = dict(first.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first.render_mode
        self.spec = first.spec
        self.single_action_space = first.action_space
        self.action_space = lean_batch_space(self.single_action_space, self.num_envs)
        # Spaces that differ cannot share one slot layout: their observations are pickled.
        shared_memory = self.shared_memory if is_uniform else False

        groups = self._groups = group_by_worker(  # in order of their first env
            [proxy.supervisor for proxy in proxies], [proxy.position for proxy in proxies]
        )
        self._fan_out = FanOut(groups, num_threads or 1)
        self._link = self._fan_out.link_workers(
            (self.single_observation_space, self.single_action_space), shared_memory
        )
        self._autoreset = Autoreset(self.autoreset_mode, self.num_envs)
        self._assembly = Assembly(
            self.single_observation_space,
            self.num_envs,
            self._link,
            self._autoreset,
            self.copy,
            self._reset_after_crash,
        )
        self._pending: list[Future[ByWorker]] | None = None  # step_async()
        self._pending_reset: tuple[list[Future[ByWorker]], np.ndarray] | None = None
        self._plan: StepPlan | None = None  # the planned step in flight, if it is one
        self._in_flight = InFlight(self._fan_out, self._assembly, self._autoreset)
        # The caller's time in the vector's calls (``timing``), and in the data plane's steps.
        self._clock = CallClock(self._assembly.counters.latencies)
        # Planned steps (one vector op for all envs) need each worker's envs as one slice,
        # in position order, and a link that plans (``_plan_link``, else None); the workers'
        # counters then become views.
        link = self._link if isinstance(self._link, SharedMemoryLink) else None
        can_plan = all(group.is_whole and isinstance(group.index, slice) for group in groups)
        self._plan_link = link if can_plan else None
        if self._plan_link is not None:
            for group in groups:
                self._assembly.counters.adopt(group.supervisor.stats, group.index)
        # The healthy step in one pass, when the link has one for this layout (``data_plane``).
        self._data_plane: DataPlane | None = None
        if self._plan_link is not None and len(self._fan_out.slices) == 1:
            if not self._is_limited():
                parts = VectorParts(
                    [group.supervisor for group in groups],
                    [group.index for group in groups],
                    self._autoreset,
                    self._assembly.counters,
                    self.copy,
                    self._assembly.add_info,
                )
                self._data_plane = self._plan_link.open_data_plane(parts)
                if self._data_plane is not None:
                    self._in_flight.parts = self._data_plane.parts
                    self._in_flight.plane = self._data_plane
        # Dropped unclosed (collected, or alive at exit), the vector kills its workers at
        # once, without waiting (``abandon_workers``); close() detaches this. It replaces the
        # proxies' own finalizers, so that one warning names the vector.
        for proxy in proxies:
            proxy.detach_finalizer()
        self._finalizer = weakref.finalize(
            self,
            abandon_workers,
            [group.supervisor for group in groups],
            f"MultiEnv(num_envs={self.num_envs})",
        )

    # ----------------------------------------------------------------- vector API

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every env with its action; see the module docstring of ``autoreset``."""
        plane = self._data_plane
        # Closed, a send() in flight, a death...: the data plane refuses, as its workers say
        # (``data_plane``); what runs on the pool it cannot see. It times its own steps
        # (``LatencyRing.total_s``), which ``timing()`` counts as time in the vector.
        if (
            plane is not None
            and self._pending is None
            and self._pending_reset is None
            and plane.send(actions)
        ):
            try:
                return self._receive_planned(plane, None)
            except ERRORS_OF_USER_CODE as exc:  # cut as clocked() cuts the pool's
                raise exc.with_traceback(None) from exc.__cause__
        return self._step_by_pool(actions)

    @clocked
    def _step_by_pool(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """The step by the general path: each worker's batch made, sent and collected."""
        make_batch = self._prepare_step(actions)
        if self._is_limited():
            assert self.max_concurrency is not None
            return self._finish_step(self._fan_out.run_limited(make_batch, self.max_concurrency))
        return self._finish_step(self._fan_out.run(make_batch))

    @clocked
    def step_async(self, actions: Any) -> None:
        """Send a step to every env and return at once; ``step_wait()`` collects it."""
        plane = self._data_plane
        if plane is not None:
            self._check_idle("step_async")
            if plane.send(actions):
                self._pending = []  # nothing on the pool: the data plane's step is in flight
                return
        make_batch = self._prepare_step(actions, "step_async")
        if self._is_limited():
            assert self.max_concurrency is not None
            self._pending = [
                self._fan_out.executor.submit(
                    self._fan_out.run_limited, make_batch, self.max_concurrency
                )
            ]
            return
        self._pending = self._fan_out.submit_slices(make_batch)

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Wait for the step sent by ``step_async()``.

        Args:
            timeout: Seconds to wait; on expiry ``TimeoutError`` is raised and the step stays
                in flight, so ``step_wait()`` may be called again.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.step_wait() called after close().")
        if self._pending is None:
            raise NoPendingCallError(
                "Calling `step_wait` without any prior call to `step_async`.", "step"
            )
        plane = self._data_plane
        if not self._pending and plane is not None and plane.is_in_flight():
            try:
                batch = self._receive_planned(plane, timeout)  # timed by the data plane
            except WaitTimeoutError:
                raise  # still in flight: step_wait() again
            except BaseException as exc:
                # Collected (an env's EnvError, as the general path raises it) or handed
                # to the supervisors (Ctrl-C), who drop it before the next call: none pending.
                # (Ctrl-C while the pool collects a hand-over keeps it, as the pool's own.)
                if self._pending == []:
                    self._pending = None
                if isinstance(exc, ERRORS_OF_USER_CODE):  # cut as clocked() cuts the pool's
                    raise exc.with_traceback(None) from exc.__cause__
                raise
            self._pending = None
            return batch
        return self._wait_for_pool(timeout)

    @clocked
    def _wait_for_pool(self, timeout: float | None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """``step_wait`` of a step that went by the general path."""
        assert self._pending is not None
        outcome = collect_slices(self._pending, timeout, "step")
        self._pending = None
        return self._finish_step(outcome)

    def render(self) -> tuple[Any, ...]:
        """Return every env's ``render()`` result."""
        return self._map(lambda i: self.envs[i].render(), "render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` on every env (or read the attribute, if not callable)."""
        return self._map(lambda i: self.envs[i].call(name, *args, **kwargs), "call")

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Return attribute ``name`` of every env."""
        return self._map(lambda i: self.envs[i].get_attr(name), "get_attr")

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` on every env: one value for all, or a list with one per env."""
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"set_attr({name!r}) got {len(values)} values for {self.num_envs} envs; pass "
                "one value per env, or a single value for all."
            )
        self._map(lambda i: self.envs[i].set_attr(name, values[i]), "set_attr")

    @property  # a tuple, as AsyncVectorEnv reports it
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """Each env's ``np_random_seed``, as Gymnasium's vector envs report them."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]  # a tuple, as AsyncVectorEnv reports it
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """Each env's ``np_random`` generator (copies, from the workers)."""
        return self.get_attr("np_random")

    @property
    def layout(self) -> Layout:
        """How the envs are spread over the workers, and why (``envs_per_worker="auto"``)."""
        if self._layout is None:  # given: as the workers are
            sizes = [len(group.env_ids) for group in self._groups]
            self._layout = given_layout(self.num_envs, max(sizes), len(sizes))
        return self._layout

    def close_extras(self, timeout: float | None = None, **kwargs: Any) -> None:
        """Close every worker in parallel, each bounded by ``timeout`` seconds.

        ``terminate`` and other keywords of ``AsyncVectorEnv.close`` are accepted; the
        workers are always stopped within ``timeout`` (then killed).
        """
        if "_finalizer" not in self.__dict__:
            return
        self._finalizer.detach()
        for pending, state in ((self._pending, "step"), (self._pending_reset, "reset")):
            if pending is not None:
                warnings.warn(
                    f"Calling `close` while waiting for a pending call to `{state}` to complete.",
                    UserWarning,
                    stacklevel=3,
                )

        self._fan_out.close_workers(lambda env_index: self.envs[env_index].close(timeout=timeout))
        self._link.close()
        if self._pending is not None:
            wait_futures(self._pending, timeout=5.0)  # the workers are gone, so they end now
            self._pending = None
        if self._pending_reset is not None:
            wait_futures(self._pending_reset[0], timeout=5.0)
            self._pending_reset = None
        self._fan_out.shutdown()

    def __enter__(self) -> MultiEnv:
        """Return self; the envs are closed on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the envs."""
        self.close()

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
        if self._in_flight.is_busy():
            flying = self._in_flight.env_ids()
            raise EnvStateError(
                f"MultiEnv.{name}() called while envs {flying} are in flight "
                "after send(); call recv() until none is left."
            )

    def _is_limited(self) -> bool:
        return self.max_concurrency is not None and self.max_concurrency < self.num_envs

    def _prepare_step(self, actions: Any, name: str = "step") -> MakeBatch:
        """Check the actions and the envs; return how to make each worker's batch."""
        self._check_idle(name)
        batch_actions = self._split_actions(actions, None)
        autoreset = self._autoreset
        autoreset.check_can_step(slice(None), name)
        resets = autoreset.resets(slice(None))
        is_same_step = autoreset.is_same_step

        if self._plan_link is not None and isinstance(batch_actions, np.ndarray):
            is_counted = not self._is_limited()  # every worker, collected at once
            plan = self._plan_link.plan_step(batch_actions, resets, is_same_step, is_counted)
            if plan is not None:
                self._plan = plan
                return lambda worker: plan

        return step_batches(batch_actions, resets, is_same_step)

    def _receive_planned(self, plane: DataPlane, timeout: float | None) -> StepBatch:
        """The data plane's step in flight; collected by the control plane if it hands it over.

        Raises:
            WaitTimeoutError: ``timeout`` passed first; the step stays in flight.
        """
        until = None if timeout is None else time.monotonic() + timeout
        try:
            received = plane.receive(timeout)
        except BaseException:
            plane.interrupt()  # Ctrl-C mid-wait: the supervisors collect it before the next
            raise
        if type(received) is tuple:
            return received
        if received is None:
            raise WaitTimeoutError(
                f"The call to `step_wait` has timed out after {timeout} second(s); call "
                "step_wait() again, or close()."
            )
        assert isinstance(received, StepPlan)
        self._plan = received
        if until is None:
            outcome = {number: finish(group) for number, group in enumerate(self._groups)}
            return self._finish_step(outcome)
        # step_wait(timeout): the supervisors collect the rest on the pool, so that the
        # caller's timeout holds (a worker still stepping may take to its own deadline).
        self._pending = [self._fan_out.executor.submit(self._collect_handed_over)]
        return self._wait_for_pool(max(0.0, until - time.monotonic()))

    def _collect_handed_over(self) -> ByWorker:
        """Every worker's part of a planned step the data plane handed over, collected."""
        return {number: finish(group) for number, group in enumerate(self._groups)}

    def _split_actions(self, actions: Any, env_ids: list[int] | None) -> Any:
        """The actions as one array (array spaces) or list, checked; errors name the env."""
        ids = range(self.num_envs) if env_ids is None else env_ids
        return vector_checks.split_actions(
            actions, ids, self.single_action_space, self.action_space, self.num_envs
        )

    def _finish_step(self, outcome: ByWorker) -> StepBatch:
        """Assemble the workers' results into the vector's batch, then raise the first error."""
        plan, self._plan = self._plan, None
        batch, errors = self._assembly.step_batch(outcome, self._groups, plan)
        if errors:
            for error in errors.values():  # the other envs did step: their results go along
                if isinstance(error, EnvError):
                    error.results, error.failed_env_ids = batch, sorted(errors)
            raise_first(errors)
        return batch

    def _reset_after_crash(self, env_index: int) -> tuple[Any, Any, dict[str, Any]]:
        """SAME_STEP: reset an env whose worker died mid-step: its final obs, new obs, info."""
        proxy = self.envs[env_index]
        final_obs = proxy.supervisor.read_obs(proxy.position)
        obs, reset_info = proxy.reset()
        return final_obs, obs, reset_info

    def _map(self, call: Callable[[int], Any], name: str) -> tuple[Any, ...]:
        """Run ``call(env_index)`` for every env, as the vector's method ``name``."""
        self._check_idle(name)
        results, errors = self._fan_out.map(call, self.num_envs)
        if errors:
            raise_first(errors)
        return tuple(results)
