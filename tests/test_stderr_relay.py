"""The workers' stderr reaches ours by whole lines, and crash dumps are bounded.

Each run is a real crash loop in a subprocess, whose own stderr the test reads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def crash_loop(budget: int, setting: str | None) -> str:
    env = dict(os.environ)
    env.pop("MULTIENV_WORKER_STDERR", None)
    if setting is not None:
        env["MULTIENV_WORKER_STDERR"] = setting
    done = subprocess.run(
        [sys.executable, "-m", "tests.crash_flood_script", str(budget)],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=_ROOT,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.fault
@pytest.mark.timeout(240)
def test_a_crash_loop_shows_its_error_and_a_bounded_share_of_the_crash_dumps():
    output = crash_loop(budget=12, setting=None)  # 52 deaths, 52 crash dumps
    assert "EnvCrashLoopError: env 0: worker died" in output
    dumps = output.count("Fatal Python error: Segmentation fault")
    # 3 forwarded as they happen, and the last lines of each worker with its error.
    assert 3 <= dumps <= 3 + 4, dumps
    assert "MULTIENV_WORKER_STDERR=all" in output
    assert len(output.splitlines()) < 400
    for line in output.splitlines():  # whole lines: no two workers' text within one
        assert line.count("Fatal Python error") <= 1, line


@pytest.mark.fault
@pytest.mark.timeout(240)
def test_every_crash_dump_is_shown_on_request_and_none_when_off(tmp_path):
    everything = crash_loop(budget=3, setting="all")
    assert everything.count("Fatal Python error: Segmentation fault") >= 16
    quiet = crash_loop(budget=3, setting="off")  # only the errors' last lines, one per worker
    assert quiet.count("Fatal Python error: Segmentation fault") <= 4
    assert quiet.count("about to dereference NULL") <= 4 < everything.count("about to deref")
    path = tmp_path / "workers.log"
    redirected = crash_loop(budget=3, setting=str(path))
    assert "EnvCrashLoopError" in redirected
    assert path.read_text().count("Fatal Python error: Segmentation fault") >= 16
