"""The data plane: a vector's healthy step in one pass, and what it hands over.

Real workers throughout; the hand-overs are counted by wrapping ``DataPlane._hand_over``.
"""

from __future__ import annotations

import os
import signal
import stat
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv import MultiEnv
from multienv.wire.framing import DONE_REPLY, PLANNED_FRAMES
from tests.conftest import wait_until_dead
from tests.envs import CountingEnv, FixedLengthEnv, HangOnStep, SleepyEnv
from tests.test_multi_env import assert_same_tree

pytestmark = pytest.mark.timeout(60)


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_healthy_steps_never_reach_the_supervisors(hand_overs, mode):
    with MultiEnv([cartpole] * 6, envs_per_worker=2, autoreset_mode=mode) as envs:
        assert envs._data_plane is not None
        envs.reset(seed=0)
        finished_by_reset = hand_overs["finish"]
        ended = 0
        for _ in range(300):  # episodes end and reset in it (same-step: finals in infos)
            _, _, terminated, truncated, infos = envs.step(envs.action_space.sample())
            ended += int(np.count_nonzero(terminated | truncated))
            if mode is AutoresetMode.SAME_STEP and (terminated | truncated).any():
                assert infos["_final_obs"].tolist() == (terminated | truncated).tolist()
        assert ended > 20
        assert hand_overs == {"hand_over": 0, "finish": finished_by_reset}


@pytest.mark.parametrize("envs_per_worker", [1, 2, 3])
def test_same_step_finals_come_through_shared_memory_as_sync_vector_env_gives_them(
    hand_overs, envs_per_worker
):
    # Plain step infos ({"count": n}) and reset infos ({"seed_used": -1}): the whole answer
    # fits in shared memory, episodes of 1 to 5 steps ending alone and together.
    fns = [lambda n=n: FixedLengthEnv(n) for n in (2, 3, 3, 5, 1, 4)]
    mode = AutoresetMode.SAME_STEP
    ours = MultiEnv(fns, envs_per_worker=envs_per_worker, autoreset_mode=mode)
    ref = gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert_same_tree(ours.reset(seed=3), ref.reset(seed=3), "reset")
        actions = np.ones(6, dtype=np.int64)
        before = 0
        for t in range(45):
            if t == 5:  # each worker has sent the schemas of its infos and its resets' infos
                before = hand_overs["hand_over"]
            assert_same_tree(list(ours.step(actions)), list(ref.step(actions)), f"step {t}")
        assert hand_overs["hand_over"] == before
    finally:
        ours.close()
        ref.close()


@pytest.mark.fault
def test_a_death_handed_over_keeps_the_finals_the_other_workers_left_in_shared_memory(
    hand_overs,
):
    mode = AutoresetMode.SAME_STEP
    with MultiEnv([lambda: FixedLengthEnv(1)] * 4, envs_per_worker=2, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        for _ in range(2):  # every step ends every episode; the first registers schemas
            envs.step(actions)
        before = hand_overs["hand_over"]
        dead = envs.envs[0].pid
        os.kill(dead, signal.SIGKILL)
        wait_until_dead([dead])
        obs, _, terminated, truncated, infos = envs.step(actions)
        assert hand_overs["hand_over"] == before + 1
        assert terminated.tolist() == [False, False, True, True]  # the others ended as ever
        assert truncated.tolist() == [True, True, False, False]  # the crash's truncation
        assert infos["_final_obs"].tolist() == [True, True, True, True]
        assert [final.tolist() for final in infos["final_obs"][2:]] == [[1.0], [1.0]]
        assert infos["final_info"]["count"].tolist()[2:] == [1, 1]
        assert infos["multienv"]["_restarted"].tolist() == [True, True, False, False]
        assert obs[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0]  # each reset at once


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_counts_held_back_are_the_steps_and_episodes_of_each_env(mode):
    lengths = [3, 4, 5, 7]
    fns = [lambda n=n: FixedLengthEnv(n) for n in lengths]
    with MultiEnv(fns, envs_per_worker=2, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        steps, episodes = np.zeros(4, dtype=int), np.zeros(4, dtype=int)
        ended = np.zeros(4, dtype=bool)
        for t in range(600):  # past the 256 steps held back before a flush
            if mode is AutoresetMode.DISABLED and ended.any():
                envs.reset(options={"reset_mask": ended})
                ended[:] = False
            _, _, terminated, truncated, _ = envs.step(np.ones(4, dtype=np.int64))
            stepped = ~ended if mode is AutoresetMode.NEXT_STEP else np.ones(4, dtype=bool)
            steps += stepped
            ended = terminated | truncated
            episodes += ended
            if t % 97 == 0:  # read between flushes too
                assert [row["steps"] for row in envs.stats()] == steps.tolist()
        assert [row["steps"] for row in envs.stats()] == steps.tolist()
        assert [row["episodes"] for row in envs.stats()] == episodes.tolist()
        assert [envs.envs[i].episodes for i in range(4)] == episodes.tolist()
        assert np.isfinite(envs.stats()[0]["step_latency_p99_s"])


def test_a_death_is_handed_over_and_the_data_plane_takes_the_next_steps(hand_overs):
    with MultiEnv([lambda: CountingEnv(episode_length=1000)] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)  # the first step's infos register their schema: a hand-over
        before = hand_overs["hand_over"]
        dead = envs.envs[2].pid
        os.kill(dead, signal.SIGKILL)
        wait_until_dead([dead])
        _, _, _, truncated, infos = envs.step(actions)
        assert truncated.tolist() == [False, False, True, True]
        assert infos["multienv"]["cause"][2] == "SIGKILL"
        assert hand_overs["hand_over"] == before + 1
        for _ in range(3):  # the fresh worker's reset and step register their schemas again
            obs, *_ = envs.step(actions)
        after = hand_overs["hand_over"]
        for _ in range(20):
            obs, *_ = envs.step(actions)
        assert hand_overs["hand_over"] == after
        assert obs[:2, 0].tolist() == [25.0, 25.0]


def test_ctrl_c_in_the_wait_leaves_the_vector_stepping_on():
    def interrupt(*_):
        raise KeyboardInterrupt

    with MultiEnv([lambda: SleepyEnv(0.3)] * 2, envs_per_worker=1) as envs:
        envs.reset(seed=0)
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.ones(2, dtype=np.int64))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        obs, rewards, *_ = envs.step(np.ones(2, dtype=np.int64))
        # The interrupted step ran in the envs and was dropped; this one follows it.
        assert obs[:, 0].tolist() == [2.0, 2.0]
        assert rewards.tolist() == [1.0, 1.0]


def test_step_wait_timeout_keeps_the_data_plane_step_in_flight():
    with MultiEnv([lambda: SleepyEnv(0.3)] * 2) as envs:
        envs.reset(seed=0)
        envs.step_async(np.ones(2, dtype=np.int64))
        assert envs._data_plane.is_in_flight()
        with pytest.raises(TimeoutError):
            envs.step_wait(timeout=0.05)
        obs, *_ = envs.step_wait(timeout=10)
        assert obs[:, 0].tolist() == [1.0, 1.0]
        obs, *_ = envs.step(np.ones(2, dtype=np.int64))
        assert obs[:, 0].tolist() == [2.0, 2.0]


def test_a_worker_woken_twice_for_one_step_runs_it_once():
    with MultiEnv([CountingEnv] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        for _ in range(2):
            envs.step(actions)
        plane = envs._data_plane
        assert plane.send(actions)
        for fd in plane._wake_fds:  # as after Ctrl-C among the wake-ups
            os.write(fd, PLANNED_FRAMES[True])
        obs, *_ = plane.receive()
        assert obs[:, 0].tolist() == [3.0] * 4
        obs, *_ = envs.step(actions)
        assert obs[:, 0].tolist() == [4.0] * 4


def test_a_hang_past_step_timeout_is_killed_as_a_death():
    with MultiEnv([lambda: SleepyEnv(0.0, slow_s=30.0), CountingEnv], step_timeout=0.3) as envs:
        envs.reset(seed=0)
        began = time.monotonic()
        _, _, _, truncated, infos = envs.step(np.ones(2, dtype=np.int64))
        assert time.monotonic() - began < 5.0
        assert truncated.tolist() == [True, False]
        assert infos["multienv"]["cause"][0] == "timeout"


def test_a_stale_record_never_answers_a_step_handed_over(hand_overs):
    # A record read and not taken (the done pipe's copy of a round's last record, say)
    # whose seq came round again: after a death, the control plane would have taken it as
    # the slow worker's answer and waited for ever for the reply it announced.
    fns = [lambda: SleepyEnv(0.5), CountingEnv]
    with MultiEnv(fns, envs_per_worker=1) as envs:
        envs.reset(seed=0)
        actions = np.ones(2, dtype=np.int64)
        envs.step(actions)
        envs.step(actions)
        plane, done = envs._data_plane, envs._data_plane._shared.done
        done.done_seq[0] = plane._seq % 255 + 1  # the next step's seq, as a stale record
        done.done_kind[0] = DONE_REPLY
        dead = envs.envs[1].pid
        os.kill(dead, signal.SIGKILL)  # before the step: its sentinel, not its answer, comes
        wait_until_dead([dead])
        envs.step_async(actions)
        began = time.monotonic()
        obs, _, _, truncated, _ = envs.step_wait()
        assert time.monotonic() - began < 5.0
        assert truncated.tolist() == [False, True]
        assert obs[0, 0] == 3.0
        assert hand_overs["hand_over"] >= 1


def test_a_round_handed_over_on_a_death_collects_the_workers_that_answer_after_it(hand_overs):
    # Its workers answer in their status alone. The death hands the round over while two
    # workers still step: each must find no token left and wake the parent with its record
    # (the dead one's token, given up, would let only one of them do so).
    fns = [
        lambda: CountingEnv(episode_length=1000),
        lambda: HangOnStep(at_count=3),  # killed in its third step
        lambda: HangOnStep(at_count=3, hang_s=0.6),  # both done after the death is seen
        lambda: HangOnStep(at_count=3, hang_s=0.9),
    ]
    with MultiEnv(fns, envs_per_worker=1) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)  # the first infos' schemas: a hand-over
        envs.step(actions)
        before = hand_overs["hand_over"]
        envs.step_async(actions)
        time.sleep(0.2)
        dead = envs.envs[1].pid
        os.kill(dead, signal.SIGKILL)
        began = time.monotonic()
        obs, _, _, truncated, _ = envs.step_wait()
        assert time.monotonic() - began < 5.0
        assert truncated.tolist() == [False, True, False, False]
        assert obs[[0, 2, 3], 0].tolist() == [3.0, 3.0, 3.0]
        assert hand_overs["hand_over"] == before + 1


def test_once_attached_a_worker_reads_its_requests_from_a_pipe_and_closes_by_itself():
    envs = MultiEnv([CountingEnv] * 2, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
        fds = envs._data_plane.wake_fds  # where the step's wake-ups and requests go
        assert len(fds) == 2
        assert all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in fds)
        assert envs.call("add", 2, 3) == (5, 5)  # a request on the pipe, its reply on the socket
        pids = [envs.envs[i].pid for i in range(2)]
    finally:
        began = time.monotonic()
        envs.close()
    assert time.monotonic() - began < 2.0  # CLOSE read from the pipe: nothing killed late
    wait_until_dead(pids)
