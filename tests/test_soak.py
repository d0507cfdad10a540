"""The soak script, one minute of every fault at once (``-m slow``)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_minute_soak_holds_every_check():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--minutes", "1"],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    final = [line for line in done.stdout.splitlines() if line.startswith("FINAL")]
    assert final, done.stdout
    assert "checks: all held" in done.stdout
    assert "recycles 0 " not in final[0], final[0]
