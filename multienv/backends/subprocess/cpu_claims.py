"""PARENT SIDE, subprocess backend: which CPUs a vector pins its workers to, machine-wide.

Pinning one worker per CPU makes fast envs step faster (docs/performance.rst), but two
runs of the same script on one machine would pin their workers to the same first CPUs
and leave the others idle. So a pinned worker's CPU is *claimed*: the parent holds an
exclusive ``flock`` on a file named after that CPU, ``multienv-cpu-<n>.lock`` in a folder
every process on the machine sees (``/dev/shm``, or ``MULTIENV_CPU_CLAIMS_DIR``), for as
long as the worker is its vector's. A claim held by another process, or by another
vector of this one, is taken by no one else. The kernel drops a lock when its holder
exits, SIGKILL included, so a claim never outlives its run; the empty files stay.

``pin_cpu=None`` (a vector's default) pins only when every worker gets a free CPU of the
ones this process may use, and otherwise pins none and says why at INFO. ``pin_cpu=True``
pins every worker: to free CPUs first, then round robin over the rest.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import weakref

logger = logging.getLogger("multienv")

DIR_VARIABLE = "MULTIENV_CPU_CLAIMS_DIR"


def claims_dir() -> str:
    """The folder of the claim files: ``$MULTIENV_CPU_CLAIMS_DIR``, else /dev/shm, else /tmp."""
    chosen = os.environ.get(DIR_VARIABLE)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class CpuClaim:
    """One CPU held for one worker, until ``release()`` or until this object is collected."""

    def __init__(self, cpu: int, fd: int) -> None:
        """Hold ``fd``, the claim file's descriptor with its lock; closing it releases."""
        self.cpu = cpu
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Let another worker or run take the CPU; idempotent, takes no lock."""
        self._close()


def try_claim(cpu: int) -> CpuClaim | None:
    """Claim ``cpu`` for a worker of this process; None if someone holds it or no file opens."""
    path = os.path.join(claims_dir(), f"multienv-cpu-{cpu}.lock")
    try:
        # Read-only: a file another user created (mode 0644 under their umask) still opens.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        logger.debug("cannot claim CPU %d (%s): %s", cpu, path, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return CpuClaim(cpu, fd)


@dataclasses.dataclass
class Pin:
    """Where one worker runs: its CPU, and the claim that keeps it, if any."""

    cpu: int
    claim: CpuClaim | None = None


def plan_pins(pin_cpu: bool | None, num_workers: int) -> list[Pin | None]:
    """Each worker's pin, by worker number (None: not pinned).

    Args:
        pin_cpu: True pins every worker; None pins them all if each gets a free CPU, else
            none; False pins none.
        num_workers: How many workers the vector has.
    """
    if pin_cpu is False or num_workers == 0:
        return [None] * num_workers
    cpus = sorted(os.sched_getaffinity(0))
    if pin_cpu is None and num_workers > len(cpus):
        return [None] * num_workers
    claims: list[CpuClaim] = []
    for cpu in cpus:
        if len(claims) == num_workers:
            break
        claim = try_claim(cpu)
        if claim is not None:
            claims.append(claim)
    if pin_cpu is None and len(claims) < num_workers:
        for claim in claims:
            claim.release()
        logger.info(
            "not pinning %d worker(s) to CPUs: %d of the %d CPUs this process may use are "
            "free, the others are pinned by multienv workers of other vectors or runs "
            "(pin_cpu=True pins anyway)",
            num_workers,
            len(claims),
            len(cpus),
        )
        return [None] * num_workers
    pins: list[Pin | None] = [Pin(claim.cpu, claim) for claim in claims]
    # pin_cpu=True beyond the free CPUs: round robin over all of them, unclaimed.
    pins += [Pin(cpus[w % len(cpus)]) for w in range(len(claims), num_workers)]
    return pins
