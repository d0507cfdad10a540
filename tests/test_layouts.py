"""The MultiEnv contract for every layout and backend.

Each test runs once per layout: on subprocesses with ``envs_per_worker`` 1, 3 and N (N=7,
so that 3 does not divide it), in hot mode (``wait="spin"``) with 4 (two workers) and N,
and on Ray actors (a local cluster, started once per
session) with 3, and N where it matters, the way SB3 runs its VecEnv suite once per
backend. The Ray layouts skip, saying why, when Ray is not installed. Ray with one env per
actor is left to ``tests/test_ray_backend.py`` and the benchmark: seven actors per test
would cost the suite more time than it proves.
"""

import functools
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from multienv import (
    EnvCrashLoopError,
    EnvError,
    MultiEnv,
    RestartPolicy,
    create_subprocess_envs,
)
from tests.conftest import STEP_RAISED, Layout, leakable_shm_names, live_workers
from tests.envs import (
    ActionTypeEnv,
    BigFrameEnv,
    CountingEnv,
    DictObsEnv,
    FrameDictObsEnv,
    FrameObsEnv,
    HangOnStep,
    RaiseOnStep,
    SegfaultEveryStep,
    SegfaultOnceFrameEnv,
    SegfaultOnceOnStep,
    SleepyEnv,
    SlowReset,
    TextObsEnv,
)
from tests.test_multi_env import run_side_by_side

N = 7
MODES = list(AutoresetMode)
SPINNING = [
    Layout("subprocess", k, "spin") for k in (4, N) if -(-N // k) <= len(os.sched_getaffinity(0))
]
SUBPROCESS = [*(Layout("subprocess", k) for k in (1, 3, N)), *SPINNING]
LAYOUTS = [*SUBPROCESS, Layout("ray", 3)]


def _layout_id(layout: Layout) -> str:
    return f"{layout.backend}-k{layout.k}" + ("-spin" if layout.wait == "spin" else "")


layouts = pytest.mark.parametrize("layout", LAYOUTS, indirect=True, ids=_layout_id)
# The autoreset modes live in MultiEnv, the same for every backend: Ray runs NextStep only.
layouts_and_modes = pytest.mark.parametrize(
    ("layout", "mode"),
    [(layout, mode) for layout in SUBPROCESS for mode in MODES]
    + [(Layout("ray", k), AutoresetMode.NEXT_STEP) for k in (3, N)],
    indirect=["layout"],
    ids=lambda value: _layout_id(value) if isinstance(value, Layout) else value.value,
)


def cartpole():
    return gym.make("CartPole-v1")


def worker_of(envs, env_index):
    """The env indices that share env_index's worker process."""
    pid = envs.envs[env_index].pid
    return [i for i, proxy in enumerate(envs.envs) if proxy.pid == pid]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("layout", [*LAYOUTS, Layout("ray", N)], indirect=True, ids=_layout_id)
def test_env_i_lives_in_worker_i_floor_k_and_pid_names_its_process(layout):
    with MultiEnv([CountingEnv] * N, **layout.options) as envs:
        pids = [proxy.pid for proxy in envs.envs]
        assert len(set(pids)) == -(-N // layout.k)
        for i in range(N):
            assert pids[i] == pids[(i // layout.k) * layout.k]
        for i, proxy in enumerate(envs.envs):
            assert proxy.env_index == i
    assert layout.live() == []


@layouts_and_modes
@pytest.mark.parametrize(
    "factory",
    [cartpole, DictObsEnv, TextObsEnv, FrameObsEnv, FrameDictObsEnv],
    ids=lambda f: f.__name__,
)
def test_matches_sync_vector_env_step_by_step(layout, mode, factory):
    ended = run_side_by_side(factory, mode, steps=200, num_envs=N, seed=11, **layout.options)
    assert ended > N


@layouts
def test_envs_get_their_actions_as_sync_vector_env_gives_them(layout):
    """Discrete actions arrive as numpy integers, whether one env steps or several."""
    fns = [ActionTypeEnv] * N
    ref = SyncVectorEnv(fns)
    try:
        with MultiEnv(fns, **layout.options) as ours:
            for envs in (ours, ref):
                envs.reset(seed=0)
                envs.step(np.arange(N) % 2)
            ours.send(np.ones(1, dtype=np.int64), [0])  # one env of its worker alone
            ours.recv(batch_size=1)
            got = ours.get_attr("action_types")
        expected = ref.get_attr("action_types")
        assert expected[0] == ["int64"]
        assert got[0] == expected[0] * 2
        assert list(got[1:]) == list(expected[1:])
    finally:
        ref.close()


@pytest.mark.fault
@layouts_and_modes
def test_sigkill_of_a_worker_truncates_each_of_its_envs_and_leaves_the_rest(layout, mode):
    fns = [cartpole] * N
    ours = MultiEnv(fns, autoreset_mode=mode, **layout.options)
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        obs, _ = ours.reset(seed=5)
        ref.reset(seed=5)
        actions = np.ones(N, dtype=np.int64)
        for _ in range(3):
            obs, *_ = ours.step(actions)
            ref.step(actions)
        victims = worker_of(ours, 4)
        others = [i for i in range(N) if i not in victims]
        seen = obs[victims].copy()
        old_pid = ours.envs[4].pid
        os.kill(old_pid, signal.SIGKILL)
        obs, rewards, terminations, truncations, infos = ours.step(actions)
        want = ref.step(actions)
        assert truncations[victims].all()
        assert not terminations[victims].any()
        assert (rewards[victims] == 0.0).all()
        assert infos["_multienv"].tolist() == [i in victims for i in range(N)]
        assert all(infos["multienv"]["cause"][i] == layout.cause("SIGKILL") for i in victims)
        if mode is AutoresetMode.SAME_STEP:
            np.testing.assert_array_equal(np.stack(infos["final_obs"][victims]), seen)
        else:
            np.testing.assert_array_equal(obs[victims], seen)
        # The envs of other workers are untouched: still equal to the reference.
        np.testing.assert_array_equal(obs[others], want[0][others])
        np.testing.assert_array_equal(rewards[others], want[1][others])
        if mode is AutoresetMode.DISABLED:
            ours.reset(options={"reset_mask": truncations.copy()})
        assert ours.envs[4].pid != old_pid
        for t in range(300):
            obs, rewards, terminations, truncations, infos = ours.step(actions)
            want = ref.step(actions)
            np.testing.assert_array_equal(obs[others], want[0][others], err_msg=f"step {t}")
            assert "multienv" not in infos
            for reference, result in (
                (ref, want),
                (ours, (obs, rewards, terminations, truncations)),
            ):
                done = result[2] | result[3]
                if mode is AutoresetMode.DISABLED and done.any():
                    reference.reset(options={"reset_mask": done})
        stats = ours.stats()
        assert [row["restarts"] for row in stats] == [int(i in victims) for i in range(N)]
    finally:
        ours.close()
        ref.close()
    assert layout.live() == []


@pytest.mark.fault
@layouts
def test_segfault_in_one_env_truncates_its_worker_mates(layout, tmp_path):
    marker = str(tmp_path / "segv")
    fns = [CountingEnv] * N
    fns[5] = functools.partial(SegfaultOnceOnStep, marker, at_count=3)
    with MultiEnv(fns, **layout.options) as envs:
        envs.reset()
        victims = worker_of(envs, 5)
        for _ in range(2):
            envs.step(np.ones(N, dtype=np.int64))
        obs, _, _, truncations, infos = envs.step(np.ones(N, dtype=np.int64))
        assert np.flatnonzero(truncations).tolist() == victims
        assert all(infos["multienv"]["cause"][i] == layout.cause("SIGSEGV") for i in victims)
        others = [i for i in range(N) if i not in victims]
        assert obs[others, 0].tolist() == [3.0 if i != 5 else 0.0 for i in others]
        for _ in range(100):
            envs.step(np.ones(N, dtype=np.int64))
        assert [row["restarts"] for row in envs.stats()] == [int(i in victims) for i in range(N)]


@pytest.mark.fault
@layouts
def test_a_worker_dying_mid_step_after_writing_some_large_frames_returns_the_seen_ones(
    layout, tmp_path
):
    marker = str(tmp_path / "segv")
    fns = [BigFrameEnv] * N
    fns[5] = functools.partial(SegfaultOnceFrameEnv, marker, at_count=3)  # last of its worker
    local = BigFrameEnv()
    local.reset()
    with MultiEnv(fns, **layout.options) as envs:
        envs.reset()
        victims = worker_of(envs, 5)
        for _ in range(2):
            seen, *_ = envs.step(np.ones(N, dtype=np.int64))
            want, *_ = local.step(1)
        obs, _, _, truncations, _ = envs.step(np.ones(N, dtype=np.int64))
        want, *_ = local.step(1)
        assert np.flatnonzero(truncations).tolist() == victims
        # The victims' frames are the ones the caller saw, not the ones mates wrote meanwhile.
        np.testing.assert_array_equal(obs[victims], seen[victims])
        for i in range(N):
            if i not in victims:
                np.testing.assert_array_equal(obs[i], want, err_msg=f"env {i}")


@pytest.mark.fault
@layouts
def test_hang_past_step_timeout_kills_the_worker_and_truncates_its_envs(layout):
    fns = [CountingEnv] * N
    fns[2] = functools.partial(HangOnStep, at_count=2)
    with MultiEnv(fns, **layout.options, step_timeout=0.5) as envs:
        envs.reset()
        victims = worker_of(envs, 2)
        hung = envs.envs[2].pid
        envs.step(np.ones(N, dtype=np.int64))
        _, _, _, truncations, infos = envs.step(np.ones(N, dtype=np.int64))
        assert np.flatnonzero(truncations).tolist() == victims
        assert all(infos["multienv"]["cause"][i] == "timeout" for i in victims)
        assert envs.envs[2].pid != hung


@pytest.mark.fault
@layouts
def test_env_error_in_one_env_names_it_and_its_siblings_are_neither_lost_nor_stepped_twice(layout):
    fns = [CountingEnv] * N
    fns[4] = functools.partial(RaiseOnStep, at_count=2)
    with MultiEnv(fns, **layout.options) as envs:
        envs.reset()
        pids = [proxy.pid for proxy in envs.envs]
        envs.step(np.ones(N, dtype=np.int64))
        actions = np.ones(N, dtype=np.int64)
        actions[4] = 0  # the env after the raiser still gets its own action, not this one
        with pytest.raises(EnvError, match=rf"env 4: {STEP_RAISED}: boom") as caught:
            envs.step(actions)
        assert caught.value.env_index == 4
        # The others did step: their results travel with the error, none is lost.
        obs, rewards, terminations, truncations, _ = caught.value.results
        assert caught.value.failed_env_ids == [4]
        assert obs[:, 0].tolist() == [2.0, 2.0, 2.0, 2.0, 1.0, 2.0, 2.0]  # env 4: as it was
        assert rewards.tolist() == [1.0] * 4 + [0.0] + [1.0] * 2
        assert not terminations.any()
        assert not truncations.any()
        assert [proxy.pid for proxy in envs.envs] == pids  # no worker died
        counts = envs.get_attr("count")
        assert counts == tuple(2 for _ in range(N))  # every env stepped exactly twice
        envs.reset()
        obs, *_ = envs.step(np.ones(N, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0] * N


@pytest.mark.fault
@layouts
def test_crash_loop_in_a_shared_worker_raises_crash_loop_error_naming_an_env_of_it(layout):
    fns = [CountingEnv] * N
    fns[6] = SegfaultEveryStep
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff=0.01)
    with MultiEnv(fns, **layout.options, restart_policy=policy) as envs:
        victims = worker_of(envs, 6)
        envs.reset()
        for _ in range(2):
            envs.step(np.ones(N, dtype=np.int64))
            envs.step(np.ones(N, dtype=np.int64))  # NextStep: the victims reset here
        with pytest.raises(EnvCrashLoopError) as caught:
            envs.step(np.ones(N, dtype=np.int64))
        assert caught.value.env_index == victims[0]
        assert caught.value.cause == layout.cause("SIGSEGV")
        if layout.backend == "subprocess":  # Ray keeps an actor's stderr in its log folder
            assert "about to dereference NULL" in caught.value.stderr_tail
        else:
            assert "SYSTEM_ERROR" in "\n".join(caught.value.stderr_tail)
    assert layout.live() == []


@pytest.mark.fault
@layouts
def test_worker_killed_during_reset_replays_it_for_each_of_its_envs(layout):
    with MultiEnv([functools.partial(SlowReset, 0.2)] * N, **layout.options) as envs:
        victim = envs.envs[N - 1].pid
        timer = threading.Timer(0.1, os.kill, (victim, signal.SIGKILL))
        timer.start()
        obs, infos = envs.reset(seed=3)
        timer.join()
        assert obs[:, 0].tolist() == [0.0] * N
        assert infos["seed_used"].tolist() == [3 + i for i in range(N)]
        assert envs.envs[N - 1].pid != victim
        assert envs.stats()[N - 1]["restarts"] == 1


@layouts
def test_send_recv_partial_batches(layout):
    with MultiEnv([CountingEnv] * N, **layout.options) as envs:
        envs.reset()
        envs.send(np.ones(N, dtype=np.int64))
        seen = []
        obs, _, _, _, infos = envs.recv(batch_size=2)
        assert len(infos["env_id"]) == 2
        assert obs[:, 0].tolist() == [1.0, 1.0]
        seen += infos["env_id"].tolist()
        envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
        while len(seen) < N + 2:
            *_, infos = envs.recv(batch_size=1)
            seen += infos["env_id"].tolist()
        assert sorted(seen) == sorted([*range(N), *seen[:2]])
        assert [row["steps"] for row in envs.stats()] == [
            2 if i in seen[:2] else 1 for i in range(N)
        ]


@pytest.mark.fault
@layouts
def test_close_is_bounded_and_leaves_no_process_fd_or_shared_memory(layout):
    MultiEnv([CountingEnv], **layout.options).close()  # the forkserver's fds stay: start it
    fds_before = open_fds()
    shm_before = leakable_shm_names()
    fns = [CountingEnv] * N
    fns[1] = functools.partial(HangOnStep, at_count=1)
    envs = MultiEnv(fns, **layout.options)
    envs.reset()
    envs.step_async(np.ones(N, dtype=np.int64))
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close(timeout=0.5)
    assert layout.live() == []
    if layout.backend == "subprocess":  # Ray's client opens and closes fds of its own
        assert open_fds() <= fds_before
    assert leakable_shm_names() <= shm_before


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_a_leak_check_counts_what_a_test_could_leave_not_another_programs_files():
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    foreign = [f"/dev/shm/chaos-ctl-{tag}.bin", f"/dev/shm/sem.mp-{tag}", f"/dev/shm/psm_{tag}"]
    ours = f"/dev/shm/multienv-left-{tag}"
    before = leakable_shm_names()
    try:
        for path in [*foreign, ours]:
            with open(path, "wb"):
                pass
        assert leakable_shm_names() - before == {os.path.basename(ours)}
    finally:
        for path in [*foreign, ours]:
            os.unlink(path)
    assert leakable_shm_names() == before


@pytest.mark.fault
def test_worker_mates_not_in_flight_when_it_dies_get_a_flagged_truncation_without_a_step():
    # Steps of 0.2 s, so that the kill lands while env 0's step is in flight.
    with MultiEnv([functools.partial(SleepyEnv, 0.2)] * 3, envs_per_worker=3) as envs:
        envs.reset()
        envs.step(np.ones(3, dtype=np.int64))
        old_pid = envs.envs[0].pid
        envs.send(np.ones(1, dtype=np.int64), [0])  # only env 0 is in flight
        os.kill(old_pid, signal.SIGKILL)
        obs, rewards, _, truncations, infos = envs.recv()
        assert infos["env_id"].tolist() == [0]
        assert truncations.tolist() == [True]
        assert rewards.tolist() == [0.0]
        assert infos["multienv"]["cause"].tolist() == ["SIGKILL"]
        # Envs 1 and 2 lost their episode with the worker: told on their next step, which
        # does not reach the fresh env (whose count would start again from 0).
        obs, rewards, _, truncations, infos = envs.step(np.ones(3, dtype=np.int64))
        assert truncations.tolist() == [False, True, True]
        assert obs[:, 0].tolist() == [0.0, 1.0, 1.0]  # env 0 resets (NextStep); 1, 2 as seen
        assert infos["multienv"]["cause"][1:].tolist() == ["SIGKILL", "SIGKILL"]
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0, 0.0, 0.0]
        assert [row["restarts"] for row in envs.stats()] == [1, 1, 1]


@layouts
def test_max_concurrency_steps_every_env_once(layout):
    with MultiEnv([CountingEnv] * N, **layout.options, max_concurrency=2) as envs:
        envs.reset()
        for step in range(1, 4):
            obs, *_ = envs.step(np.ones(N, dtype=np.int64))
            assert obs[:, 0].tolist() == [float(step)] * N
        assert envs.get_attr("count") == tuple([3] * N)


def test_a_shared_workers_envs_close_one_by_one_and_the_worker_stops_with_the_last():
    proxies = create_subprocess_envs([CountingEnv] * 3, envs_per_worker=3)
    assert len({proxy.pid for proxy in proxies}) == 1
    proxies[0].close()
    assert proxies[1].reset()[0].tolist() == [0.0]  # the worker still serves its other envs
    with pytest.raises(ClosedEnvironmentError):
        proxies[0].reset()
    proxies[1].close()
    proxies[2].close()
    assert live_workers() == []


@pytest.mark.fault
def test_restart_on_error_in_a_shared_worker_truncates_the_raiser_now_and_its_mates_next():
    fns = [CountingEnv, functools.partial(RaiseOnStep, at_count=2), CountingEnv]
    with MultiEnv(fns, envs_per_worker=3, restart_on_error=True) as envs:
        envs.reset()
        pid = envs.envs[0].pid
        envs.step(np.ones(3, dtype=np.int64))
        obs, rewards, _, truncations, infos = envs.step(np.ones(3, dtype=np.int64))
        assert truncations.tolist() == [False, True, False]
        assert infos["multienv"]["cause"][1] == "error: ValueError"
        assert obs[:, 0].tolist() == [2.0, 1.0, 2.0]  # the mates' real second step is kept
        assert rewards.tolist() == [1.0, 0.0, 1.0]
        assert envs.envs[0].pid != pid
        obs, _, _, truncations, infos = envs.step(np.ones(3, dtype=np.int64))
        assert truncations.tolist() == [True, False, True]  # their episode died with the worker
        assert obs[:, 0].tolist() == [2.0, 0.0, 2.0]
        assert [row["restarts"] for row in envs.stats()] == [1, 1, 1]
