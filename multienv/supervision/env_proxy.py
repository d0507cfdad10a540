"""PARENT SIDE, backend-neutral: ``RemoteEnv``, the ``gymnasium.Env`` face of one remote env.

Each env of a worker has one proxy. It addresses its env by its position in the worker and
delegates everything to the worker's ``WorkerSupervisor`` (``supervisor``), whose
docstring holds the failure table; its counters are read from the supervisor's
``WorkerStats``. Backends subclass it (``SubprocessEnv``, ``RayEnv``) to add a constructor.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ClosedEnvironmentError

from multienv.errors import EnvStateError, raised_here
from multienv.supervision.lifecycle import EnvState
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.protocol import Batch, BatchResult, Command, EnvDescription, EnvSnapshot


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
        self._is_closed = False
        self._sent: str | None = None  # "step" or "reset": what send_*() sent, for recv_*()
        # Dropped unclosed (collected, or alive at exit), the proxy kills its worker without
        # waiting; close(), or a vector that adopts the proxy, detaches this.
        self._finalizer = weakref.finalize(
            self,
            abandon_workers,
            [supervisor],
            f"{type(self).__name__}(env {supervisor.env_indices[position]})",
            position,
        )

    @property
    def supervisor(self) -> WorkerSupervisor:
        """The supervisor of the worker hosting this env."""
        return self._supervisor

    @property
    def env_index(self) -> int:
        """This env's index in its vector (the supervisor's numbering)."""
        return self._supervisor.env_indices[self.position]

    @property
    def steps(self) -> int:
        """Steps this env has returned (crash truncations included)."""
        stats = self._supervisor.stats
        stats.flush()
        return int(stats.steps[self.position])

    @property
    def episodes(self) -> int:
        """Episodes of this env that ended (terminated or truncated)."""
        stats = self._supervisor.stats
        stats.flush()
        return int(stats.episodes[self.position])

    @property
    def restarts(self) -> int:
        """Times this env's worker was respawned after a death."""
        return self._supervisor.stats.restarts

    @property
    def recycles(self) -> int:
        """Times this env's worker was replaced at an episode boundary."""
        return self._supervisor.stats.recycles

    @property
    def last_failure(self) -> str | None:
        """The cause of the last death of this env's worker, if any."""
        return self._supervisor.stats.last_failure

    @property
    def step_latencies_s(self) -> deque[float]:
        """Recent round-trip times of the steps of this env's worker, in seconds."""
        return deque(self._supervisor.stats.latencies().tolist())

    @property
    def pid(self) -> int | None:
        """Process id of the worker hosting this env; None before ``start()``."""
        return self._supervisor.handle.pid

    @property
    def state(self) -> EnvState:
        """Where this env is in its lifecycle (its worker's, until it is closed)."""
        return EnvState.CLOSED if self._is_closed else self._supervisor.state

    @raised_here
    def start(self) -> None:
        """Launch the worker, which starts building the env; returns without waiting."""
        self._check_open("start")
        self._supervisor.start()

    @raised_here
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
        self._finalizer.detach()
        self._supervisor.close_env(self.position, timeout)

    def detach_finalizer(self) -> None:
        """A vector adopted this proxy: the vector's finalizer kills the worker if dropped."""
        self._finalizer.detach()

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

    def get_state(self) -> Any:
        """The env's state: what its own ``get_state()`` returns, else an ``EnvSnapshot``."""
        return self._request(Command.GET_STATE, None)

    def set_state(self, state: Any) -> None:
        """Restore a state of ``get_state()`` (replayed on a fresh worker if it dies)."""
        check_state(state, self._supervisor.descriptions[self.position], self.env_index)
        self._request(Command.SET_STATE, state)

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


def abandon_workers(
    supervisors: Sequence[WorkerSupervisor], name: str, position: int | None = None
) -> None:
    """Kill the workers of a vector or proxy dropped without ``close()``, and warn.

    A ``weakref.finalize`` callback: it runs from the garbage collector, in whatever thread
    triggered it, or at exit, so it takes no lock, starts no thread and waits for nothing
    (``WorkerSupervisor.abandon``). The workers' envs are not closed. ``position``: a
    proxy's env, whose worker goes only once none of its envs is open.
    """
    if position is not None:
        is_killed = any([supervisor.abandon_env(position) for supervisor in supervisors])
    else:
        is_killed = any([supervisor.abandon() for supervisor in supervisors])
    if is_killed:
        warnings.warn(
            f"unclosed {name}: its workers were killed; close it with close() or a with "
            "block, so that its envs close too",
            ResourceWarning,
            stacklevel=1,  # no caller to name: the collector or the exit runs it
        )


def check_state(state: Any, description: EnvDescription, env_index: int) -> None:
    """Raise, naming the env, if it cannot take ``state``.

    It cannot take a snapshot of another class, nor a raw value when it has no
    ``get_state()``/``set_state()`` of its own.
    """
    if isinstance(state, EnvSnapshot):
        if state.env_type != description.env_type:
            raise ValueError(
                f"env {env_index}: the state is of a {state.env_type} env; this env is a "
                f"{description.env_type}."
            )
    elif not description.has_own_state:
        raise TypeError(
            f"env {env_index}: the state is a {type(state).__name__}, not a state from "
            "get_states(); this env has no get_state()/set_state() of its own."
        )


_TRUE = np.ones(1, dtype=np.bool_)
_FALSE = np.zeros(1, dtype=np.bool_)
