"""The chaos harness (``tests/chaos``): faults injected into every loop while every result
is checked against the envs' own counters. A short run is in the default suite; the whole
matrix of ``tests/chaos/run_matrix.sh`` runs with ``python -m pytest -m chaos``.

Each configuration runs as its own process, as a user's program would, bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_HARNESS = os.path.join(os.path.dirname(__file__), "chaos", "harness.py")

# (mode, envs_per_worker, num_envs, spin): as run_matrix.sh lists them.
MATRIX = [
    ("NextStep", 1, 5, False),
    ("SameStep", 1, 5, False),
    ("Disabled", 1, 5, False),
    ("NextStep", 3, 7, False),
    ("SameStep", 3, 7, False),
    ("Disabled", 3, 7, False),
    ("NextStep", 4, 8, False),
    ("SameStep", 4, 10, False),
    ("Disabled", 4, 8, False),
    ("NextStep", 4, 8, True),
    ("SameStep", 3, 6, True),
    ("Disabled", 1, 2, True),
    ("NextStep", 1, 2, True),
    ("SameStep", 4, 8, True),
    ("Disabled", 3, 6, True),
]


def run_harness(mode: str, k: int, n: int, spin: bool, seconds: float, seed: int) -> str:
    """Run one configuration; its output, after checking that every invariant held."""
    command = [sys.executable, _HARNESS, "--mode", mode, "--k", str(k), "--n", str(n)]
    command += ["--seconds", str(seconds), "--seed", str(seed)] + (["--spin"] if spin else [])
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 240, check=False
    )
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    summary = "\n".join(
        line for line in done.stdout.splitlines() if line.startswith(("RESULT", "  VIOLATIONS"))
    )
    violations = "\n".join(
        line for line in done.stdout.splitlines() if line.startswith(("VIOLATION", "HANG"))
    )
    report = f"exit {done.returncode}\n{summary}\n{violations}\n{done.stdout[-6000:]}"
    assert done.returncode == 0, report
    assert result, report
    return done.stdout


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_short_chaos_run_breaks_no_invariant():
    """send/recv, step_async, masked resets and calls under kills, hangs and env errors."""
    output = run_harness("NextStep", 3, 7, False, seconds=15, seed=2026)
    assert "all invariants held" in output


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.fault
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("mode", "k", "n", "spin"), MATRIX)
def test_the_chaos_matrix_breaks_no_invariant(mode, k, n, spin):
    seconds = float(os.environ.get("MULTIENV_CHAOS_SECONDS", "70"))
    seed = int(os.environ.get("MULTIENV_CHAOS_SEED", "0"))
    seed = seed or int.from_bytes(os.urandom(3), "little")
    run_harness(mode, k, n, spin, seconds, seed)
