"""PARENT SIDE: ``Layout``, how a vector's envs are spread over its workers, and why.

``envs_per_worker="auto"`` chooses the layout from the cores this process may use
(``os.sched_getaffinity``) and the cost of one step of env 0, timed in a probe worker
(``choose_layout``). The rule rests on these measurements (``scripts/bench.py``, env steps
per second of the whole vector; ``docs/performance.rst`` has the tables):

- 2 cores, N=16: as many workers as cores (k=8) beats one env per worker for every env,
  cheap or not: CartPole 98,000 against 35,000, HalfCheetah 32,800 against 16,700, Pong
  7,300 against 6,300. At N=64 the same (k=32). At N=2, one env per worker beats one
  worker of both: CartPole 19,200 against 17,000, Pong 6,100 against 3,400.
- 16 cores (before the data plane): Pong, whose step takes about 0.2 ms, ran faster with
  one env per worker at N=16 (7.37x the loop against 4.83x at k=2) and at N=64 (5.50x
  against 4.78x at k=4); HalfCheetah (about 30 us a step) ran faster with as many workers
  as cores at N=64 (k=4, 3.7-5.3x, against k=1, 3.1x).

So: with no more envs than cores, one env per worker; with more, one env per worker only
where steps are long (``LONG_STEP_S``) and cores many (``MANY_CORES``), where the kernel
spreads many workers over the cores more evenly than fixed batches and the wake-ups a
batch would save are a small part of a step; else as many workers as cores. The two
thresholds lie between measured points: no cell measured a step between 30 us and 0.2 ms,
or a machine between 2 and 16 cores.

An env that mostly waits (its step's CPU under ``WAITING_SHARE`` of its wall time: I/O, a
remote simulator, a sleep) is another matter. A worker of several envs steps those that wait
``MIN_WAIT_S`` or more at once, each on a thread of its own (``multienv.worker.waiting``), so
their waits overlap, while their CPU takes turns under the worker's GIL. ``_waiting_k``
weighs that: a vector step lasts the wait, plus the longer of one worker's envs' CPU end to
end and the CPU of every env and every worker's wake-up spread over the cores. A thread
costs its env ``THREAD_CPU_S`` a step, and ``THREAD_CPU_PER_ENV_S`` more for each env of its
worker (their threads contend for the GIL); a worker's wake-up costs ``WAKE_CPU_S``, which
hundreds of processes on a few cores make dear. Envs that wait 5 ms, 2 cores (``python
scripts/bench_auto.py --many``): N=16, k=1 and k=8 alike (2,842 and 2,858 env steps/s);
N=64, 9,560 with one env per worker, 9,896 at k=8, 9,407 at k=32; N=256, 15,674 with one
env per worker (256 processes, 1,634 MB of PSS), 22,903 at k=8 (32 processes, 253 MB),
19,976 at k=32, 12,191 at k=128 (2 processes, 41 MB). Waiting shorter than ``MIN_WAIT_S``
stays in the worker's loop, where k envs wait k times as long.

Example:
    >>> layout = choose_layout(64, cores=16, step_s=250e-6)
    >>> layout.envs_per_worker, layout.num_workers
    (1, 64)
    >>> choose_layout(64, cores=16, step_s=30e-6).envs_per_worker
    4
"""

from __future__ import annotations

import dataclasses
import os

LONG_STEP_S = 100e-6  # steps at least this long may run one env per worker on many cores
MANY_CORES = 8  # cores from which long steps run one env per worker
WAITING_SHARE = 0.5  # a step whose CPU is under this share of its wall time mostly waits
WAKE_CPU_S = 70e-6  # CPU a worker's wake-up costs, its side and the parent's (2 cores, N=256)
MIN_WAIT_S = 200e-6  # as ``worker.waiting.MIN_WAIT_S``: less waiting steps in the worker's loop
THREAD_CPU_S = 20e-6  # a waiting env's step on its worker's thread: the hop, the GIL
THREAD_CPU_PER_ENV_S = 1e-6  # and this much more for each env of its worker


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a vector's envs are spread over its worker processes, and why (``MultiEnv.layout``).

    Attributes:
        num_envs: The vector's envs.
        envs_per_worker: Envs per worker: env i lives in worker ``i // envs_per_worker``.
        num_workers: Worker processes.
        cores: The cores this process could use when the layout was chosen.
        step_s: The median step of env 0, timed in its worker (random actions); None when
            the layout was given, not measured.
        reset_s: The median reset of env 0, timed likewise; None when not measured.
        reason: The choice and why, in words: what ``envs_per_worker="auto"`` logs.
        step_cpu_s: The median CPU of env 0's step, timed likewise; None when not measured.
        blocked_share: The share of the timed steps in which env 0's thread blocked (a
            voluntary context switch); None when not measured or not counted (not Linux).
    """

    num_envs: int
    envs_per_worker: int
    num_workers: int
    cores: int
    step_s: float | None = None
    reset_s: float | None = None
    reason: str = ""
    step_cpu_s: float | None = None
    blocked_share: float | None = None

    def __str__(self) -> str:
        """The reason: the choice and why."""
        return self.reason


def choose_layout(
    num_envs: int,
    cores: int,
    step_s: float,
    reset_s: float | None = None,
    may_oversubscribe: bool = True,
    step_cpu_s: float | None = None,
    blocked_share: float | None = None,
) -> Layout:
    """The layout ``envs_per_worker="auto"`` picks for ``num_envs`` envs (see the module).

    Args:
        num_envs: The vector's envs.
        cores: The cores this process may use.
        step_s: The cost of one env step, in seconds.
        reset_s: The cost of one reset (reported, not weighed).
        may_oversubscribe: Whether workers may outnumber the cores: not in hot mode
            (``wait="spin"``), nor with ``pin_cpu=True``.
        step_cpu_s: The CPU of one env step, in seconds; None: as ``step_s`` (it computes).
        blocked_share: The share of steps that blocked; None: each slow one did. A step
            whose CPU is low but which did not block was preempted (the cores are busy):
            it computes.
    """
    cores = max(1, cores)
    cost = f"{_duration(step_s)} a step"
    is_slow = step_cpu_s is not None and step_cpu_s < WAITING_SHARE * step_s
    is_waiting = is_slow and (blocked_share is None or blocked_share >= WAITING_SHARE)
    if is_slow:
        assert step_cpu_s is not None
        cost += f" of which {_duration(step_cpu_s)} CPU"
        if not is_waiting:
            cost += " (preempted, never blocked: the cores are busy, and it computes)"
    if num_envs <= cores:
        k, why = 1, "no more envs than cores: each env gets a core"
    elif is_waiting and may_oversubscribe:
        assert step_cpu_s is not None
        k = _waiting_k(num_envs, cores, step_s, step_cpu_s)
        why = (
            "its steps mostly wait: a worker's envs wait at once on threads, and the "
            "cores spread the CPU of envs and wake-ups"
        )
    elif may_oversubscribe and cores >= MANY_CORES and step_s >= LONG_STEP_S:
        k = 1
        why = (
            f"steps of {_duration(LONG_STEP_S)} or more on {MANY_CORES} cores or more: the "
            "kernel spreads one-env workers over the cores more evenly than batches"
        )
    else:
        k = -(-num_envs // cores)
        why = "as many workers as cores: a batch spares each env a wake-up"
    num_workers = -(-num_envs // k)
    per = "1 env per worker" if k == 1 else f"{k} envs per worker"
    reason = f"{cores} cores, {cost}: {per}, {num_workers} workers ({why})"
    return Layout(
        num_envs, k, num_workers, cores, step_s, reset_s, reason, step_cpu_s, blocked_share
    )


def _waiting_k(num_envs: int, cores: int, step_s: float, step_cpu_s: float) -> int:
    """The envs per worker that make a vector step of waiting envs shortest (the module).

    A step lasts the wait, plus the longer of one worker's envs' CPU end to end and the CPU
    of every env and every worker's wake-up over the cores; the fewest workers win ties.
    A wait too short for a thread is a worker's k envs' waits end to end.
    """
    most = -(-num_envs // cores)  # as many workers as cores
    wait = step_s - step_cpu_s
    is_threaded = wait >= MIN_WAIT_S

    def duration(k: int) -> float:
        workers = -(-num_envs // k)
        on_thread = k > 1 and is_threaded
        env_cpu = step_cpu_s + (THREAD_CPU_S + k * THREAD_CPU_PER_ENV_S if on_thread else 0.0)
        spread = (num_envs * env_cpu + workers * WAKE_CPU_S) / cores
        waits = wait if on_thread or k == 1 else k * wait
        return waits + max(k * env_cpu, spread)

    return min(range(1, most + 1), key=lambda k: (round(duration(k), 7), -k))


def is_auto(envs_per_worker: object, owner: str) -> bool:
    """Whether ``envs_per_worker`` is ``"auto"``; a ValueError, naming ``owner``, for other strs."""
    if not isinstance(envs_per_worker, str):
        return False
    if envs_per_worker != "auto":
        raise ValueError(
            f"{owner}(): envs_per_worker must be an int >= 1 or 'auto', got {envs_per_worker!r}"
        )
    return True


def given_layout(num_envs: int, envs_per_worker: int, num_workers: int) -> Layout:
    """The layout of a vector whose ``envs_per_worker`` was given, or whose envs were."""
    reason = f"{envs_per_worker} envs per worker as given, {num_workers} workers"
    cores = len(os.sched_getaffinity(0))
    return Layout(num_envs, envs_per_worker, num_workers, cores, reason=reason)


def _duration(seconds: float) -> str:
    """``1.5 ms`` or ``31 us``: a step's cost as the reason shows it."""
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


__all__ = [
    "LONG_STEP_S",
    "MANY_CORES",
    "MIN_WAIT_S",
    "THREAD_CPU_PER_ENV_S",
    "THREAD_CPU_S",
    "WAITING_SHARE",
    "WAKE_CPU_S",
    "Layout",
    "choose_layout",
    "given_layout",
    "is_auto",
]
