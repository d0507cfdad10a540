"""VECTOR API: MultiEnv, a ``gymnasium.vector.VectorEnv`` over env proxies, run in parallel.

``MultiEnv`` knows its envs only through the split-phase proxy interface (``send_step`` /
``recv_step``, ``send_reset`` / ``recv_reset``, ``call``, ...), so pipes, pids and signals
stay in the backend. Calls fan out by slices of envs: one task per slice sends to every env
of the slice, then collects every reply, so a step costs one message each way per env and
at most one thread hop per slice (the first slice runs in the caller's thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from multienv.autoreset import AutoResetEnv, EnvProxy, StepResult
from multienv.errors import EnvStateError
from multienv.shared_memory import BatchLayout, SharedBatch
from multienv.subprocess_env import EnvState, create_subprocess_envs

logger = logging.getLogger(__name__)

_SliceOutcome = tuple[dict[int, Any], dict[int, BaseException]]
_ARRAY_ACTION_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)


class MultiEnv(VectorEnv[Any, Any, Any]):
    """A Gymnasium vector env whose sub-envs run in worker processes and survive crashes.

    Example:
        >>> import gymnasium as gym
        >>> from multienv import MultiEnv
        >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 4) as envs:
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
        num_threads: How many slices the envs are split into for fan-out; the first slice
            runs in the caller's thread. Defaults to 1: with observations in shared memory
            the parent only writes and reads a few bytes per env, which one thread does
            faster than several (``python scripts/bench.py`` measures it).
        max_concurrency: At most this many envs step at once in ``step()``/``step_async()``;
            the next env starts as soon as one finishes. None (default) steps all at once.
            Use it when N envs would oversubscribe the cores.
        **options: ``SubprocessEnv`` options, used only when ``envs`` are factories.
    """

    def __init__(
        self,
        envs: Iterable[EnvProxy | Callable[[], gym.Env[Any, Any]]],
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        num_threads: int | None = None,
        max_concurrency: int | None = None,
        **options: Any,
    ) -> None:
        """Build or adopt the envs, check that their spaces match, and batch the spaces."""
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.copy = copy
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency!r}.")
        self.max_concurrency = max_concurrency
        items = list(envs)
        if not items:
            raise ValueError("MultiEnv needs at least one env or env factory, got none.")
        is_proxy = [isinstance(item, gym.Env) for item in items]
        if all(is_proxy):
            if options:
                raise TypeError(
                    f"MultiEnv got ready envs and options {sorted(options)!r}; options apply "
                    "only when MultiEnv builds the envs from factories."
                )
            proxies: list[Any] = items
            _check_ready(proxies)
        elif not any(is_proxy):
            proxies = create_subprocess_envs(items, **options)  # type: ignore[arg-type]
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

    def _adopt(self, proxies: list[Any], num_threads: int | None) -> None:
        first = proxies[0]
        for env_index, proxy in enumerate(proxies):
            for name in ("observation_space", "action_space"):
                space, expected = getattr(proxy, name), getattr(first, name)
                if space != expected:
                    raise ValueError(
                        f"env {env_index}: {name} {space!r} differs from env 0's {expected!r}; "
                        "all envs of a MultiEnv must have the same spaces."
                    )
        for env_index, proxy in enumerate(proxies):
            proxy.env_index = env_index

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

        self._wrappers = [AutoResetEnv(proxy, self.autoreset_mode) for proxy in proxies]
        self._env_obs: list[Any] = [None] * self.num_envs
        self._observations = create_empty_array(
            self.single_observation_space, n=self.num_envs, fn=np.zeros
        )
        threads = num_threads or 1
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self._slices = [
            list(map(int, part))
            for part in np.array_split(np.arange(self.num_envs), min(threads, self.num_envs))
        ]
        # One thread per slice: step() runs the first slice inline, step_async() none.
        self._all_ids = list(range(self.num_envs))
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._slices), thread_name_prefix="multienv"
        )
        self._pending: list[Future[_SliceOutcome]] | None = None
        self._in_flight: set[int] = set()  # envs sent a step by send(), not yet received
        self._wait_ready = getattr(type(first), "wait_ready", None)
        self._shared: SharedBatch | None = None
        if BatchLayout.supports(self.single_observation_space) and all(
            hasattr(proxy, "attach") for proxy in proxies
        ):
            self._shared = SharedBatch(
                self.single_observation_space,
                self.single_action_space,
                self.num_envs,
                groups=self._slices,  # one done pipe per collecting thread
            )
            try:
                self._map(lambda i: proxies[i].attach(self._shared))
            except BaseException:
                self._shared.close()
                raise

    # ----------------------------------------------------------------- vector API

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all envs, or those in ``options["reset_mask"]``.

        Args:
            seed: None, an int (env i gets ``seed + i``) or one seed per env.
            options: Passed to every env's ``reset``; ``"reset_mask"`` (a bool array of
                shape ``(num_envs,)``) selects the envs to reset.
        """
        self._check_idle("reset")
        seeds = self._seeds(seed)
        options = dict(options) if options is not None else None
        mask = self._reset_mask(options.pop("reset_mask", None) if options else None)
        indices = [i for i in range(self.num_envs) if mask[i]]

        def send(i: int) -> None:
            self._wrappers[i].send_reset(seed=seeds[i], options=options)

        parts = self._slices if len(indices) == self.num_envs else self._slices_of(indices)
        results = self._gather(self._fan_out(parts, send, lambda i: self._wrappers[i].recv_reset()))
        infos: dict[str, Any] = {}
        for i in indices:
            obs, info = results[i]
            if obs is not None:
                self._env_obs[i] = obs
            infos = self._add_info(infos, info, i)
        return self._batched_obs(), infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every env with its action; see the module docstring of ``autoreset``."""
        per_env = self._prepare_step(actions)
        if self._is_limited():
            return self._finish_step(self._step_limited(per_env))
        send, recv = self._step_calls(per_env)
        return self._finish_step(self._gather(self._fan_out(self._slices, send, recv)))

    def step_async(self, actions: Any) -> None:
        """Send a step to every env and return at once; ``step_wait()`` collects it."""
        per_env = self._prepare_step(actions)
        if self._is_limited():
            self._pending = [self._executor.submit(self._step_limited_outcome, per_env)]
            return
        send, recv = self._step_calls(per_env)
        self._pending = [
            self._executor.submit(_run_slice, part, send, recv) for part in self._slices
        ]

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Send a step to some envs and return at once; ``recv()`` collects the first to finish.

        EnvPool-style asynchronous stepping: keep some envs stepping while you learn from
        the others, so a slow env does not hold back the batch.

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
        per_env = self._split_actions(actions, ids)
        for i in ids:
            self._wrappers[i].check_can_step()
        for position, i in enumerate(ids):
            self._wrappers[i].send_step(per_env[position])
            self._in_flight.add(i)

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
        flying = sorted(self._in_flight)
        if not flying:
            raise EnvStateError("MultiEnv.recv() called with no env in flight; call send() first.")
        size = len(flying) if batch_size is None else batch_size
        if not 1 <= size <= len(flying):
            raise ValueError(
                f"recv(batch_size={batch_size!r}) with {len(flying)} envs in flight; pass a "
                f"batch_size from 1 to {len(flying)}, or None for all."
            )
        ids = self._wait_for(flying, size, timeout)
        self._in_flight.difference_update(ids)
        results: dict[int, StepResult] = {}
        errors: dict[int, BaseException] = {}
        self._recv_steps(ids, results, errors)
        self._collect([(results, errors)])
        return self._finish_partial(ids, results)

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Wait for the step sent by ``step_async()``.

        Args:
            timeout: Seconds to wait; on expiry ``TimeoutError`` is raised and the step stays
                in flight, so ``step_wait()`` may be called again.
        """
        if self._pending is None:
            raise EnvStateError("step_wait() called without a pending step_async().")
        _done, not_done = wait_futures(self._pending, timeout)
        if not_done:
            raise TimeoutError(
                f"step_wait() timed out after {timeout} s with {len(not_done)} of "
                f"{len(self._pending)} slices still stepping; call step_wait() again, or close()."
            )
        futures, self._pending = self._pending, None
        return self._finish_step(self._collect(futures))

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

    def stats(self) -> list[dict[str, Any]]:
        """Per env: steps, episodes, restarts, last failure cause, step latency p50/p99 (s)."""
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
                    "last_failure": proxy.last_failure,
                    "step_latency_p50_s": float(p50),
                    "step_latency_p99_s": float(p99),
                }
            )
        return rows

    def close_extras(self, timeout: float | None = None, **kwargs: Any) -> None:
        """Close every env in parallel, each bounded by ``timeout`` seconds."""
        if "envs" not in self.__dict__:
            return
        try:
            with ThreadPoolExecutor(
                max_workers=self.num_envs, thread_name_prefix="multienv-close"
            ) as pool:
                list(pool.map(lambda proxy: proxy.close(timeout=timeout), self.envs))
        except RuntimeError:  # the interpreter is shutting down and starts no threads
            for proxy in self.envs:
                proxy.close(timeout=timeout)
        if self._shared is not None:
            self._shared.close()
        if self._pending is not None:
            wait_futures(self._pending, timeout=5.0)  # the workers are gone, so they end now
            self._pending = None
        self._executor.shutdown(wait=True)

    def __enter__(self) -> MultiEnv:
        """Return self; the envs are closed on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the envs."""
        self.close()

    def __del__(self) -> None:
        """Close the envs if the object was fully constructed."""
        if "envs" in self.__dict__ and not self.closed:
            self.close(timeout=1.0)

    # ----------------------------------------------------------------- internals

    def _check_idle(self, name: str) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"MultiEnv.{name}() called after close().")
        if self._pending is not None:
            raise EnvStateError(
                f"MultiEnv.{name}() called while a step_async() is pending; call step_wait() first."
            )
        if self._in_flight:
            raise EnvStateError(
                f"MultiEnv.{name}() called while envs {sorted(self._in_flight)} are in flight "
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
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env {i}: no such env; env_ids must be in [0, {self.num_envs}).")
            if i in seen:
                raise ValueError(f"env {i}: appears twice in env_ids; pass each env once.")
            if i in self._in_flight:
                raise EnvStateError(
                    f"env {i}: already in flight; recv() it before sending it again.",
                    env_index=i,
                )
            seen.add(i)
        return ids

    def _wait_for(self, flying: list[int], size: int, timeout: float | None) -> list[int]:
        """Wait until ``size`` of the envs in flight can be collected; return their indices."""
        if self._wait_ready is None:  # a backend without a multi-wait: collect in env order
            return flying[:size]
        deadline = None if timeout is None else time.monotonic() + timeout
        ready: list[int] = []
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready += self._ready([i for i in flying if i not in ready], left)
            if len(ready) >= size:
                return sorted(ready[:size])
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"recv() timed out after {timeout} s with {len(ready)} of the {size} envs "
                    "ready; every step is still in flight, call recv() again."
                )

    def _ready(self, ids: list[int], timeout: float | None = None) -> list[int]:
        """Those of ``ids`` whose call can be collected now, after waiting up to ``timeout``."""
        if self._wait_ready is None:  # a backend without a multi-wait: the first, blocking
            return ids[:1]
        return [ids[p] for p in self._wait_ready([self.envs[i] for i in ids], timeout)]

    def _recv_steps(
        self, ids: list[int], results: dict[int, StepResult], errors: dict[int, BaseException]
    ) -> None:
        """Collect the steps of ``ids`` into ``results``, or their errors into ``errors``."""
        for i in ids:
            try:
                results[i] = self._wrappers[i].recv_step()
            except Exception as exc:  # noqa: BLE001 - raised by _collect, lowest index first
                errors[i] = exc

    def _is_limited(self) -> bool:
        return self.max_concurrency is not None and self.max_concurrency < self.num_envs

    def _step_limited(self, per_env: list[Any]) -> dict[int, StepResult]:
        """Step every env with at most ``max_concurrency`` in flight; start one as one ends."""
        assert self.max_concurrency is not None
        queue = list(range(self.num_envs))
        running: list[int] = []
        results: dict[int, StepResult] = {}
        errors: dict[int, BaseException] = {}
        while queue or running:
            while queue and len(running) < self.max_concurrency:
                i = queue.pop(0)
                try:
                    self._wrappers[i].send_step(per_env[i])
                    running.append(i)
                except Exception as exc:  # noqa: BLE001 - raised by _collect, lowest index first
                    errors[i] = exc
            if not running:
                break
            done = self._ready(running)
            running = [i for i in running if i not in done]
            self._recv_steps(done, results, errors)
        return self._collect([(results, errors)])

    def _step_limited_outcome(self, per_env: list[Any]) -> _SliceOutcome:
        try:
            return self._step_limited(per_env), {}
        except Exception as exc:  # noqa: BLE001 - step_wait() raises it
            return {}, {getattr(exc, "env_index", None) or 0: exc}

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int | np.integer):
            return [int(seed) + i for i in range(self.num_envs)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(
                f"reset() got {len(seeds)} seeds for {self.num_envs} envs; pass one seed per "
                "env, a single int, or None."
            )
        return seeds

    def _reset_mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_envs, dtype=np.bool_)
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise TypeError(
                f"options['reset_mask'] must be a numpy bool array, got {type(mask).__name__}"
                f"{'' if not isinstance(mask, np.ndarray) else ' of dtype ' + str(mask.dtype)}."
            )
        if mask.shape != (self.num_envs,):
            raise ValueError(
                f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}."
            )
        if not mask.any():
            raise ValueError("options['reset_mask'] must select at least one env.")
        return mask

    def _prepare_step(self, actions: Any) -> list[Any]:
        """Check the actions and the envs, then split the batch; nothing is sent yet."""
        self._check_idle("step")
        per_env = self._split_actions(actions, self._all_ids)
        for wrapper in self._wrappers:
            wrapper.check_can_step()
        return per_env

    def _split_actions(self, actions: Any, env_ids: list[int]) -> list[Any]:
        """One action per env of ``env_ids``, checked; errors name the env."""
        n, space = len(env_ids), self.single_action_space
        if not isinstance(space, _ARRAY_ACTION_SPACES):
            batch_space_n = self.action_space if n == self.num_envs else batch_space(space, n)
            per_env = list(iterate(batch_space_n, actions))
            if len(per_env) != n:
                raise ValueError(f"expected {n} actions (one per env), got {len(per_env)}.")
            return per_env
        if isinstance(actions, np.ndarray) and actions.shape == (n, *space.shape):
            batch = actions  # the usual case; the checks below only name what is wrong
        else:
            self._check_action_shapes(actions, env_ids)
            batch = np.asarray(actions)
        if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete) and not (
            np.issubdtype(batch.dtype, np.integer)
        ):
            raise ValueError(f"expected integer actions for {space!r}, got dtype {batch.dtype}.")
        if isinstance(space, gym.spaces.Discrete):
            return batch.tolist()  # Python ints pickle several times faster than numpy scalars
        return list(batch)

    def _check_action_shapes(self, actions: Any, env_ids: list[int]) -> None:
        n, space = len(env_ids), self.single_action_space
        try:
            count = len(actions)
        except TypeError:
            raise ValueError(
                f"expected a batch of {n} actions (one per env), got a {type(actions).__name__}."
            ) from None
        if count != n:
            raise ValueError(
                f"expected {n} actions (one per env, batch shape {(n, *space.shape)}), got {count}."
            )
        for position, env_index in enumerate(env_ids):
            shape = np.shape(actions[position])
            if shape != space.shape:
                raise ValueError(
                    f"env {env_index}: action has shape {shape}; expected {space.shape} "
                    f"(single_action_space {space!r})."
                )

    def _step_calls(
        self, per_env: list[Any]
    ) -> tuple[Callable[[int], None], Callable[[int], StepResult]]:
        wrappers = self._wrappers

        def send(i: int) -> None:
            wrappers[i].send_step(per_env[i])

        def recv(i: int) -> StepResult:
            return wrappers[i].recv_step()

        return send, recv

    def _finish_step(
        self, results: dict[int, StepResult]
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        rewards, terminations, truncations, infos = self._unpack(self._all_ids, results, self)
        return self._batched_obs(), rewards, terminations, truncations, infos

    def _unpack(
        self, ids: list[int], results: dict[int, StepResult], merger: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Batch the results of ``ids`` in that order; ``merger._add_info`` merges infos."""
        rewards, terminations, truncations = [], [], []
        infos: dict[str, Any] = {}
        for position, i in enumerate(ids):
            obs, reward, terminated, truncated, info = results[i]
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
            if obs is not None:
                self._env_obs[i] = obs
            if info:
                infos = merger._add_info(infos, info, position)
        return (
            np.array(rewards, dtype=np.float64),
            np.array(terminations, dtype=np.bool_),
            np.array(truncations, dtype=np.bool_),
            infos,
        )

    def _finish_partial(
        self, ids: list[int], results: dict[int, StepResult]
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        size = len(ids)
        rewards, terminations, truncations, infos = self._unpack(ids, results, _PartialInfos(size))
        infos["env_id"] = np.asarray(ids, dtype=np.int64)
        if self._shared is not None:
            observations = self._shared.observations(ids)  # a gather, so already a copy
        else:
            observations = create_empty_array(self.single_observation_space, n=size, fn=np.zeros)
            observations = concatenate(
                self.single_observation_space, [self._env_obs[i] for i in ids], observations
            )
        return observations, rewards, terminations, truncations, infos

    def _batched_obs(self) -> Any:
        if self._shared is not None:
            return self._shared.observations(copy=self.copy)
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        return deepcopy(self._observations) if self.copy else self._observations

    def _slices_of(self, indices: Sequence[int]) -> list[list[int]]:
        """The fan-out slices restricted to ``indices`` (a reset mask), empty ones dropped."""
        wanted = set(indices)
        parts = [[i for i in part if i in wanted] for part in self._slices]
        return [part for part in parts if part]

    def _fan_out(
        self,
        parts: list[list[int]],
        send: Callable[[int], None],
        recv: Callable[[int], Any],
    ) -> list[Future[_SliceOutcome] | _SliceOutcome]:
        """Run ``send`` then ``recv`` for each env of ``parts``; the first part runs inline."""
        futures: list[Future[_SliceOutcome] | _SliceOutcome] = [
            self._executor.submit(_run_slice, part, send, recv) for part in parts[1:]
        ]
        futures.insert(0, _run_slice(parts[0], send, recv))
        return futures

    def _gather(self, outcomes: list[Future[_SliceOutcome] | _SliceOutcome]) -> dict[int, Any]:
        futures = [o for o in outcomes if isinstance(o, Future)]
        if futures:
            wait_futures(futures)
        return self._collect(outcomes)

    def _collect(self, outcomes: Sequence[Future[_SliceOutcome] | _SliceOutcome]) -> dict[int, Any]:
        """Merge slice outcomes; raise the lowest env index's error after logging the others."""
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for outcome in outcomes:
            slice_results, slice_errors = (
                outcome.result() if isinstance(outcome, Future) else outcome
            )
            results.update(slice_results)
            errors.update(slice_errors)
        if errors:
            first, *others = sorted(errors)
            for env_index in others:
                logger.error("env %d: failed too: %s", env_index, errors[env_index])
            raise errors[first]
        return results

    def _map(self, call: Callable[[int], Any]) -> tuple[Any, ...]:
        self._check_idle("call")
        results = self._gather(self._fan_out(self._slices, lambda i: None, call))
        return tuple(results[i] for i in range(self.num_envs))


class _PartialInfos:
    """Merges the infos of a partial batch the Gymnasium way, with arrays of its own size."""

    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def _run_slice(
    indices: Sequence[int], send: Callable[[int], None], recv: Callable[[int], Any]
) -> _SliceOutcome:
    """Send to every env of the slice, then collect every reply; errors are kept per env."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    sent = []
    for i in indices:
        try:
            send(i)
            sent.append(i)
        except Exception as exc:  # noqa: BLE001 - re-raised by _collect, lowest env index first
            errors[i] = exc
    for i in sent:
        try:
            results[i] = recv(i)
        except Exception as exc:  # noqa: BLE001 - re-raised by _collect, lowest env index first
            errors[i] = exc
    return results, errors


def _check_ready(proxies: Sequence[Any]) -> None:
    for env_index, proxy in enumerate(proxies):
        if not hasattr(proxy, "send_step"):
            raise TypeError(
                f"env {env_index}: expected a SubprocessEnv (or another multienv proxy) or an "
                f"env factory, got {type(proxy).__name__}."
            )
        state = getattr(proxy, "state", EnvState.READY)
        if state is not EnvState.READY:
            raise EnvStateError(
                f"env {env_index}: is in state {state.name}; pass ready envs (start() and "
                "initialize() done, as create_subprocess_envs() returns them).",
                env_index=env_index,
            )
