"""PARENT SIDE, pure: ``WorkerPlacement``, what one worker gets of its own: variables, CPUs.

A vector's workers all start from the parent's environment. Some settings must differ by
worker: a GPU per group of workers (``CUDA_VISIBLE_DEVICES``), an EGL device for MuJoCo's
rendering (``MUJOCO_EGL_DEVICE_ID``), a seed or a log path read from the environment, a
set of CPUs. ``placement=`` gives each worker its own: a ``WorkerPlacement``, a list of one
per worker, or a function of the worker's index. The worker sets its variables and CPUs
before it builds its envs, and again after every respawn or recycle.

Example:
    >>> from multienv import WorkerPlacement
    >>> def one_gpu_per_two_workers(worker_index):
    ...     return WorkerPlacement(env={"CUDA_VISIBLE_DEVICES": str(worker_index // 2)})
    >>> [p.env["CUDA_VISIBLE_DEVICES"] for p in placements_for(one_gpu_per_two_workers, 4)]
    ['0', '0', '1', '1']
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class WorkerPlacement:
    """What one worker process gets of its own, on top of what every worker gets.

    Attributes:
        env: Environment variables to set in the worker before its envs are built (a
            thread-count variable here wins over ``blas_threads``). Modules the module
            server imported already read theirs: set a variable that such a module reads
            at import (``MUJOCO_GL``) in your own process instead.
        cpus: The CPUs the worker may run on (``os.sched_setaffinity``), among those this
            process may use; None leaves it to the vector's pinning. A worker placed on
            CPUs is not pinned by the vector, and claims none (``cpu_claims``).
    """

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cpus: Collection[int] | None = None

    def checked(self, name: str) -> WorkerPlacement:
        """This placement with its values checked; ``name`` names the worker in errors."""
        env = self.env
        if not isinstance(env, Mapping) or not all(
            isinstance(key, str) and key and "=" not in key and isinstance(value, str)
            for key, value in env.items()
        ):
            raise TypeError(
                f"{name}: WorkerPlacement.env must map variable names to str values, got {env!r}"
            )
        cpus = self.cpus
        if cpus is None:
            return WorkerPlacement(dict(env))
        allowed = os.sched_getaffinity(0)
        if isinstance(cpus, str | bytes) or not all(
            isinstance(cpu, int) and not isinstance(cpu, bool) for cpu in cpus
        ):
            raise TypeError(f"{name}: WorkerPlacement.cpus must be CPU numbers, got {cpus!r}")
        chosen = frozenset(cpus)
        if not chosen or not chosen <= allowed:
            raise ValueError(
                f"{name}: WorkerPlacement.cpus={sorted(chosen)} must be a non-empty subset "
                f"of the CPUs this process may use, {sorted(allowed)} (os.sched_getaffinity)"
            )
        return WorkerPlacement(dict(env), tuple(sorted(chosen)))


def placements_for(placement: Any, num_workers: int, envs_per_worker: int = 1) -> list[Any]:
    """Each worker's checked ``WorkerPlacement`` (None: no placement given).

    Args:
        placement: A ``WorkerPlacement`` for every worker, a sequence of one per worker, a
            function of the worker's index, or None.
        num_workers: How many workers the vector has.
        envs_per_worker: For messages: worker w hosts envs from ``w * envs_per_worker``.

    Raises:
        TypeError: A placement is not a ``WorkerPlacement``, or its values have the wrong
            types; the message names the worker.
        ValueError: A sequence of another length, CPUs this process may not use, or a
            function that raised (chained).
    """
    if placement is None:
        return [None] * num_workers

    def name(worker: int) -> str:
        first = worker * envs_per_worker
        return (
            f"worker {worker} (env {first})"
            if envs_per_worker == 1
            else (f"worker {worker} (envs {first}-{first + envs_per_worker - 1})")
        )

    if isinstance(placement, WorkerPlacement):
        given: list[Any] = [placement] * num_workers
    elif callable(placement):
        given = []
        for worker in range(num_workers):
            try:
                given.append(placement(worker))
            except Exception as exc:
                raise ValueError(
                    f"{name(worker)}: placement({worker}) raised {type(exc).__name__}: {exc}"
                ) from exc
    elif isinstance(placement, Sequence) and not isinstance(placement, str | bytes):
        given = list(placement)
        if len(given) != num_workers:
            raise ValueError(
                f"placement has {len(given)} entries for {num_workers} workers; pass one "
                "WorkerPlacement per worker, or a function of the worker's index"
            )
    else:
        raise TypeError(
            "placement must be a WorkerPlacement, a list of one per worker or a function of "
            f"the worker's index, got {type(placement).__name__}"
        )
    placements = []
    for worker, each in enumerate(given):
        if not isinstance(each, WorkerPlacement):
            raise TypeError(
                f"{name(worker)}: placement must give a WorkerPlacement, got {type(each).__name__}"
            )
        placements.append(each.checked(name(worker)))
    return placements
