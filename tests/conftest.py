"""Fixtures, and the session-wide check that no worker process outlives the tests."""

from __future__ import annotations

import os
import signal
import time

import pytest

from multienv.worker import OS_NAME_PREFIX


def _descendant_workers() -> list[int]:
    """Pids of live multienv workers descended from this process (found through /proc)."""
    me = os.getpid()
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            names[int(entry)] = name + " (zombie)"
        else:
            names[int(entry)] = name
        parents[int(entry)] = int(fields[1])
    found = []
    for pid, name in names.items():
        if not name.startswith(OS_NAME_PREFIX):
            continue
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != me:
            ancestor = parents.get(ancestor, 0)
        if ancestor == me:
            found.append(pid)
    return found


def live_workers(wait_s: float = 3.0) -> list[int]:
    """Workers still alive after giving exiting ones ``wait_s`` seconds to go."""
    deadline = time.monotonic() + wait_s
    while (found := _descendant_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.path.isdir("/proc"):
        return
    leftovers = live_workers()
    if leftovers:
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"multienv: {len(leftovers)} worker process(es) outlived the tests: {leftovers}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
