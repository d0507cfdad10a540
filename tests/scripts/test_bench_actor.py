"""scripts/bench_actor.py: each loop steps the envs it says, the policy's time between calls."""

import importlib.util
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def load():
    sys.path.insert(0, str(ROOT / "scripts"))
    path = ROOT / "scripts" / "bench_actor.py"
    spec = importlib.util.spec_from_file_location("bench_actor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_actor"] = module
    spec.loader.exec_module(module)
    return module


def test_a_sleeping_policy_sleeps_and_a_busy_one_spins():
    bench = load()
    for busy in (False, True):
        wall, cpu = time.perf_counter(), time.process_time()
        bench.policy(0.05, busy)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert wall >= 0.05
        assert (cpu > 0.01) is busy  # a sleep takes next to no CPU; a spin most of it


@pytest.mark.parametrize("row", ["step()", "send/recv"])
def test_each_row_counts_the_env_steps_its_loop_made(row):
    """The dispatch workload: send/recv returns one worker's envs at a time (k=2 here)."""
    bench = load()
    result = bench.sample(row, "dispatch", 4, 2, 0.001, False, 0.3)
    assert result["steps_per_s"] > 0
    # A call takes the policy's 1 ms at least; each returns 4 env steps (step()) or 2.
    per_call = 4 if row == "step()" else 2
    assert result["steps_per_s"] * result["call_s"] == pytest.approx(per_call, rel=0.05)
    assert result["call_s"] >= 0.001


@pytest.mark.parametrize("row", ["EnvPool sync", "EnvPool async"])
def test_envpool_rows_count_the_env_steps_of_its_own_loop(row):
    """EnvPool's async row returns half the envs a call (``batch_size=N // 2``)."""
    pytest.importorskip("envpool", reason="EnvPool is not installed: pip install envpool")
    pytest.importorskip("mujoco", reason="MuJoCo is not installed: pip install -e '.[bench]'")
    bench = load()
    result = bench.sample(row, "halfcheetah", 4, None, 0.001, False, 0.3)
    per_call = 4 if row == "EnvPool sync" else 2
    assert result["steps_per_s"] * result["call_s"] == pytest.approx(per_call, rel=0.05)
    assert result["call_s"] >= 0.001


@pytest.mark.parametrize("row", ["TorchRL sync", "TorchRL async"])
def test_torchrl_rows_count_the_env_steps_of_its_own_loop(row):
    """TorchRL's async row returns half the envs a call (``min_get = max_get = N // 2``)."""
    pytest.importorskip("torchrl", reason="TorchRL is not installed (a CPU torch, then torchrl)")
    bench = load()
    result = bench.sample(row, "cheap", 4, None, 0.001, False, 0.5)
    per_call = 4 if row == "TorchRL sync" else 2
    assert result["steps_per_s"] * result["call_s"] == pytest.approx(per_call, rel=0.05)
    assert result["call_s"] >= 0.001
