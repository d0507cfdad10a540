"""BOTH SIDES: facts about processes, read from ``/proc`` (Linux; psutil elsewhere, if installed).

Resident memory for ``RecyclePolicy``'s caps (the parent reads its workers', a Ray actor its
own), and the process table, for tests and ``scripts/soak.py`` to find leftover workers,
zombies and orphans. Reads are cheap (one small file each) and never raise for a process
that is gone.
"""

from __future__ import annotations

import dataclasses
import os

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20


@dataclasses.dataclass(frozen=True)
class ProcessEntry:
    """One process: its id, command name (``comm``), state letter and parent's id."""

    pid: int
    name: str
    state: str
    ppid: int


def process_table() -> dict[int, ProcessEntry]:
    """Every process this machine's ``/proc`` shows, by pid; empty where there is none."""
    table: dict[int, ProcessEntry] = {}
    if not os.path.isdir("/proc"):
        return table
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        table[int(entry)] = ProcessEntry(int(entry), name, state, int(ppid))
    return table


def resident_mb(pid: int | None = None) -> float | None:
    """Resident memory of process ``pid`` (this one if None) in MiB, or None if unreadable.

    One read of ``/proc/<pid>/statm`` on Linux (microseconds); elsewhere psutil when it is
    installed; else None, and the memory caps do nothing.
    """
    try:
        with open(f"/proc/{'self' if pid is None else pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_MB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return None
