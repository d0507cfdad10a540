"""scripts/count_instructions.py: its counts are of the steps asked for, and repeatable."""

import importlib.util
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("valgrind") is None,
        reason="valgrind is not installed (apt-get install valgrind)",
    ),
    pytest.mark.timeout(600),
]


def load():
    spec = importlib.util.spec_from_file_location(
        "count_instructions", ROOT / "scripts" / "count_instructions.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["count_instructions"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("side", ["parent", "worker", "probe-async", "probe-ring"])
def test_counts_are_per_step_and_repeat_within_a_few_percent(side):
    count = load().count
    few = count(str(ROOT), [side, "--env", "zero", "--layouts", "8", "--steps", "40"], 40)
    many = count(str(ROOT), [side, "--env", "zero", "--layouts", "8", "--steps", "160"], 160)
    again = count(str(ROOT), [side, "--env", "zero", "--layouts", "8", "--steps", "160"], 160)
    assert 10_000 < many < 10_000_000  # a step's work, not the start-up's
    assert abs(many - again) / many < 0.05
    assert abs(many - few) / many < 0.15  # per step: four times the steps, the same count
