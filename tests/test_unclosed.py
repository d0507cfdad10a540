"""Vectors and proxies dropped without close(): freed at once in any thread, and a fast exit.

Each case runs ``tests/unclosed_script.py`` in a fresh interpreter with a timeout, so that a
collection that deadlocks fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multienv.wire.procfs import process_table
from tests.unclosed_script import STATES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, "-m", "tests.unclosed_script"]


def json_rows(stdout: str | bytes | None) -> list[dict]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    return [json.loads(line) for line in (stdout or "").splitlines() if line.startswith("{")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["lock", "thread"])
def test_dropped_vector_is_freed_at_once_under_the_futures_lock_and_its_workers_die(how):
    """The collector frees a dropped vector while its thread holds ``_global_shutdown_lock``.

    ``lock``: the main thread drops it inside the lock; ``thread``: another thread's
    collection frees it. Every state of ``STATES``: idle, mid-step, mid-reset, after a crash,
    in send, a lone proxy. It used to deadlock: ``__del__`` closed through a thread pool.
    """
    try:
        done = subprocess.run(
            [*SCRIPT, "collect", how], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        seen = [row["state"] for row in json_rows(exc.stdout)]
        hung = next((state for state in STATES if state not in seen), "the exit")
        pytest.fail(f"collecting a dropped vector hung ({how}): in state {hung!r}")
    assert done.returncode == 0, done.stderr
    *rows, last = json_rows(done.stdout)
    assert [row["state"] for row in rows] == list(STATES)
    for row in rows:
        name = "SubprocessEnv(env 0)" if row["state"] == "lone proxy" else "MultiEnv(num_envs=2)"
        assert row["collect_s"] < 1.0, row
        assert row["is_gone"], row
        assert row["dead_after_s"] is not None, f"workers outlived the collection: {row}"
        assert len(row["warnings"]) == 1, row
        assert row["warnings"][0].startswith(f"unclosed {name}: its workers were killed")
        assert row["fds_left"] == 0, row
    assert set(last["threads_left"]) <= {"MainThread", "multienv-stderr"}, last


def session_processes(session_id: int) -> list[tuple[int, str]]:
    """(pid, state) of every process of a session that is not a zombie."""
    found = []
    for pid, entry in process_table().items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == session_id and entry.state != "Z":
            found.append((pid, entry.name))
    return found


def interrupt_mid_step(num_envs: int) -> tuple[float, list[tuple[int, str]], str]:
    """Start a loop that never closes its vector, Ctrl-C it mid-step.

    Returns the seconds from the signal to its exit, what of its session still ran 1 s
    after the signal, and its stderr.
    """
    process = subprocess.Popen(
        [*SCRIPT, "train", str(num_envs)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches it
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 30.0)
        assert ready, "the loop did not start in 30 s"
        assert process.stdout.readline() == b"READY\n", process.stderr.read()
        time.sleep(0.2)  # stepping
        signalled = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        process.wait(10.0)
        exit_s = time.monotonic() - signalled
        while (left := session_processes(process.pid)) and time.monotonic() < signalled + 1.0:
            time.sleep(0.01)
        return exit_s, left, process.stderr.read().decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid, _ in session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.timeout(240)
def test_ctrl_c_mid_step_without_close_exits_within_a_second_leaving_no_process():
    """16 envs, never closed, interrupted mid-step: the exit used to take 1-14 s."""
    for attempt in range(10):
        exit_s, left, stderr = interrupt_mid_step(16)
        assert "KeyboardInterrupt" in stderr, stderr
        assert exit_s < 1.0, f"try {attempt}: exit took {exit_s:.2f} s; stderr:\n{stderr}"
        assert left == [], f"try {attempt}: still running 1 s after Ctrl-C: {left}"
