"""send()/recv() partial batches, max_concurrency, and the shared-memory data path."""

import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from multienv import EnvStateError, MultiEnv, create_subprocess_envs
from multienv.wire.framing import DONE_OK, DONE_RECORD
from tests.conftest import leakable_shm_names
from tests.envs import CountingEnv, KilledAfterItsDoneRecord, SleepyEnv, TextObsEnv

pytestmark = pytest.mark.timeout(60)


def max_overlap(intervals):
    """The largest number of (began, ended) intervals that contain one instant."""
    events = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def test_recv_returns_the_first_envs_to_finish_and_a_straggler_does_not_hold_them_back():
    fns = [functools.partial(SleepyEnv, slow_s=2.0)] + [functools.partial(SleepyEnv, 0.01)] * 3
    with MultiEnv(fns) as envs:
        envs.reset(seed=0)
        envs.send(np.ones(4, dtype=np.int64))
        began = time.monotonic()
        obs, rewards, terminations, truncations, infos = envs.recv(batch_size=3)
        assert time.monotonic() - began < 1.5  # the 2 s straggler was not waited for
        assert infos["env_id"].tolist() == [1, 2, 3]
        assert obs.shape == (3, 1)
        assert obs[:, 0].tolist() == [1.0, 1.0, 1.0]
        assert rewards.tolist() == [1.0, 1.0, 1.0]
        assert terminations.shape == truncations.shape == (3,)
        assert infos["count"].tolist() == [1, 1, 1]
        assert infos["_count"].all()

        envs.send(np.zeros(2, dtype=np.int64), env_ids=[1, 3])
        obs, *_, infos = envs.recv()  # all in flight: the straggler and envs 1 and 3
        assert infos["env_id"].tolist() == [0, 1, 3]
        assert obs[:, 0].tolist() == [1.0, 2.0, 2.0]


def test_send_and_recv_reject_misuse_before_anything_is_sent():
    with MultiEnv([CountingEnv] * 3) as envs:
        envs.reset()
        with pytest.raises(EnvStateError, match="no env in flight"):
            envs.recv()
        envs.send(np.zeros(1, dtype=np.int64), env_ids=[2])
        with pytest.raises(EnvStateError, match="env 2: already in flight"):
            envs.send(np.zeros(1, dtype=np.int64), env_ids=[2])
        with pytest.raises(ValueError, match="env 1: appears twice"):
            envs.send(np.zeros(2, dtype=np.int64), env_ids=[1, 1])
        with pytest.raises(ValueError, match="env 5: no such env"):
            envs.send(np.zeros(1, dtype=np.int64), env_ids=[5])
        with pytest.raises(ValueError, match="expected 2 actions"):
            envs.send(np.zeros(3, dtype=np.int64), env_ids=[0, 1])
        with pytest.raises(EnvStateError, match=r"envs \[2\] are in flight"):
            envs.step(np.zeros(3, dtype=np.int64))
        with pytest.raises(ValueError, match="batch_size"):
            envs.recv(batch_size=2)
        *_, infos = envs.recv()
        assert infos["env_id"].tolist() == [2]
        envs.step(np.zeros(3, dtype=np.int64))  # idle again


def test_recv_timeout_raises_and_loses_nothing():
    with MultiEnv([functools.partial(SleepyEnv, slow_s=1.0)] * 2) as envs:
        envs.reset()
        envs.send(np.ones(2, dtype=np.int64))
        with pytest.raises(TimeoutError, match="still in flight"):
            envs.recv(timeout=0.1)
        _obs, rewards, *_, infos = envs.recv(timeout=30)
        assert infos["env_id"].tolist() == [0, 1]
        assert rewards.tolist() == [1.0, 1.0]


def test_worker_killed_while_in_flight_comes_back_as_a_flagged_truncation():
    with MultiEnv([functools.partial(SleepyEnv, slow_s=1.0), CountingEnv]) as envs:
        envs.reset()
        envs.step(np.ones(2, dtype=np.int64))
        envs.send(np.ones(2, dtype=np.int64))
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        obs, rewards, _terminations, truncations, infos = envs.recv()
        assert truncations.tolist() == [True, False]
        assert rewards.tolist() == [0.0, 1.0]
        assert infos["multienv"]["restarted"][0]
        assert infos["multienv"]["_restarted"].tolist() == [
            True,
            False,
        ]
        assert obs[:, 0].tolist() == [1.0, 2.0]  # env 0: the last obs the caller saw


def test_max_concurrency_bounds_the_envs_stepping_at_once():
    with MultiEnv([functools.partial(SleepyEnv, 0.05)] * 6, max_concurrency=2) as envs:
        envs.reset()
        intervals = []
        for _ in range(3):
            obs, *_, infos = envs.step(np.ones(6, dtype=np.int64))
            intervals += list(zip(infos["began"], infos["ended"], strict=True))
        envs.step_async(np.ones(6, dtype=np.int64))
        obs, *_, infos = envs.step_wait(timeout=30)
        intervals += list(zip(infos["began"], infos["ended"], strict=True))
        assert obs[:, 0].tolist() == [4.0] * 6
        assert max_overlap(intervals) <= 2


def test_copy_false_returns_views_of_shared_memory_and_copy_true_does_not():
    with MultiEnv([CountingEnv] * 2, copy=False) as envs:
        first, _ = envs.reset()
        envs.step(np.ones(2, dtype=np.int64))
        second, *_ = envs.step(np.ones(2, dtype=np.int64))
        assert second[:, 0].tolist() == [2.0, 2.0]
        assert first[:, 0].tolist() == [2.0, 2.0]  # same slot as two steps ago: a view
    with MultiEnv([CountingEnv] * 2) as envs:
        first, _ = envs.reset()
        envs.step(np.ones(2, dtype=np.int64))
        envs.step(np.ones(2, dtype=np.int64))
        assert first[:, 0].tolist() == [0.0, 0.0]


def test_shared_memory_leaves_nothing_in_dev_shm():
    before = leakable_shm_names()
    with MultiEnv([CountingEnv] * 3) as envs:
        envs.reset()
        envs.step(np.ones(3, dtype=np.int64))
        os.kill(envs.envs[1].pid, signal.SIGKILL)
        envs.step(np.ones(3, dtype=np.int64))
        during = leakable_shm_names()
    assert during == before  # the memory file has no name


def test_spaces_that_are_not_fixed_shape_are_pickled_and_still_match_gymnasium():
    fns = [TextObsEnv] * 3
    ours, ref = MultiEnv(fns), SyncVectorEnv(fns)
    try:
        assert list(ours.reset(seed=0)[0]) == list(ref.reset(seed=0)[0])
        for t in range(12):
            actions = np.array([t % 2, 1, 0])
            got, want = ours.step(actions), ref.step(actions)
            assert list(got[0]) == list(want[0]), t
            np.testing.assert_array_equal(got[2], want[2])
    finally:
        ours.close()
        ref.close()


def test_box_actions_travel_through_shared_memory():
    def env_fn():
        return gym.wrappers.TransformReward(gym.make("Pendulum-v1"), lambda r: r)

    fns = [env_fn] * 2
    ours, ref = MultiEnv(fns), SyncVectorEnv(fns)
    try:
        np.testing.assert_array_equal(ours.reset(seed=3)[0], ref.reset(seed=3)[0])
        for t in range(20):
            actions = np.full((2, 1), np.sin(t), dtype=np.float32)
            got, want = ours.step(actions), ref.step(actions)
            np.testing.assert_allclose(got[0], want[0], err_msg=str(t))
            np.testing.assert_allclose(got[1], want[1], err_msg=str(t))
            # The step's actions are in the vector's shared buffer, which the workers read.
            np.testing.assert_array_equal(ours._link._shared.actions, actions)
    finally:
        ours.close()
        ref.close()


def test_step_timeout_in_flight_kills_the_hung_worker_and_recv_returns_a_truncation():
    fns = [functools.partial(SleepyEnv, slow_s=3600.0), functools.partial(SleepyEnv, 0.01)]
    with MultiEnv(fns, step_timeout=0.5) as envs:
        envs.reset()
        hung_pid = envs.envs[0].pid
        envs.send(np.ones(2, dtype=np.int64))
        *_, infos = envs.recv(batch_size=1)
        assert infos["env_id"].tolist() == [1]  # the healthy env is not held back
        _obs, rewards, _terminations, truncations, infos = envs.recv(timeout=30)
        assert infos["env_id"].tolist() == [0]
        assert truncations.tolist() == [True]
        assert rewards.tolist() == [0.0]
        assert infos["multienv"]["cause"].tolist() == ["timeout"]
        assert envs.envs[0].pid != hung_pid


def test_proxies_adopted_in_another_order_write_the_slots_of_their_new_positions():
    proxies = create_subprocess_envs([CountingEnv] * 3)
    try:
        for k, proxy in enumerate(proxies):
            proxy.set_attr("scale", float(k + 1))
        with MultiEnv([proxies[2], proxies[0]]) as envs:  # renumbered as envs 0 and 1
            envs.reset(seed=0)
            _, rewards, *_ = envs.step(np.ones(2, dtype=np.int64))
            assert rewards.tolist() == [3.0, 1.0]
    finally:
        for proxy in proxies:
            proxy.close()


def test_a_late_done_record_does_not_answer_the_next_request():
    with MultiEnv([functools.partial(SleepyEnv, 0.3)] * 2) as envs:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
        handle = envs.envs[0].supervisor.handle
        stale_seq = handle._seat.seq  # the batch just answered, as a killed worker would leave it
        envs.send(np.ones(2, dtype=np.int64))
        done_pipe = envs._link._shared.done.worker_fds(0)[0]  # worker 0's group
        os.write(done_pipe, DONE_RECORD.pack(0, stale_seq, DONE_OK))
        began = time.monotonic()
        obs, *_ = envs.recv(batch_size=1)
        assert time.monotonic() - began > 0.2  # not answered at once by the stale record
        assert obs[:, 0].tolist() == [2.0]  # the second step's observation
        envs.recv()


def test_several_collecting_threads_each_get_their_own_done_records():
    # With one done pipe for all, a thread could read the record another thread waits for
    # and leave it asleep. CartPole's info is empty, so the record is the whole reply.
    fns = [functools.partial(gym.make, "CartPole-v1")] * 6
    expected = SyncVectorEnv(fns)
    with MultiEnv(fns, num_threads=3) as envs:
        assert np.array_equal(envs.reset(seed=0)[0], expected.reset(seed=0)[0])
        for _ in range(300):
            actions = np.ones(6, dtype=np.int64)
            assert np.array_equal(envs.step(actions)[0], expected.step(actions)[0])
    expected.close()


def test_worker_killed_between_its_done_record_and_its_reply_comes_back_as_a_truncation(
    tmp_path,
):
    fn = functools.partial(KilledAfterItsDoneRecord, str(tmp_path / "killed"), at_count=3)
    with MultiEnv([CountingEnv, fn]) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            envs.step(np.ones(2, dtype=np.int64))
        obs, rewards, _, truncations, infos = envs.step(np.ones(2, dtype=np.int64))
        assert truncations.tolist() == [False, True]
        assert infos["multienv"]["cause"][1] == "SIGKILL"
        assert obs[:, 0].tolist() == [3.0, 2.0]  # env 1 keeps the observation seen last
        assert rewards.tolist() == [1.0, 0.0]
        obs, *_ = envs.step(np.ones(2, dtype=np.int64))  # NextStep: env 1 resets
        assert obs[:, 0].tolist() == [4.0, 0.0]
