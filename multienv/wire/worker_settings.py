"""BOTH SIDES: a worker process's settings: BLAS/OpenMP threads, CPU pinning, how it waits.

Every worker that imports numpy or torch would start a full BLAS/OpenMP thread pool; with
16 workers on 2 cores that oversubscription silently slows every step. So by default a
worker runs one thread per pool. The parent decides (``WorkerSettings.decide``): the
user's own ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` win, and
``blas_threads=None`` turns the whole thing off. The worker applies them (``apply``) before
it builds its envs: the variables for libraries the env imports later, and threadpoolctl
for the pools already loaded (the module server preloads numpy, whose pool is sized then).

Pinning puts a worker on one CPU with ``os.sched_setaffinity``; which CPU, and whether a
vector pins at all, the parent decides with claims that other runs see (``cpu_claims``).

``wait="spin"`` (off by default) makes a worker poll its pipe for ``SPIN_S`` after each
answer instead of sleeping at once, so its core stays awake for the next step: each worker
keeps one core busy. ``check_spinners`` refuses more spinning workers than the cores this
process may use. The parent counts as one more spinner when it polls too: it does, for up
to ``SPIN_S`` of each wait for a worker, only when a vector leaves a core to spare for it
(``parent_spins``); otherwise it sleeps until the last of a step's workers wakes it
(``done_pipes``), one wake-up per step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
WAIT_MODES = ("sleep", "spin")
SPIN_S = 0.002  # how long a hot worker polls for its next request before it sleeps


def check_spinners(wait: str, num_workers: int, env_index: int = 0) -> None:
    """Refuse ``wait="spin"`` when its spinning workers outnumber this process's cores.

    The parent is not counted: it spins only with a core to spare (``parent_spins``), and
    otherwise sleeps while the workers step. It needs a core between steps too, which a
    spinner gives up at each poll (``os.sched_yield``).
    """
    if wait not in WAIT_MODES:
        raise ValueError(f"env {env_index}: wait must be 'sleep' or 'spin', got {wait!r}")
    cores = len(os.sched_getaffinity(0))
    if wait == "spin" and num_workers > cores:
        raise ValueError(
            f"wait='spin' keeps one core busy per worker: {num_workers} workers, but this "
            f"process may use {cores} core(s) (os.sched_getaffinity). Host more envs per "
            f"worker (envs_per_worker >= N / {cores}) or use wait='sleep'."
        )


def parent_spins(wait: str, num_workers: int) -> bool:
    """Whether the parent of a hot vector polls too while it waits for its workers.

    Only when the workers leave one of this process's cores to spare: counting the parent,
    hot mode never has more spinners than cores.
    """
    return wait == "spin" and num_workers + 1 <= len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What a worker sets up in its own process before it builds its envs.

    Attributes:
        thread_env: Environment variables to set (the thread counts); empty: none.
        cpu: The CPU to pin the worker to; None: not pinned.
        unset: Variables to remove: those multienv gave the process the worker forks
            from, when this worker is to be left alone (``blas_threads=None``).
        limit_pools: Resize the thread pools already loaded in the worker (to the variables'
            counts, or back to one thread per CPU when leaving it alone). Not needed in a
            worker forked from a process that started with the same variables (its pools
            were born that size), where it would cost about 13 ms a worker.
        spin_s: How long the worker polls for its next request before it sleeps; 0 (the
            default) sleeps at once.
        extra_env: The worker's own environment variables (``WorkerPlacement.env``), set
            before the thread counts.
        cpus: The CPUs the worker may run on (``WorkerPlacement.cpus``); None: ``cpu``.
    """

    thread_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cpu: int | None = None
    unset: tuple[str, ...] = ()
    limit_pools: bool = True
    spin_s: float = 0.0
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cpus: tuple[int, ...] | None = None

    def for_fork_from(
        self, born_with: Mapping[str, str], environ: Mapping[str, str]
    ) -> WorkerSettings:
        """These settings for a worker whose process starts with pools sized by ``born_with``.

        Args:
            born_with: The thread variables the process it forks from started with
                (``{}`` for a fresh interpreter, or a parent that set none).
            environ: The parent's environment: variables there are the user's own.
        """
        unset = () if self.thread_env else tuple(n for n in born_with if n not in environ)
        return dataclasses.replace(
            self, unset=unset, limit_pools=dict(self.thread_env) != dict(born_with)
        )

    @classmethod
    def decide(
        cls,
        blas_threads: int | None,
        cpu: int | None,
        env_index: int,
        environ: Mapping[str, str] = os.environ,
        wait: str = "sleep",
    ) -> WorkerSettings:
        """The settings of one worker, decided in the parent.

        Args:
            blas_threads: Threads per BLAS/OpenMP pool in the worker; None leaves them be.
            cpu: The CPU to pin the worker to (``cpu_claims``); None: not pinned.
            env_index: The worker's first env, for messages.
            environ: The parent's environment: a thread variable set there wins.
            wait: "sleep", or "spin" to keep the worker's core awake between steps.
        """
        check_spinners(wait, 1, env_index)
        if blas_threads is not None and (
            not isinstance(blas_threads, int) or isinstance(blas_threads, bool) or blas_threads < 1
        ):
            raise ValueError(
                f"env {env_index}: blas_threads must be an int >= 1 or None, got {blas_threads!r}"
            )
        thread_env: dict[str, str] = {}
        if blas_threads is not None:
            thread_env = {name: environ.get(name, str(blas_threads)) for name in THREAD_VARIABLES}
        return cls(thread_env, cpu, spin_s=SPIN_S if wait == "spin" else 0.0)

    def apply(self) -> None:
        """WORKER SIDE: set the variables, limit the loaded pools, pin the process."""
        os.environ.update(self.extra_env)
        os.environ.update(self.thread_env)
        for name in self.unset:
            os.environ.pop(name, None)
        if self.limit_pools and (self.thread_env or self.unset):
            from threadpoolctl import threadpool_limits

            # threadpoolctl limits pools by API: every loaded BLAS (OpenBLAS or MKL) gets
            # the smaller of the two BLAS counts, OpenMP runtimes get OMP_NUM_THREADS.
            # Left alone, they get their own default back: one thread per CPU.
            default = len(os.sched_getaffinity(0))
            env = {name: int(self.thread_env.get(name, default)) for name in THREAD_VARIABLES}
            blas = min(env[name] for name in THREAD_VARIABLES[1:])
            threadpool_limits(limits={"openmp": env["OMP_NUM_THREADS"], "blas": blas})
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)
        elif self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})
