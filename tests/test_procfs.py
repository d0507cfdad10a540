"""Facts about processes from /proc: the process table and resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from multienv.wire.procfs import process_table, resident_mb

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")


def test_the_table_shows_this_process_and_a_child_with_a_name_in_parentheses():
    # A command name with a space and a parenthesis, as /proc/<pid>/stat quotes it.
    script = "import ctypes, sys; ctypes.CDLL(None).prctl(15, b'a (b) c'); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            entry = process_table().get(child.pid)
            if entry is not None and entry.name == "a (b) c":
                break
            time.sleep(0.01)
        table = process_table()
        assert table[os.getpid()].ppid == os.getppid()
        assert table[child.pid].name == "a (b) c"
        assert table[child.pid].ppid == os.getpid()
        assert table[child.pid].state in "RSD"
    finally:
        child.communicate(timeout=10)


def test_resident_memory_grows_with_what_the_process_touches():
    before = resident_mb()
    assert before is not None
    assert before > 1.0
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, written
    after = resident_mb(os.getpid())
    assert after is not None
    assert after - before > 50.0
    del block
    assert resident_mb(2**22 + 12345) is None  # no such process
