"""PARENT SIDE, Ray backend: envs in Ray actors, k per actor, under the same failure table.

``ActorHandle`` is the transport to one Ray actor (``ray_worker.MultienvWorker``)
hosting k envs: it creates the actor, sends it pickled requests as Ray tasks, waits for the
reply or the actor's death with ``ray.wait`` up to the call's deadline (then kills it), and
kills it. The supervisor of ``multienv.supervision.supervisor`` does the rest, as for a subprocess.

Actors are created with ``max_restarts=0`` and ``max_task_retries=0``: Ray's own restart
re-runs the constructor and would replay queued steps onto a fresh, un-reset env, splicing
episodes. The supervisor respawns a dead actor itself, under the ``RestartPolicy``.

Ray is imported only when this backend is used; ``RayOptions`` needs no Ray to be built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.error import ClosedEnvironmentError

from multienv.recycle import RecyclePolicy
from multienv.restart import RestartPolicy
from multienv.supervision.env_proxy import RemoteEnv
from multienv.supervision.factory import create_envs, supervise
from multienv.supervision.handles import Backend, Death, VectorLink, WorkerHandle
from multienv.supervision.options import (
    CLOSE_TIMEOUT_S,
    INIT_TIMEOUT_S,
    SupervisorOptions,
    check_options,
)
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.framing import decode, encode
from multienv.wire.protocol import (
    Batch,
    BatchResult,
    Command,
    Reply,
    Request,
    failed_batch,
    unpack_outcomes,
)

logger = logging.getLogger(__name__)

EnvFn = Callable[[], gym.Env[Any, Any]]
_REAP_TIMEOUT_S = 5.0  # how long kill() waits for a local actor process to be gone
_RETIRE_TIMEOUT_S = 5.0  # a retired actor may take this long to close its envs
_RSS_TIMEOUT_S = 5.0  # to answer how much memory it holds
_init_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Where and how the Ray backend runs its actors.

    Attributes:
        address: The cluster to use when Ray is not initialized yet in this process: None
            (default) takes ``RAY_ADDRESS`` or the cluster ``ray start`` runs on this
            machine, and starts a local one if there is neither; ``"auto"`` requires an
            existing cluster; ``"local"`` always starts a new one. If the program called
            ``ray.init()`` itself, that connection is used and this is ignored.
        num_cpus: CPUs each actor reserves; None (default) uses Ray's default for actors,
            which reserves none while running, so any number of actors fits on a node.
            An actor whose reservation no node can meet waits, up to ``init_timeout``.
        resources: Custom resources each actor reserves, such as ``{"emulator": 1}``.
        scheduling_strategy: Where actors go: ``"SPREAD"``, ``"DEFAULT"``, or a Ray strategy
            object (a placement group or node affinity strategy).
        actor_options: Further ``ActorClass.options()`` keywords (``runtime_env``,
            ``memory``, ...). ``max_restarts`` and ``max_task_retries`` are not allowed:
            multienv restarts actors itself.
        init_kwargs: Further ``ray.init()`` keywords, used only when multienv initializes Ray.
    """

    address: str | None = None
    num_cpus: float | None = None
    resources: dict[str, float] | None = None
    scheduling_strategy: Any = None
    actor_options: dict[str, Any] | None = None
    init_kwargs: dict[str, Any] | None = None

    def actor_class_options(self) -> dict[str, Any]:
        """The ``ActorClass.options()`` keywords of one worker's actor."""
        extra = dict(self.actor_options or {})
        for name in ("max_restarts", "max_task_retries"):
            if name in extra:
                raise ValueError(
                    f"RayOptions.actor_options may not set {name}: multienv replaces dead "
                    "actors itself, since Ray's restart would splice episodes."
                )
        options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0, **extra}
        if self.num_cpus is not None:
            options["num_cpus"] = self.num_cpus
        if self.resources is not None:
            options["resources"] = dict(self.resources)
        if self.scheduling_strategy is not None:
            options["scheduling_strategy"] = self.scheduling_strategy
        return options


def _ray() -> Any:
    """The ``ray`` module, imported now, with a clear error if the extra is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'backend="ray" needs Ray: pip install "multienv[ray]" (or pip install ray).'
        ) from exc
    return ray


def ensure_ray(options: RayOptions) -> Any:
    """Import Ray, initialize it if this process has not (see ``RayOptions.address``)."""
    ray = _ray()
    with _init_lock:
        if not ray.is_initialized():
            ray.init(address=options.address, **(options.init_kwargs or {}))
            context = ray.get_runtime_context()
            logger.info(
                "Ray initialized: node %s, gcs %s", context.get_node_id(), context.gcs_address
            )
    return ray


@functools.cache
def _actor_class() -> Any:
    """``MultienvWorker`` as a Ray actor class, made on first use."""
    from multienv.backends.ray.ray_worker import MultienvWorker

    return _ray().remote(MultienvWorker)


def death_cause(error: BaseException) -> str:
    """A short cause for a Ray error that means the actor is gone."""
    text = str(error)
    if "ray.kill" in text:
        return "ray.kill"
    if re.search(r"node .*(died|dead|removed)|node (was )?lost|NODE_DIED", text, re.IGNORECASE):
        return "node lost"
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    if exit_type is not None:
        return f"actor process died ({exit_type.group(1)})"
    return f"actor died ({type(error).__name__})"


class ActorHandle:
    """The transport to one Ray actor hosting k envs (``WorkerHandle``).

    Args:
        env_fn_bytes: The cloudpickled factories of the actor's envs, by position.
        env_index: The index of the actor's first env, for messages.
        options: Where and how to create the actor.
    """

    def __init__(self, env_fn_bytes: Sequence[bytes], env_index: int, options: RayOptions) -> None:
        """Keep what a spawn needs; no actor is created yet."""
        self._env_fn_bytes = list(env_fn_bytes)
        self._env_index = env_index
        self._options = options
        self._actor_options = options.actor_class_options()
        self._actor: Any = None
        self._pid: int | None = None
        self._node_id: str | None = None
        self.in_flight: Any = None  # the ObjectRef of the call in flight
        self._batch: Batch | None = None
        self._tail: tuple[str, ...] = ()
        self._is_closing = threading.Event()
        self._is_abandoned = False  # set by abandon(), which may not take the Event's lock
        self._standby: tuple[Any, Any] | None = None  # (actor, its build ref), started ahead
        self._reapers: list[threading.Thread] = []  # closing retired actors

    @property
    def pid(self) -> int | None:
        """Process id of the current actor on its node; None until its envs are built."""
        return self._pid

    @property
    def node_id(self) -> str | None:
        """Ray's id of the node the current actor runs on; None until its envs are built."""
        return self._node_id

    def stderr_tail(self) -> tuple[str, ...]:
        """Ray's account of the last actor death (its worker logs stay in Ray's log folder)."""
        return self._tail

    # ----------------------------------------------------------------- actor

    def spawn(self, *, is_quiet: bool = False) -> None:
        """Create a new actor (or take the standby) building its envs; returns without waiting.

        ``is_quiet`` changes nothing here: Ray forwards its actors' output itself.
        """
        self._forget()
        self._pid = self._node_id = None
        self._actor, self.in_flight = self._standby or self._launch()
        self._standby = None

    def prestart(self) -> None:
        """Create a standby actor, which the next ``spawn()`` takes over; idempotent."""
        if self._standby is None and not self._is_closing.is_set():
            self._standby = self._launch()

    def retire(self) -> None:
        """Ask the current actor to close its envs, then kill it, on a background thread."""
        actor, local_pid = self._detach()
        if actor is None:
            return
        reaper = threading.Thread(
            target=_close_and_kill,
            args=(actor, self._env_index, _RETIRE_TIMEOUT_S, local_pid),
            name=f"multienv-retire-{self._env_index}",
            daemon=True,
        )
        reaper.start()
        self._reapers = [thread for thread in self._reapers if thread.is_alive()]
        self._reapers.append(reaper)

    def rss_mb(self) -> float | None:
        """Resident memory of the current actor's process in MiB (asked of the actor)."""
        if self._actor is None:
            return None
        ray = _ray()
        try:
            value: float | None = ray.get(self._actor.rss_mb.remote(), timeout=_RSS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - dead or busy: the next call will tell
            logger.debug("env %d: rss_mb: %s", self._env_index, exc)
            return None
        return value

    def _launch(self) -> tuple[Any, Any]:
        ensure_ray(self._options)
        actor = _actor_class().options(**self._actor_options).remote(self._env_fn_bytes)
        logger.info("env %d: created a Ray actor", self._env_index)
        return actor, actor.build.remote()

    def handshake(self, deadline: float | None) -> Reply | Death:
        """Wait for the actor's envs (an actor no node can host waits until ``deadline``)."""
        value = self._wait(deadline)
        if isinstance(value, Death):
            if value.cause == "timeout":
                return Death("init timeout: no node could place the actor, or its envs were slow")
            return value
        self._pid, self._node_id, reply_bytes = value
        reply: Reply = decode(reply_bytes)
        if reply.failure is not None:
            self.kill()  # as a subprocess worker exits when an env_fn raises
        else:
            logger.info("env %d: Ray actor pid %d ready", self._env_index, self._pid)
        return reply

    def kill(self) -> None:
        """Kill the actor at once and wait (a few seconds at most) for its process to go."""
        actor, local_pid = self._detach()
        if actor is not None:
            _close_and_kill(actor, self._env_index, 0.0, local_pid)

    def stop(self, timeout_s: float) -> None:
        """Ask the actor to close its envs, then kill it; bounded by ``timeout_s``. Idempotent.

        A standby actor is killed too, and retired actors are waited for.
        """
        self._is_closing.set()
        standby, self._standby = self._standby, None
        if standby is not None:
            _close_and_kill(standby[0], self._env_index, 0.0)
        for reaper in self._reapers:
            reaper.join(timeout_s + _REAP_TIMEOUT_S)
        self._reapers.clear()
        is_built = self._pid is not None  # an actor still building its envs is just killed
        actor, local_pid = self._detach()
        if actor is not None:
            _close_and_kill(actor, self._env_index, timeout_s if is_built else 0.0, local_pid)

    def abandon(self) -> None:
        """Kill the actor and the standby without waiting (``WorkerHandle``); Ray reaps them."""
        self._is_abandoned = True
        standby, self._standby = self._standby, None
        actor = self._actor
        self._forget()
        for dropped in (actor, None if standby is None else standby[0]):
            if dropped is not None:
                try:
                    _ray().kill(dropped, no_restart=True)
                except Exception as exc:  # noqa: BLE001 - already gone, or Ray shut down
                    logger.debug("env %d: ray.kill: %s", self._env_index, exc)

    def _detach(self) -> tuple[Any, int | None]:
        """Forget the current actor; return it, and its pid when it runs on this node."""
        actor, pid = self._actor, self._pid
        self._forget()
        if actor is None or pid is None:
            return actor, None
        is_local = self._node_id == _ray().get_runtime_context().get_node_id()
        return actor, pid if is_local else None

    def _forget(self) -> None:
        """Drop the current actor; its pid stays readable until the next spawn."""
        self._actor = self.in_flight = self._batch = None

    # ----------------------------------------------------------------- calls

    def submit(self, request: Request) -> None:
        """Send one pickled call as a task of the actor."""
        self._batch = None
        self.in_flight = self._actor.serve.remote(encode(request))

    def collect(self, deadline: float | None) -> Reply | Death:
        """Wait for the call's reply, the actor's death, or the deadline (then kill it)."""
        value = self._wait(deadline)
        return value if isinstance(value, Death) else decode(value)

    def submit_batch(self, batch: Batch) -> None:
        """Send the steps and resets of some of the actor's envs as one task."""
        self.submit(Request(Command.BATCH, -1, batch.orders()))
        self._batch = batch

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        """Wait for the batch's outcomes, or the actor's death."""
        batch = self._batch
        reply = self.collect(deadline)
        if isinstance(reply, Death):
            return reply
        assert batch is not None
        if reply.failure is not None:
            return failed_batch(len(batch.positions), reply.failure, has_obs=True)
        return unpack_outcomes(reply.value)

    # ----------------------------------------------------------------- internals

    def _closed_while_waiting(self) -> ClosedEnvironmentError:
        return ClosedEnvironmentError(f"env {self._env_index}: closed while a call was waiting.")

    def _wait(self, deadline: float | None) -> Any:
        """The value of the call in flight, or the actor's death (a timeout kills it)."""
        ray, ref = _ray(), self.in_flight
        if ref is None:
            if self._is_closing.is_set() or self._is_abandoned:  # dropped the call: no death
                raise self._closed_while_waiting()
            return Death("unknown")
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            value = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            value = Death("timeout")
        except ray.exceptions.RayError as exc:  # the actor, its process or its node is gone
            self._tail = tuple(str(exc).splitlines())
            logger.debug("env %d: Ray actor pid %s: %s", self._env_index, self._pid, exc)
            value = Death(death_cause(exc))
        if self._is_closing.is_set() or self._is_abandoned:
            raise self._closed_while_waiting()
        self.in_flight = None
        if isinstance(value, Death) and value.cause == "timeout":
            logger.info(  # the supervisor logs the death at WARNING
                "env %d: Ray actor pid %s timed out; killing it", self._env_index, self._pid
            )
            self.kill()
        return value


def _close_and_kill(
    actor: Any, env_index: int, timeout_s: float, local_pid: int | None = None
) -> None:
    """Let an actor close its envs (up to ``timeout_s``), kill it, wait for a local one to go."""
    ray = _ray()
    if timeout_s > 0:
        try:
            ray.wait([actor.close.remote()], timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the actor is dead or Ray is gone
            logger.debug("env %d: close: %s", env_index, exc)
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - already gone, or Ray shut down
        logger.debug("env %d: ray.kill: %s", env_index, exc)
        return
    if local_pid is not None:
        _wait_gone(local_pid, _REAP_TIMEOUT_S)


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until the local process ``pid`` has exited (Ray reaps its own workers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.01)


def open_ray_link(
    handles: Sequence[WorkerHandle],
    spaces: tuple[gym.Space[Any], gym.Space[Any]],
    env_indices: Sequence[Sequence[int]],
    slices: Sequence[Sequence[int]],
    shared_memory: bool | None,
) -> VectorLink:
    """Link ``handles`` into one vector: a multi-wait over their actors (``OpenLink``).

    Nothing is shared with the actors, so the spaces, the layout and ``shared_memory`` do
    not matter here.
    """
    if not all(isinstance(handle, ActorHandle) for handle in handles):
        raise TypeError("a vector's envs must all use the same backend")
    return RayLink()


class RayLink:
    """A vector's multi-wait over its actors; nothing is shared and no step is planned."""

    def wait_any(
        self,
        handles: Sequence[WorkerHandle],
        deadlines: Sequence[float | None],
        timeout: float | None,
    ) -> list[int]:
        """Wait until some of ``handles`` can be collected without blocking; see VectorLink."""
        ray = _ray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            ready: list[int] = []
            owner: dict[Any, int] = {}
            wait_until = deadline
            for position, handle in enumerate(handles):
                assert isinstance(handle, ActorHandle)
                handle_deadline = deadlines[position]
                if handle.in_flight is None or (
                    handle_deadline is not None and handle_deadline <= now
                ):
                    ready.append(position)
                    continue
                if handle_deadline is not None:
                    wait_until = (
                        handle_deadline if wait_until is None else min(wait_until, handle_deadline)
                    )
                owner[handle.in_flight] = position
            if ready:
                return ready
            wait_s = None if wait_until is None else max(0.0, wait_until - now)
            done, _ = ray.wait(list(owner), num_returns=1, timeout=wait_s)
            if done:
                done, _ = ray.wait(list(owner), num_returns=len(owner), timeout=0)
                return sorted(owner[ref] for ref in done)
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        """Nothing to release."""


# ---------------------------------------------------------------- public API


class RayEnv(RemoteEnv):
    """A ``gymnasium.Env`` proxy whose env runs in a Ray actor.

    Call ``start()`` (returns at once) then ``initialize()`` (waits for the env), or use
    ``create_ray_envs()``. The failure table is that of ``supervisor``: an actor that is
    killed, whose process dies or whose node is lost comes back as flagged truncations,
    and is replaced by a new actor.

    Args:
        env_fn: Zero-argument callable returning a new gymnasium.Env (sent with cloudpickle).
        ray_options: Where and how to run the actor; see ``RayOptions``.
        restart_policy: How many respawns are allowed, and how fast.
        step_timeout: Seconds a ``step`` may take before the actor is killed; None waits
            forever. An actor stepping k envs at once gets k times as long.
        reset_timeout: Seconds a ``reset`` may take before the actor is killed.
        init_timeout: Seconds an actor may take to be placed and build its envs (an actor
            that no node has room for waits this long) before it is killed.
        restart_on_error: Treat an exception raised by env code as a death.
        recycle: When to replace a worker by a fresh one at an episode boundary (budgets
            of steps, episodes, memory), and when to kill it for its memory; see
            ``RecyclePolicy``. None (default) never recycles.
        close_timeout_s: Seconds ``close()`` waits for the envs to close before the kill.
        env_index: Position of this env in its vector; used in messages.
    """

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        ray_options: RayOptions | None = None,
        restart_policy: RestartPolicy | None = None,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        init_timeout: float | None = INIT_TIMEOUT_S,
        restart_on_error: bool = False,
        recycle: RecyclePolicy | None = None,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        env_index: int = 0,
    ) -> None:
        """Check the options and pickle ``env_fn``; no actor is created yet."""
        supervision = SupervisorOptions(
            restart_policy=restart_policy,
            step_timeout=step_timeout,
            reset_timeout=reset_timeout,
            init_timeout=init_timeout,
            restart_on_error=restart_on_error,
            close_timeout_s=close_timeout_s,
            recycle=recycle,
        )
        super().__init__(_supervise([env_fn], env_index, ray_options, supervision), 0)


def _supervise(
    env_fns: Sequence[EnvFn],
    first_env_index: int,
    ray_options: RayOptions | None,
    supervision: SupervisorOptions,
) -> WorkerSupervisor:
    """Check the options, pickle the factories and build one actor's handle and supervisor."""
    options = ray_options if ray_options is not None else RayOptions()
    if not isinstance(options, RayOptions):
        raise TypeError(
            f"env {first_env_index}: ray_options must be a multienv.RayOptions, "
            f"got {type(options).__name__}"
        )
    return supervise(
        env_fns,
        first_env_index,
        lambda env_fn_bytes: ActorHandle(env_fn_bytes, first_env_index, options),
        BACKEND,
        supervision,
    )


def create_ray_envs(
    env_fns: Sequence[EnvFn], *, envs_per_worker: int = 1, **keywords: Any
) -> list[RayEnv]:
    """Create the actors, then initialize them all in parallel; return one proxy per env.

    Ray is initialized first if this process has not done it (see ``RayOptions.address``).

    Args:
        env_fns: Zero-argument callables returning a new gymnasium.Env (sent with cloudpickle).
        envs_per_worker: How many envs each actor hosts: env i lives in actor
            ``i // envs_per_worker``. A Ray call costs far more than a pipe's, so more envs
            per actor pay off sooner than on subprocesses; one actor's death truncates
            each of its envs.
        **keywords: Keyword options of ``RayEnv`` (``ray_options`` among them), applied to
            every env.

    Raises:
        TypeError: An env_fn cannot be pickled; nothing was started.
        EnvError: An env_fn raised in its actor; all proxies are closed first.
        EnvCrashLoopError: An actor kept failing to start (or to be placed); all proxies
            are closed first.
    """
    if "env_index" in keywords:
        raise TypeError("create_ray_envs() numbers the envs itself; do not pass env_index")
    check_options("create_ray_envs", keywords, SupervisorOptions.names() | {"ray_options"})
    ray_options = keywords.get("ray_options")
    supervision = SupervisorOptions.of(keywords)
    ensure_ray(ray_options or RayOptions())
    return create_envs(
        env_fns,
        envs_per_worker,
        lambda fns, first: _supervise(fns, first, ray_options, supervision),
        RayEnv,
        "create_ray_envs",
    )


BACKEND = Backend.of("ray", create_ray_envs, open_ray_link, RayEnv)

__all__ = [
    "BACKEND",
    "ActorHandle",
    "RayEnv",
    "RayLink",
    "RayOptions",
    "create_ray_envs",
    "ensure_ray",
]
