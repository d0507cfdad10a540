"""Every call on a closed MultiEnv raises ClosedEnvironmentError naming that call.

Run in a subprocess: a call that touched the freed shared memory once killed the user's
process with a segfault (``step()`` after ``close()``, through the data plane's check).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.closed_calls_script import CALLS

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("envs_per_worker", "actions", "state"),
    [(1, "array", "idle"), (2, "array", "idle"), (1, "list", "idle"), (2, "array", "send")],
)
def test_every_call_after_close_raises_closed_environment_error(envs_per_worker, actions, state):
    done = subprocess.run(
        [sys.executable, "-m", "tests.closed_calls_script", str(envs_per_worker), actions, state],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=_ROOT,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert done.stdout.rstrip().endswith("done")
    for name in CALLS:
        assert lines[name].startswith("ClosedEnvironmentError: "), (name, lines[name])
        wanted = {"np_random_seed": "get_attr", "sync_states": "set_states"}.get(name, name)
        assert f"{wanted}()" in lines[name], (name, lines[name])
