"""timing: the caller's time split between waiting for the envs and its own work."""

import functools
import os
import signal
import time

import numpy as np
import pytest

from multienv import MultiEnv
from tests.envs import CountingEnv, SleepyEnv

pytestmark = pytest.mark.timeout(60)


def test_the_env_bound_share_is_what_the_caller_measures_itself():
    # A known env cost (5 ms a step) and a known policy delay (15 ms): about 25% env-bound.
    with MultiEnv([functools.partial(SleepyEnv, 0.005)] * 2) as envs:
        envs.reset(seed=0)
        actions = np.ones(2, dtype=np.int64)
        envs.step(actions)
        envs.timing()  # a new window from here
        in_step = 0.0
        began = time.perf_counter()
        for _ in range(40):
            t = time.perf_counter()
            envs.step(actions)
            in_step += time.perf_counter() - t
            time.sleep(0.015)  # the policy
        direct = in_step / (time.perf_counter() - began)
        split = envs.timing()
    assert 0.15 < direct < 0.45  # the setup is what it says
    assert abs(split["env_bound"] - direct) < 0.05
    assert split["env_s"] + split["policy_s"] == pytest.approx(split["wall_s"])
    assert [w["env_ids"] for w in split["workers"]] == [[0], [1]]
    assert split["workers"][0]["step_p50_s"] >= 0.005


def test_a_window_counts_its_own_restarts_and_the_time_they_took():
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset(seed=0)
        actions = np.ones(2, dtype=np.int64)
        envs.step(actions)
        envs.timing()
        os.kill(envs.envs[1].pid, signal.SIGKILL)
        envs.step(actions)
        split = envs.timing(reset=False)
        assert split["restarts"] == 1
        assert split["workers"][1]["restarts"] == 1
        assert split["workers"][1]["lost_s"] > 0
        assert split["workers"][0]["lost_s"] == 0
        assert envs.timing()["restarts"] == 1  # reset=False left the window open
        assert envs.timing()["restarts"] == 0  # a new window


def test_send_and_recv_count_as_time_in_the_vector():
    with MultiEnv([functools.partial(SleepyEnv, 0.02)] * 2) as envs:
        envs.reset(seed=0)
        envs.timing()
        envs.send(np.ones(2, dtype=np.int64))
        envs.recv()
        split = envs.timing()
    assert split["env_s"] >= 0.02
    assert split["env_bound"] > 0.5


def test_the_slowest_worker_is_named_on_the_one_pass_step_too():
    # One-pass steps share one round trip for all workers; each worker's own batch time,
    # which it keeps in shared memory, tells them apart.
    fns = [functools.partial(SleepyEnv, 0.001)] * 2 + [functools.partial(SleepyEnv, 0.03)]
    with MultiEnv(fns) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.ones(3, dtype=np.int64))
        split = envs.timing()
    assert envs._in_flight.parts is not None  # the vector stepped on its data plane
    assert split["slowest_workers"][0] == 2
    workers = split["workers"]
    assert workers[2]["batch_p50_s"] >= 0.03
    assert workers[0]["batch_p50_s"] < 0.02
    assert workers[0]["step_p50_s"] >= 0.03  # its round trip waited for the slow worker


def test_timing_prints_as_a_short_summary():
    from multienv import MultiEnv
    from tests.envs import CountingEnv

    with MultiEnv([CountingEnv] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(4, dtype=np.int64))
        report = envs.timing()
    text = str(report).splitlines()
    # Alike workers: none is named the slowest for noise, unless a busy machine made one
    # 1.25x and 0.1 ms slower than the median at its median.
    assert len(text) == 1 or text[1].startswith("slowest workers, median batch: worker ")
    assert "in the vector's calls" in text[0]
    assert "0 restarts, 0 recycles" in text[0]
    assert report["workers"][0]["env_ids"] == [0, 1]  # still the dict it was


def test_the_summary_counts_one_restart_and_names_a_slow_worker_once_in_its_window():
    fns = [functools.partial(SleepyEnv, 0.001)] * 2 + [functools.partial(SleepyEnv, 0.02)]
    with MultiEnv(fns) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.ones(3, dtype=np.int64))
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        envs.step(np.ones(3, dtype=np.int64))  # env 0's comes back a flagged truncation
        text = str(envs.timing()).splitlines()
        assert "1 restart, 0 recycles" in text[0]
        assert text[1].startswith("slowest workers, median batch: worker 2 (envs [2])")
        assert "worker 0" not in text[1]
        assert "worker 1" not in text[1]
        empty = envs.timing()  # a window with no step names no slowest worker
    assert empty["slowest_workers"] == []
    assert len(str(empty).splitlines()) == 1


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_stats_counts_the_envs_own_steps_as_its_docstring_says(mode):
    episodes_of_3 = functools.partial(CountingEnv, episode_length=3)
    with MultiEnv([episodes_of_3] * 2, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(2, dtype=np.int64))
        rows = envs.stats()
    if mode == "NextStep":  # every 4th step() call resets the env: 15 steps, 5 episodes
        assert [(row["steps"], row["episodes"]) for row in rows] == [(15, 5)] * 2
    else:
        assert [(row["steps"], row["episodes"]) for row in rows] == [(20, 6)] * 2
