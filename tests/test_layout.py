"""envs_per_worker="auto": the rule, the step cost timed in a probe worker, the layout shown."""

import functools
import logging
import os
import subprocess
import sys
import textwrap
import time

import cloudpickle
import numpy as np
import pytest

from multienv import (
    EnvCrashedError,
    EnvError,
    MultiEnv,
    RestartPolicy,
    WorkerPlacement,
    create_subprocess_envs,
)
from multienv.layout import LONG_STEP_S, MANY_CORES, WAITING_SHARE, choose_layout
from multienv.worker.runner import EnvRunner
from tests.envs import (
    BusyEnv,
    CountingEnv,
    EnvironEcho,
    HangOnStep,
    RaiseInInit,
    RaiseOnStep,
    SleepyEnv,
)

pytestmark = pytest.mark.timeout(60)

CORES = len(os.sched_getaffinity(0))
CARTPOLE_S, HALFCHEETAH_S, PONG_S = 5e-6, 30e-6, 200e-6  # as timed on the 2-core VMs


@pytest.mark.parametrize(
    ("num_envs", "cores", "step_s", "expected"),
    [
        # 2 cores: as many workers as cores, for every env (bench.py, N=16 and N=64)
        (16, 2, CARTPOLE_S, 8),
        (16, 2, HALFCHEETAH_S, 8),
        (16, 2, PONG_S, 8),
        (64, 2, CARTPOLE_S, 32),
        (64, 2, HALFCHEETAH_S, 32),
        (64, 2, PONG_S, 32),
        # 16 cores (the data-plane issue's figures): Pong one env per worker at N=16 and
        # N=64; HalfCheetah and CartPole as many workers as cores at N=64
        (16, 16, PONG_S, 1),
        (64, 16, PONG_S, 1),
        (64, 16, HALFCHEETAH_S, 4),
        (64, 16, CARTPOLE_S, 4),
        (16, 16, HALFCHEETAH_S, 1),
    ],
)
def test_the_rule_picks_the_layout_measured_faster(num_envs, cores, step_s, expected):
    layout = choose_layout(num_envs, cores, step_s)
    assert layout.envs_per_worker == expected
    assert layout.num_workers == -(-num_envs // expected)
    assert f"{cores} cores" in layout.reason
    assert f"{layout.num_workers} workers" in layout.reason


def test_the_thresholds_sit_between_the_measured_cells():
    assert choose_layout(64, MANY_CORES, LONG_STEP_S).envs_per_worker == 1
    assert choose_layout(64, MANY_CORES - 1, LONG_STEP_S).envs_per_worker == 10
    assert choose_layout(64, MANY_CORES, LONG_STEP_S * 0.99).envs_per_worker == 8


@pytest.mark.parametrize(
    ("num_envs", "cores", "step_s", "step_cpu_s", "expected"),
    [
        # 5 ms waits: a worker's envs wait at once on its threads (bench_auto.py --many):
        (16, 2, 5e-3, 0.1e-3, 8),  # k=8 2,858 env steps/s, k=1 2,842
        (8, 2, 5e-3, 0.1e-3, 4),
        (64, 2, 5e-3, 0.1e-3, 8),  # k=8 9,896, k=1 9,560, k=32 9,407
        (256, 2, 5e-3, 0.1e-3, 8),  # k=8 22,903, k=1 15,674, k=128 12,191
        (64, 16, 5e-3, 0.1e-3, 4),
        (64, 2, 5e-3, 1e-3, 8),  # 1 ms of CPU in 5 ms: the cores bind at any k
        (16, 2, 5e-3, 5e-3, 8),  # computing all the time: as many workers as cores, as before
        (16, 2, 5e-3, None, 8),  # not measured: computing
        # 130 us of waiting: too short for a thread, so a worker's envs wait in a row.
        (16, 2, 150e-6, 20e-6, 2),
    ],
)
def test_an_env_that_mostly_waits_gets_the_k_that_its_waits_and_the_cores_allow(
    num_envs, cores, step_s, step_cpu_s, expected
):
    layout = choose_layout(num_envs, cores, step_s, step_cpu_s=step_cpu_s)
    assert layout.envs_per_worker == expected
    if step_cpu_s is not None and step_cpu_s < WAITING_SHARE * step_s:
        assert "mostly wait" in layout.reason
        assert "CPU" in layout.reason


def test_a_waiting_env_keeps_one_worker_per_core_in_hot_mode():
    layout = choose_layout(16, 2, 5e-3, may_oversubscribe=False, step_cpu_s=0.1e-3)
    assert (layout.envs_per_worker, layout.num_workers) == (8, 2)


def test_the_worker_times_the_cpu_of_its_env_s_steps():
    # Read against the CPU each step costs by construction, never against its wall time: on
    # a machine whose cores are shared a computing step's wall time grows (2.0 ms of CPU in
    # 4.2 ms was seen), its CPU does not, and a sleeping step's stays near nothing.
    sleepy = EnvRunner([cloudpickle.dumps(functools.partial(SleepyEnv, step_s=0.003))])
    busy = EnvRunner([cloudpickle.dumps(functools.partial(BusyEnv, step_s=0.002))])
    try:
        sleepy.build()
        busy.build()
        waits = sleepy.measure(0, 0.05, 1000)
        computes = busy.measure(0, 0.05, 1000)
    finally:
        sleepy.close()
        busy.close()
    assert waits.step_cpu_s is not None
    assert waits.step_cpu_s < 0.2 * 0.003 <= waits.step_s
    assert computes.step_cpu_s is not None
    assert computes.step_cpu_s >= 0.002


@pytest.mark.timeout(60)
def test_auto_takes_a_computing_env_on_a_busy_machine_for_one_that_computes(busy_cores):
    sleepy = EnvRunner([cloudpickle.dumps(functools.partial(SleepyEnv, step_s=0.003))])
    busy = EnvRunner([cloudpickle.dumps(functools.partial(BusyEnv, step_s=0.002))])
    try:
        sleepy.build()
        busy.build()
        waits = sleepy.measure(0, 0.1, 1000)
        computes = busy.measure(0, 0.1, 1000)
    finally:
        sleepy.close()
        busy.close()
    assert computes.step_cpu_s is not None
    assert computes.step_cpu_s < WAITING_SHARE * computes.step_s, "not slowed: proves nothing"
    assert computes.blocked_share is not None
    assert computes.blocked_share < WAITING_SHARE
    assert waits.blocked_share == 1.0
    args = (64, 2, computes.step_s, None, True, computes.step_cpu_s)
    layout = choose_layout(*args, computes.blocked_share)
    assert (layout.envs_per_worker, layout.num_workers) == (32, 2)  # as many as cores
    assert "preempted, never blocked" in layout.reason
    assert choose_layout(*args, 1.0).envs_per_worker != 32  # had it blocked: waiting


def test_hot_mode_and_pinning_keep_one_worker_per_core_at_most():
    layout = choose_layout(64, 16, PONG_S, may_oversubscribe=False)
    assert (layout.envs_per_worker, layout.num_workers) == (4, 16)


def test_the_worker_times_steps_and_resets_of_its_env():
    env_fn = functools.partial(SleepyEnv, step_s=0.002)
    runner = EnvRunner([cloudpickle.dumps(env_fn)])
    runner.build()
    try:
        cost = runner.measure(0, 0.05, 1000)
    finally:
        runner.close()
    assert 0.002 <= cost.step_s < 0.02
    assert 0 <= cost.reset_s < 0.02  # the one reset; a sleep-free one, with room for a busy CPU
    assert 1 <= cost.steps < 50  # the budget ended it


def test_the_worker_times_one_step_at_least_and_resets_ended_episodes():
    runner = EnvRunner([cloudpickle.dumps(functools.partial(CountingEnv, episode_length=2))])
    runner.build()
    try:
        assert runner.measure(0, 0.0, 1000).steps == 1
        assert runner.measure(0, 10.0, 3).steps == 3
        assert runner.envs[0].unwrapped.count == 1  # reset after step 2, stepped once more
    finally:
        runner.close()


def test_auto_times_env_0_and_shows_what_it_chose(caplog):
    caplog.set_level(logging.INFO, logger="multienv")
    env_fn = functools.partial(SleepyEnv, step_s=0.002)
    with MultiEnv([env_fn] * 4, envs_per_worker="auto") as envs:
        layout = envs.layout
        assert 0.002 <= layout.step_s < 0.05
        assert layout.reset_s is not None
        assert layout.reset_s < 0.02
        assert layout.step_cpu_s is not None
        assert layout.step_cpu_s < layout.step_s / 2  # a sleep: it waits
        expected = choose_layout(4, CORES, layout.step_s, step_cpu_s=layout.step_cpu_s)
        assert (layout.envs_per_worker, layout.num_workers) == (
            expected.envs_per_worker,
            expected.num_workers,
        )
        assert layout.cores == CORES
        assert len({env.pid for env in envs.envs}) == layout.num_workers
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(4, dtype=np.int64))
        assert obs.ravel().tolist() == [1.0] * 4
    logged = [r.getMessage() for r in caplog.records if "envs_per_worker='auto'" in r.getMessage()]
    assert logged == [f"envs_per_worker='auto': {layout.reason}"]


def test_a_given_layout_is_shown_as_given():
    with MultiEnv([CountingEnv] * 3, envs_per_worker=2) as envs:
        layout = envs.layout
        assert (layout.envs_per_worker, layout.num_workers, layout.step_s) == (2, 2, None)
        assert layout.reason == "2 envs per worker as given, 2 workers"


def test_create_subprocess_envs_takes_auto_too():
    envs = create_subprocess_envs([CountingEnv] * 2, envs_per_worker="auto")
    try:
        assert [env.env_index for env in envs] == [0, 1]
        assert all(env.reset(seed=0)[0].tolist() == [0.0] for env in envs)
    finally:
        for env in envs:
            env.close()


@pytest.mark.fault
def test_a_hang_while_auto_times_env_0_is_killed_at_its_deadline():
    """0.2 s of steps, one step past it and two resets: about 1.2 s here, not 1000 steps."""
    hang = functools.partial(HangOnStep, at_count=5)
    began = time.monotonic()
    with pytest.raises(EnvCrashedError, match=r"died \(timeout\)"):
        MultiEnv(
            [hang] * 2,
            envs_per_worker="auto",
            step_timeout=0.3,
            reset_timeout=0.3,
            restart_policy=RestartPolicy(max_restarts=0),
        )
    assert time.monotonic() - began < 10


def test_an_env_that_random_actions_break_says_what_auto_did():
    with pytest.raises(EnvError, match=r"env 0: measure\(\) raised .*boom.* random actions"):
        MultiEnv([RaiseOnStep] * 2, envs_per_worker="auto")


def test_auto_fails_as_env_0_would_and_leaves_no_worker():
    with pytest.raises(EnvError, match="env 0"):
        MultiEnv([RaiseInInit, CountingEnv], envs_per_worker="auto")


@pytest.mark.parametrize("build", [MultiEnv, create_subprocess_envs])
def test_bad_layouts_are_refused_before_anything_starts(build):
    with pytest.raises(ValueError, match="int >= 1 or 'auto', got 'fast'"):
        build([CountingEnv] * 2, envs_per_worker="fast")
    placements = [WorkerPlacement(), WorkerPlacement()]
    with pytest.raises(ValueError, match="chooses how many workers there are"):
        build([CountingEnv] * 2, envs_per_worker="auto", placement=placements)


def test_auto_builds_env_0_under_worker_0s_placement():
    def tag(worker_index):
        return WorkerPlacement(env={"MULTIENV_TEST_WORKER": f"w{worker_index}"})

    with MultiEnv([EnvironEcho] * 2, envs_per_worker="auto", placement=tag) as envs:
        tags = envs.call("getenv", "MULTIENV_TEST_WORKER")
        assert tags == tuple(f"w{i // envs.layout.envs_per_worker}" for i in range(2))


def test_a_list_of_placements_works_when_the_workers_outnumber_the_cores():
    """The module server's probe builds env 0 under worker 0's placement, not the list's."""
    workers = CORES + 1  # a probe worker builds env 0 first: a fresh process's first vector
    script = textwrap.dedent(
        f"""
        from multienv import MultiEnv, WorkerPlacement
        from tests.envs import EnvironEcho
        if __name__ == "__main__":
            placements = [WorkerPlacement(env={{"MULTIENV_TEST_WORKER": str(i)}})
                          for i in range({workers})]
            with MultiEnv([EnvironEcho] * {workers}, placement=placements) as envs:
                print(",".join(envs.call("getenv", "MULTIENV_TEST_WORKER")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [",".join(str(i) for i in range(workers))]


def test_a_backend_without_auto_says_so():
    with pytest.raises(ValueError, match="'auto' is not offered by the 'ray' backend"):
        MultiEnv([CountingEnv] * 2, backend="ray", envs_per_worker="auto")
