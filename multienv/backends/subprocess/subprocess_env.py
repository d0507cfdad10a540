"""PARENT SIDE, subprocess backend: its public face, SubprocessEnv and create_subprocess_envs.

A ``SubprocessEnv`` is a ``RemoteEnv`` (``multienv.supervision.env_proxy``) on one ``ProcessHandle``
(``process_handle``) under a ``WorkerSupervisor`` (``supervisor``), whose
docstring holds the failure table. ``BACKEND`` registers this backend as ``"subprocess"``
(the ``multienv.backends`` entry point in setup.cfg).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.context import BaseContext
from typing import Any

import gymnasium as gym

from multienv.backends.subprocess.cpu_claims import Pin, plan_pins
from multienv.backends.subprocess.forking import module_server
from multienv.backends.subprocess.forking.forkserver import (
    forkserver_context,
    forkserver_thread_env,
)
from multienv.backends.subprocess.forking.module_server_process import MAX_SPARES
from multienv.backends.subprocess.process_handle import ProcessHandle
from multienv.backends.subprocess.process_launch import WorkerRecipe
from multienv.backends.subprocess.shm_link import open_subprocess_link
from multienv.errors import raised_here
from multienv.layout import Layout, choose_layout, is_auto
from multienv.placement import WorkerPlacement, placements_for
from multienv.recycle import RecyclePolicy
from multienv.restart import RestartPolicy
from multienv.supervision.env_proxy import RemoteEnv
from multienv.supervision.factory import create_envs, supervise
from multienv.supervision.handles import Backend
from multienv.supervision.lifecycle import EnvState
from multienv.supervision.options import (
    CLOSE_TIMEOUT_S,
    INIT_TIMEOUT_S,
    SupervisorOptions,
    check_options,
)
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.protocol import Command, StepCost
from multienv.wire.worker_settings import SPIN_S, WorkerSettings, check_spinners, parent_spins

EnvFn = Callable[[], gym.Env[Any, Any]]
logger = logging.getLogger("multienv")
MEASURE_BUDGET_S = 0.2  # how long envs_per_worker="auto" times env 0's steps
MEASURE_MAX_STEPS = 1000  # and how many steps at most


def resolve_context(
    context: BaseContext | str | None,
    preload: Sequence[str] = (),
    thread_env: Mapping[str, str] | None = None,
) -> BaseContext:
    """Return the multiprocessing context to start workers with.

    Args:
        context: A context, a start-method name, or None for the default: ``forkserver`` on
            Linux, where daemon workers fork from the module server (which imports numpy,
            gymnasium and the user's script once, so a respawn is a cheap fork; see
            ``module_server``), started here, and others from multiprocessing's
            forkserver; ``spawn`` elsewhere. ``fork`` is available on request; forking a
            parent whose threads hold locks can deadlock the child.
        preload: More modules for the fork sources to import; other start methods ignore it.
        thread_env: Thread-count variables for the fork sources to start with (see
            ``forkserver_context``); other start methods ignore it.
    """
    if isinstance(context, BaseContext):
        return context
    name = context or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    if name == "forkserver":
        resolved = forkserver_context(preload, thread_env)
        module_server.start()
        return resolved
    return multiprocessing.get_context(name)


def start_forkserver(
    preload: Sequence[str] = (), *, blas_threads: int | None = 1, spares: int = MAX_SPARES
) -> None:
    """Start the process workers fork from now, so that the first vector does not wait for it.

    Workers fork from a server process (``module_server``) that imports numpy,
    gymnasium, multienv's worker and your script once. It otherwise starts with the first
    vector; call this at the top of a training script (under ``if __name__ == "__main__":``)
    and its imports run while your script sets up. Idempotent; nothing happens at
    ``import multienv``. On a platform without forkserver (not Linux) it does nothing.

    Once a vector has started, the server also keeps spares: workers forked ahead of the
    next vector's, as many as the most workers one vector has had (``spares`` at most), so
    that later vectors, respawns and recycles do not wait for forks. It forks them after
    0.2 s without a request. Each spare holds 1 to 1.5 MiB of private memory while it
    waits (0.8 MiB on CPython 3.12), and no CPU. Spares stay after your vectors close
    (``ps`` shows them as ``multienv-spare``, beside ``multienv-server``), until this
    process exits: they exit with it, within 2 s even after a SIGKILL.

    Example:
        >>> import multienv
        >>> multienv.start_forkserver(preload=["gymnasium.envs.classic_control"])

    Args:
        preload: More modules for the server to import (an env's package, such as
            ``"ale_py"``), shared by every worker instead of imported by each.
        blas_threads: The thread count the server's BLAS/OpenMP pools are born with, as the
            vectors' ``blas_threads`` option; pass the value your vectors use.
        spares: The most spares the server keeps; 0 keeps none (and the memory they hold).

    Raises:
        ModuleNotFoundError: A module of ``preload`` is not installed.
    """
    if not sys.platform.startswith("linux"):
        return
    names = _checked_preload(preload, "start_forkserver()")
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ValueError(f"start_forkserver(): spares must be an int >= 0, got {spares!r}")
    settings = WorkerSettings.decide(blas_threads, None, 0)
    module_server.allow_spares(spares)
    resolve_context("forkserver", names, settings.thread_env)


def _checked_preload(preload: Sequence[str], owner: str) -> tuple[str, ...]:
    """Return the module names of ``preload``; raise, naming the env, if one is not installed."""
    is_collection = isinstance(preload, Iterable) and not isinstance(preload, str | bytes)
    names = tuple(preload) if is_collection else ()
    if not is_collection or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"{owner}: preload must be a list of module names, such as "
            f"['gymnasium.envs.classic_control'], got {preload!r}"
        )
    for name in names:
        top_level = name.partition(".")[0]
        if not top_level or importlib.util.find_spec(top_level) is None:
            raise ModuleNotFoundError(
                f"{owner}: preload names {name!r}, but no module {top_level!r} is installed"
            )
    return names


class SubprocessEnv(RemoteEnv):
    """A ``gymnasium.Env`` proxy whose env runs in a daemon worker process.

    Call ``start()`` (returns at once) then ``initialize()`` (waits for the env), or use
    ``create_subprocess_envs()``. What happens when the worker dies, hangs or raises is the
    failure table in ``multienv.supervision.supervisor``.

    Args:
        env_fn: Zero-argument callable returning a new gymnasium.Env (sent with cloudpickle).
        context: Multiprocessing context or start-method name; see ``resolve_context``.
        restart_policy: How many respawns are allowed, and how fast.
        step_timeout: Seconds a ``step`` may take before the worker is killed; None waits
            forever. A worker stepping k envs at once gets k times as long.
        reset_timeout: Seconds a ``reset`` may take before the worker is killed; None waits
            forever, and then a batch with a reset in it has no deadline at all (set both
            timeouts for a worker of several envs).
        init_timeout: Seconds a worker may take to build its envs before it is killed.
        restart_on_error: Treat an exception raised by env code as a death.
        recycle: When to replace a worker by a fresh one at an episode boundary (budgets
            of steps, episodes, memory), and when to kill it for its memory; see
            ``RecyclePolicy``. None (default) never recycles.
        close_timeout_s: Seconds ``close()`` waits for the worker to exit before killing it.
        env_index: Position of this env in its vector; used in messages and process names.
        preload: Names of modules for the module server to import before it forks workers,
            such as the env's package (``"ale_py"``), so that every worker shares their
            memory and a respawn does not import them again. Without it, the modules the
            first worker's envs import are shared by the workers started after it (see
            ``module_server``). The server starts once per process, so pass it to
            the first env a process starts; later ones log a warning. Other start methods
            ignore it.
        daemon: Start the worker as a daemon process (default). ``False`` lets env code
            start processes of its own; the worker still exits when this process dies.
        blas_threads: Threads per BLAS/OpenMP pool in the worker (``OMP_NUM_THREADS``,
            ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, and the pools already loaded),
            so that N workers do not start N full pools on the same cores. A variable set in
            this process's environment wins; None leaves the worker's pools as they are.
        pin_cpu: Pin the worker to one CPU, a free one first: a CPU is claimed for as long
            as its worker lives, machine-wide, so that other runs and vectors pin elsewhere
            (``cpu_claims``); beyond the free CPUs, round robin. None (default): a
            vector pins its workers only if each gets a free CPU of those this process may
            use, and else pins none (``create_subprocess_envs`` and ``MultiEnv`` decide); a
            lone ``SubprocessEnv`` is not pinned. See docs/performance.rst.
        wait: "sleep" (default): the worker sleeps until its next request. "spin": hot
            mode: after each answer it polls for the next request for 2 ms before it
            sleeps, so its core stays awake, and each worker keeps a core busy. Refused
            when the workers would outnumber the cores. When a vector's workers leave a
            core to spare, the parent polls for the workers' answers the same way, keeping
            that core busy too; see docs/performance.rst.
        placement: The worker's own environment variables and CPUs (``WorkerPlacement``),
            kept across respawns. ``create_subprocess_envs`` and ``MultiEnv`` also take a
            list of one per worker, or a function of the worker's index.
    """

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        context: BaseContext | str | None = None,
        restart_policy: RestartPolicy | None = None,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        init_timeout: float | None = INIT_TIMEOUT_S,
        restart_on_error: bool = False,
        recycle: RecyclePolicy | None = None,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        env_index: int = 0,
        preload: Sequence[str] = (),
        daemon: bool = True,
        blas_threads: int | None = 1,
        pin_cpu: bool | None = None,
        wait: str = "sleep",
        placement: WorkerPlacement | None = None,
    ) -> None:
        """Check the options and pickle ``env_fn``; no process is started yet."""
        supervision = SupervisorOptions(
            restart_policy=restart_policy,
            step_timeout=step_timeout,
            reset_timeout=reset_timeout,
            init_timeout=init_timeout,
            restart_on_error=restart_on_error,
            close_timeout_s=close_timeout_s,
            recycle=recycle,
        )
        options = SubprocessOptions(
            supervision,
            context=context,
            preload=preload,
            daemon=daemon,
            blas_threads=blas_threads,
            pin_cpu=pin_cpu,
            wait=wait,
            placement=placement,
        )
        super().__init__(_supervise([env_fn], env_index, options), 0)


@dataclasses.dataclass(frozen=True)
class SubprocessOptions:
    """Every option of a subprocess worker, typed; ``SubprocessEnv`` documents each.

    The public functions take them as keywords; ``of`` reads them once, where they enter
    the backend, and from there on they travel as this object.
    """

    supervision: SupervisorOptions = dataclasses.field(default_factory=SupervisorOptions)
    context: BaseContext | str | None = None
    preload: Sequence[str] = ()
    daemon: bool = True
    blas_threads: int | None = 1
    pin_cpu: bool | None = None
    wait: str = "sleep"
    placement: Any = None  # a WorkerPlacement, a list of one per worker, or a function

    @classmethod
    def of(cls, owner: str, options: Mapping[str, Any]) -> SubprocessOptions:
        """Read keyword ``options``; a TypeError, in ``owner``'s name, for an unknown one."""
        own = {field.name for field in dataclasses.fields(cls)} - {"supervision"}
        check_options(owner, options, own | SupervisorOptions.names())
        pin_cpu = options.get("pin_cpu")
        if not (pin_cpu is None or isinstance(pin_cpu, bool)):
            raise TypeError(f"pin_cpu must be True, False or None, got {pin_cpu!r}")
        return cls(
            SupervisorOptions.of(options),
            **{name: value for name, value in options.items() if name in own},
        )

    @property
    def is_served(self) -> bool:
        """Whether workers with these options fork from the module server (when it serves)."""
        context = self.context
        is_forkserver = context in (None, "forkserver") or (
            isinstance(context, BaseContext) and context.get_start_method() == "forkserver"
        )
        return bool(is_forkserver and sys.platform.startswith("linux") and self.daemon)


def _supervise(
    env_fns: Sequence[EnvFn],
    first_env_index: int,
    options: SubprocessOptions,
    *,
    is_probe: bool = False,
    parent_spin: bool = False,
    pin: Pin | None = None,
    placement: WorkerPlacement | None = None,
) -> WorkerSupervisor:
    """Check the options, pickle the factories and build one worker's handle and supervisor.

    ``parent_spin``: the handle polls for ``SPIN_S`` before it sleeps on the worker (a hot
    vector's choice, ``parent_spins``). ``pin``: the worker's CPU, as its vector planned it;
    a lone worker with ``pin_cpu=True`` claims one. ``placement``: the worker's own, as its
    vector resolved it; a lone worker's is ``options.placement``.
    """
    preload_names = _checked_preload(options.preload, f"env {first_env_index}")
    if placement is None and options.placement is not None:
        placement = placements_for(options.placement, 1)[0]
    own_env = {} if placement is None else dict(placement.env)
    environ = {**os.environ, **own_env}  # its own thread variables win, as the user's do
    # Checked before a lone worker claims its CPU, which a bad option would leave held.
    settings = WorkerSettings.decide(
        options.blas_threads, None, first_env_index, environ, wait=options.wait
    )
    options.supervision.check(first_env_index)
    if placement is not None:
        if placement.cpus is not None and options.pin_cpu:
            raise ValueError(
                f"env {first_env_index}: pin_cpu=True and WorkerPlacement.cpus both place "
                "the worker; pass one of them"
            )
        cpus = None if placement.cpus is None else tuple(placement.cpus)
        settings = dataclasses.replace(settings, extra_env=own_env, cpus=cpus)
    if pin is None and options.pin_cpu:
        pin = plan_pins(True, 1)[0]
    if pin is not None:
        settings = dataclasses.replace(settings, cpu=pin.cpu)
    cpu_claim = None if pin is None else pin.claim

    def make_handle(env_fn_bytes: list[bytes]) -> ProcessHandle:
        # After the options are checked and the factories pickled: may start the server.
        resolved = resolve_context(options.context, preload_names, settings.thread_env)
        # Pools born the right size in the forkserver need no resizing in its workers.
        is_forkserver = resolved.get_start_method() == "forkserver"
        born_with = (forkserver_thread_env() or {}) if is_forkserver else {}
        worker_settings = settings.for_fork_from(born_with, environ)
        recipe = WorkerRecipe(
            resolved, env_fn_bytes, first_env_index, options.daemon, worker_settings, is_probe
        )
        return ProcessHandle(recipe, spin_s=SPIN_S if parent_spin else 0.0, cpu_claim=cpu_claim)

    return supervise(env_fns, first_env_index, make_handle, BACKEND, options.supervision)


@raised_here
def create_subprocess_envs(
    env_fns: Sequence[EnvFn], *, envs_per_worker: int | str = 1, **keywords: Any
) -> list[SubprocessEnv]:
    """Start the workers, then initialize them all in parallel; return one proxy per env.

    Args:
        env_fns: Zero-argument callables returning a new gymnasium.Env (sent with cloudpickle).
        envs_per_worker: How many envs each worker process hosts: env i lives in worker
            ``i // envs_per_worker``. 1 (default) gives each env its own process; more steps
            cheap envs faster, and one worker's death truncates each of its envs.
            ``"auto"`` times env 0 in a probe worker and chooses for this machine
            (``auto_layout``; the choice is logged at INFO).
        **keywords: Keyword options of ``SubprocessEnv``, applied to every env.

    With more workers than cores (forkserver, daemon workers), env 0's factory runs once
    more, first, in a probe worker that reports the modules it imports and exits, so that
    every worker forks from a server that has imported them (``module_server``),
    as ``AsyncVectorEnv`` builds a dummy env in its parent.

    Raises:
        TypeError: An env_fn cannot be pickled; nothing was started.
        EnvError: An env_fn raised in its worker; all proxies are closed first.
        EnvCrashLoopError: A worker kept failing to start; all proxies are closed first.
    """
    if "env_index" in keywords:
        raise TypeError("create_subprocess_envs() numbers the envs itself; do not pass env_index")
    options = SubprocessOptions.of("create_subprocess_envs", keywords)
    if is_auto(envs_per_worker, "create_subprocess_envs"):
        envs_per_worker = _auto_layout(env_fns, options).envs_per_worker
    assert not isinstance(envs_per_worker, str)  # is_auto raised for any other str
    probe = parent_spin = False
    num_workers = 0
    pins: list[Pin | None] = []
    placements: list[WorkerPlacement | None] = []
    if (
        not isinstance(envs_per_worker, bool)
        and isinstance(envs_per_worker, int)
        and envs_per_worker > 0
    ):
        num_workers = -(-len(env_fns) // envs_per_worker)
        check_spinners(options.wait, num_workers)
        parent_spin = parent_spins(options.wait, num_workers)
        probe = bool(env_fns) and _should_probe(num_workers, options)
        placements = placements_for(options.placement, num_workers, envs_per_worker)
        placed = [p for p in placements if p is not None and p.cpus is not None]
        if placed and options.pin_cpu:
            raise ValueError(
                "pin_cpu=True and WorkerPlacement.cpus both place the workers; pass one of them"
            )
        # One free CPU each, claimed machine-wide (cpu_claims); after the checks above.
        # Workers placed on CPUs of the user's choice are not pinned, and claim none.
        pins = [] if placed else plan_pins(options.pin_cpu, num_workers)

    def supervise_worker(fns: Sequence[EnvFn], first: int) -> WorkerSupervisor:
        number = first // envs_per_worker
        pin = pins[number] if pins else None
        placement = placements[number] if placements else None
        return _supervise(
            fns, first, options, parent_spin=parent_spin, pin=pin, placement=placement
        )

    def start_module_server() -> None:  # before the workers: they fork from it
        _run_probe(env_fns[0], options, placements[0])

    try:
        envs = create_envs(
            env_fns,
            envs_per_worker,
            supervise_worker,
            SubprocessEnv,
            "create_subprocess_envs",
            before_start=start_module_server if probe else None,
        )
    except BaseException:
        for pin in pins:  # the CPUs are free again at once, not when the error is collected
            if pin is not None and pin.claim is not None:
                pin.claim.release()
        raise
    if options.is_served:  # the next vector's workers need not wait for forks
        module_server.keep_spares(num_workers)
    return envs


def _run_probe(
    env_fn: EnvFn,
    options: SubprocessOptions,
    placement: WorkerPlacement | None,
    is_measured: bool = False,
) -> StepCost | None:
    """Build env 0 alone in a probe worker; time its steps if ``is_measured``; close it.

    When the module server has not started yet, the probe's report starts it: every worker
    of the vector then forks from the server, and none imports the env's modules into
    memory of its own. An env_fn that fails fails here, as it would in its worker.
    ``placement``: worker 0's, under which env 0 is built.
    """
    unpinned = dataclasses.replace(options, pin_cpu=False)
    is_probe = options.is_served and not module_server.has_tried()
    supervisor = _supervise([env_fn], 0, unpinned, is_probe=is_probe, placement=placement)
    try:
        supervisor.start()
        supervisor.initialize()
        if not is_measured:
            return None
        # Deadline: the budget in steps, the step past it, the first reset and the last.
        step_timeout = options.supervision.step_timeout
        steps = 1 + (math.ceil(MEASURE_BUDGET_S / step_timeout) if step_timeout else 0)
        measure = (MEASURE_BUDGET_S, MEASURE_MAX_STEPS)
        cost: StepCost = supervisor.request(0, Command.MEASURE, measure, steps, resets=2)
        return cost
    finally:
        supervisor.close(timeout=1.0)


def auto_layout(env_fns: Sequence[EnvFn], **keywords: Any) -> Layout:
    """The layout ``envs_per_worker="auto"`` picks for these envs on this machine.

    Env 0 is built once more, in a probe worker, whose step and reset are timed there
    (about 0.2 s); ``layout.choose_layout`` weighs that cost against the cores this process
    may use. The choice and its reason are logged at INFO.

    Args:
        env_fns: The vector's env factories.
        **keywords: The vector's ``SubprocessEnv`` options: hot mode (``wait="spin"``) and
            ``pin_cpu=True`` keep the workers to one per core at most.
    """
    options = SubprocessOptions.of("auto_layout", keywords)
    return _auto_layout(env_fns, options)


def _auto_layout(env_fns: Sequence[EnvFn], options: SubprocessOptions) -> Layout:
    if not env_fns:
        raise ValueError("envs_per_worker='auto' needs at least one env factory, got none")
    placement = options.placement
    if isinstance(placement, Sequence) and not isinstance(placement, str | bytes):
        raise ValueError(
            "envs_per_worker='auto' chooses how many workers there are: give placement as "
            "one WorkerPlacement or a function of the worker's index, not a list"
        )
    cost = _run_probe(env_fns[0], options, placements_for(placement, 1)[0], is_measured=True)
    assert cost is not None
    may_oversubscribe = options.wait != "spin" and options.pin_cpu is not True
    cores = len(os.sched_getaffinity(0))
    layout = choose_layout(
        len(env_fns),
        cores,
        cost.step_s,
        cost.reset_s,
        may_oversubscribe,
        cost.step_cpu_s,
        cost.blocked_share,
    )
    logger.info("envs_per_worker='auto': %s", layout.reason)
    return layout


def _should_probe(num_workers: int, options: SubprocessOptions) -> bool:
    """Whether a probe worker builds env 0 first, so that its modules reach every worker.

    When the workers outnumber the cores, their imports would queue for the cores anyway;
    importing them once in the module server (after the probe reports them) makes the
    workers both share them and start sooner. With as many workers as cores or fewer, all
    start at once, and the server imports them before it forks the next worker.
    """
    return (
        options.is_served
        and not module_server.has_tried()
        and num_workers > len(os.sched_getaffinity(0))
    )


BACKEND = Backend.of(
    "subprocess", create_subprocess_envs, open_subprocess_link, SubprocessEnv, auto_layout
)

__all__ = [
    "BACKEND",
    "EnvFn",
    "EnvState",
    "SubprocessEnv",
    "SubprocessOptions",
    "auto_layout",
    "create_subprocess_envs",
    "resolve_context",
    "start_forkserver",
]
