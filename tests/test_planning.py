"""States and step_batch, against local replays; worker deaths during them."""

import functools
import os
import pickle
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from multienv import EnvCrashLoopError, EnvError, EnvSnapshot, MultiEnv, RestartPolicy
from multienv.wire.protocol import PairResults, Pairs, pack_states
from tests.conftest import Layout
from tests.envs import (
    ActionTypeEnv,
    ArrayStateCartPole,
    CountingEnv,
    SegfaultOnceThenHang,
    SlowReset,
    StatefulCartPole,
)

N = 4


def cartpole():
    return gym.make("CartPole-v1")


class Local:
    """Steps a local copy of an env from a snapshot, the way a worker does."""

    def __init__(self, factory):
        self.env = factory()

    def restore(self, state):
        if isinstance(state, EnvSnapshot):
            self.env = pickle.loads(state.data)
        else:  # the env's own state, as its get_state() returned it
            self.env.set_state(state)

    def signature(self):
        """What a state determines: compared across a restore, not byte for byte."""
        unwrapped = self.env.unwrapped
        elapsed = getattr(self.env, "_elapsed_steps", getattr(unwrapped, "t", None))
        return np.array(unwrapped.state, dtype=np.float64).tolist(), elapsed

    def run(self, state, action, dt):
        self.restore(state)
        total, terminated, truncated = 0.0, False, False
        for _ in range(dt):
            obs, reward, terminated, truncated, _ = self.env.step(action)
            total += reward
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, self.signature()


@pytest.mark.parametrize("factory", [cartpole, StatefulCartPole], ids=lambda f: f.__name__)
def test_step_batch_equals_stepping_a_local_copy_from_the_same_state(factory):
    with MultiEnv([factory] * N, envs_per_worker=2) as envs:
        envs.reset(seed=3)
        rng = np.random.default_rng(0)
        for _ in range(5):
            envs.step(rng.integers(2, size=N))
        states = envs.get_states()
        if factory is StatefulCartPole:  # the env's own get_state() values, as they are
            assert all(isinstance(state, tuple) for state in states)
        else:
            assert {state.kind for state in states} == {"object"}
        local, check = Local(factory), Local(factory)
        for m in (N // 4, N, 5 * N):
            for dt in (1, 3):
                pair_states = [states[j % N] for j in range(m)]
                actions = rng.integers(2, size=m)
                new_states, obs, rewards, terminated, truncated, infos = envs.step_batch(
                    actions, pair_states, dt=dt
                )
                assert obs.shape == (m, 4)
                assert rewards.dtype == np.float64
                assert terminated.dtype == truncated.dtype == np.bool_
                assert len(new_states) == len(infos) == m
                for j in range(m):
                    want = local.run(pair_states[j], int(actions[j]), dt)
                    np.testing.assert_array_equal(obs[j], want[0], err_msg=f"M={m} dt={dt} j={j}")
                    assert (rewards[j], terminated[j], truncated[j]) == want[1:4]
                    check.restore(new_states[j])
                    assert check.signature() == want[4]


def test_step_batch_gives_envs_their_actions_as_sync_vector_env_gives_them():
    sync = gym.vector.SyncVectorEnv([ActionTypeEnv] * 2)
    sync.reset(seed=0)
    sync.step(np.ones(2, dtype=np.int64))
    want = sync.get_attr("action_types")
    with MultiEnv([ActionTypeEnv] * 2) as envs:
        envs.reset(seed=0)
        states = envs.get_states()  # whole envs, pickled: each pair runs on a fresh copy
        envs.step_batch(np.ones(4, dtype=np.int64), states * 2)
        assert envs.get_attr("action_types") == want == (["int64"], ["int64"])


def test_step_batch_of_no_pairs_returns_empty_results():
    with MultiEnv([ArrayStateCartPole] * 2) as envs:
        envs.reset(seed=0)
        states, obs, rewards, terminated, truncated, infos = envs.step_batch(
            np.zeros(0, dtype=np.int64), []
        )
        assert states == infos == []
        assert obs.shape == (0, 4)
        assert obs.dtype == envs.single_observation_space.dtype
        assert rewards.shape == terminated.shape == truncated.shape == (0,)
        assert (rewards.dtype, terminated.dtype, truncated.dtype) == (np.float64, bool, bool)


def test_step_batch_dt_per_pair_stops_at_the_episodes_end():
    with MultiEnv([functools.partial(CountingEnv, 5)] * 2) as envs:
        envs.reset()
        state = envs.get_states()[0]
        _, obs, rewards, terminated, _, _ = envs.step_batch(
            np.ones(3, dtype=np.int64), [state] * 3, dt=np.array([1, 4, 9])
        )
        assert obs[:, 0].tolist() == [1.0, 4.0, 5.0]  # the third stops at the end, step 5
        assert rewards.tolist() == [1.0, 4.0, 5.0]
        assert terminated.tolist() == [False, False, True]


def test_step_batch_without_states_steps_the_envs_from_where_they_are():
    with MultiEnv([CountingEnv] * 3, envs_per_worker=3) as envs:
        envs.reset()
        envs.step(np.ones(3, dtype=np.int64))
        new_states, obs, *_ = envs.step_batch(np.ones(3, dtype=np.int64), dt=2)
        assert obs[:, 0].tolist() == [3.0, 3.0, 3.0]
        envs.set_states(new_states)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        assert obs[:, 0].tolist() == [4.0, 4.0, 4.0]


def test_bad_step_batch_input_raises_before_anything_is_sent():
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset()
        states = envs.get_states()
        with pytest.raises(ValueError, match=r"shape \(3,\); expected \(2,\) for 2 states"):
            envs.step_batch(np.ones(3, dtype=np.int64), states)
        with pytest.raises(TypeError, match="state 1 is a dict"):
            envs.step_batch(np.ones(2, dtype=np.int64), [states[0], {}])
        alien = EnvSnapshot("somewhere.OtherEnv", "state", None)
        with pytest.raises(ValueError, match=r"state 0 is of a somewhere\.OtherEnv env"):
            envs.step_batch(np.ones(1, dtype=np.int64), [alien])
        with pytest.raises(ValueError, match="dt must be an int >= 1"):
            envs.step_batch(np.ones(2, dtype=np.int64), states, dt=0)
        with pytest.raises(ValueError, match="pass 2 actions, got 3"):
            envs.step_batch(np.ones(3, dtype=np.int64))
        with pytest.raises(ValueError, match="set_states\\(\\) got 1 states for 2 envs"):
            envs.set_states(states[:1])
        assert envs.get_attr("count") == (0, 0)  # nothing was stepped


@pytest.mark.fault
@pytest.mark.parametrize("slow_class", ["SlowStepCartPole", "SlowArrayStateCartPole"])
def test_a_worker_sigkilled_during_step_batch_is_replayed_to_the_undisturbed_result(slow_class):
    # A share lasts 0.3 s; the kill lands at 0.02 s. The array states are plangym's form.
    factory = functools.partial(globals()[slow_class], 0.005)
    with MultiEnv([factory] * N, envs_per_worker=2) as envs:
        envs.reset(seed=1)
        states = envs.get_states()
        actions = np.arange(40) % 2
        want = envs.step_batch(actions, states * 10, dt=3)
        victim = envs.envs[0].pid
        timer = threading.Timer(0.02, os.kill, (victim, signal.SIGKILL))
        timer.start()
        got = envs.step_batch(actions, states * 10, dt=3)
        timer.join()
        assert envs.envs[0].pid != victim
        for part_got, part_want in zip(got[1:5], want[1:5], strict=True):
            np.testing.assert_array_equal(part_got, part_want)
        replayed = [j for j, info in enumerate(got[5]) if "multienv" in info]
        assert replayed == list(range(20))  # worker 0's share: the first half of the pairs
        assert got[5][0]["multienv"]["cause"] == "SIGKILL"
        assert got[5][0]["multienv"]["replayed"] is True
        if slow_class == "SlowArrayStateCartPole":  # states come back in the env's own form
            assert all(isinstance(state, np.ndarray) for state in got[0])
            for state_got, state_want in zip(got[0], want[0], strict=True):
                np.testing.assert_array_equal(state_got, state_want)


@pytest.mark.fault
@pytest.mark.timeout(30)
def test_a_step_batch_replayed_after_a_death_keeps_its_deadline(tmp_path):
    """The replay of a dead worker's share hangs: step_timeout kills it as it did the first."""
    factory = functools.partial(SegfaultOnceThenHang, str(tmp_path / "crashed"))
    policy = RestartPolicy(max_restarts=1, window_s=60.0)
    with MultiEnv([factory], step_timeout=0.5, restart_policy=policy) as envs:
        envs.reset(seed=0)
        states = envs.get_states()
        began = time.monotonic()
        with pytest.raises(EnvCrashLoopError, match="timeout"):
            envs.step_batch(np.ones(1, dtype=np.int64), states, dt=2)
        assert time.monotonic() - began < 10  # one segfault, one replay killed at 2 x 0.5 s


@pytest.mark.fault
def test_set_states_survives_a_respawn_and_the_restored_env_goes_on_from_its_state():
    with MultiEnv([functools.partial(SlowReset, 0.0)] * 2) as envs:
        envs.reset()
        for _ in range(3):
            envs.step(np.ones(2, dtype=np.int64))
        states = envs.get_states()
        os.kill(envs.envs[1].pid, signal.SIGKILL)
        envs.set_states(states)  # env 1's worker is dead: respawned, then the state restored
        obs, _, _, truncated, infos = envs.step(np.ones(2, dtype=np.int64))
        assert obs[:, 0].tolist() == [4.0, 4.0]
        assert truncated.tolist() == [False, False]
        assert "multienv" not in infos
        assert envs.stats()[1]["restarts"] == 1


def test_plangym_style_numpy_states_round_trip_and_step_batch_equals_a_local_replay():
    with MultiEnv([ArrayStateCartPole] * N, envs_per_worker=2) as envs:
        envs.reset(seed=5)
        envs.step(np.ones(N, dtype=np.int64))
        states = envs.get_states()
        assert all(isinstance(s, np.ndarray) and s.shape == (6,) for s in states)
        raw = [s + np.array([0.01 * i, 0, 0, 0, 0, 0]) for i, s in enumerate(states)]  # made up
        envs.set_states(raw)
        for got, want in zip(envs.get_states(), raw, strict=True):
            np.testing.assert_array_equal(got, want)
        actions = np.arange(3 * N) % 2
        new_states, obs, rewards, terminated, truncated, _ = envs.step_batch(actions, raw * 3, dt=4)
        local = Local(ArrayStateCartPole)
        for j in range(3 * N):
            want = local.run(raw[j % N], int(actions[j]), 4)
            np.testing.assert_array_equal(obs[j], want[0])
            assert (rewards[j], terminated[j], truncated[j]) == want[1:4]
            assert isinstance(new_states[j], np.ndarray)  # the same form as given
            np.testing.assert_array_equal(new_states[j], local.env.get_state())


def test_raw_states_are_refused_where_the_env_cannot_take_them():
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset()
        with pytest.raises(TypeError, match=r"env 1: the state is a ndarray.*no get_state"):
            envs.set_states([envs.get_states()[0], np.zeros(6)])
        with pytest.raises(TypeError, match="state 0 is a ndarray"):
            envs.step_batch(np.ones(1, dtype=np.int64), [np.zeros(6)])
        with pytest.raises(TypeError, match="takes a list of states"):
            envs.step_batch(np.ones(1, dtype=np.int64), np.zeros((1, 6)))
    with MultiEnv([ArrayStateCartPole] * 2) as envs:
        envs.reset()
        with pytest.raises(EnvError, match=r"env 1: set_state\(\) raised ValueError in its worker"):
            envs.set_states([envs.get_states()[0], np.zeros(3)])  # the env refuses it


class SlowStepCartPole(StatefulCartPole):
    """A StatefulCartPole whose steps take a little while, so a kill lands mid-batch."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def step(self, action):
        import time

        time.sleep(self.step_s)
        return super().step(action)


@pytest.mark.parametrize("layout", [Layout("ray", 2)], indirect=True, ids=["ray-k2"])
def test_states_and_step_batch_on_ray(layout):
    with MultiEnv([StatefulCartPole] * N, **layout.options) as envs:
        envs.reset(seed=2)
        states = envs.get_states()
        local = Local(StatefulCartPole)
        _, obs, *_ = envs.step_batch(np.ones(2 * N, dtype=np.int64), states * 2, dt=2)
        for j in range(2 * N):
            np.testing.assert_array_equal(obs[j], local.run(states[j % N], 1, 2)[0])
        envs.sync_states(states[0])
        obs, *_ = envs.step(np.ones(N, dtype=np.int64))
        assert (obs == obs[0]).all()


class SlowArrayStateCartPole(SlowStepCartPole, ArrayStateCartPole):
    """A SlowStepCartPole whose state is one numpy array."""


def test_states_of_one_shape_and_dtype_travel_as_one_array():
    rows = [np.arange(3.0) + i for i in range(4)]
    packed = pack_states(rows)
    assert isinstance(packed, np.ndarray)
    assert packed.shape == (4, 3)
    for got, want in zip(packed, rows, strict=True):
        np.testing.assert_array_equal(got, want)
    mixed_dtype = [np.zeros(3), np.zeros(3, dtype=np.float32)]
    mixed_shape = [np.zeros(3), np.zeros(4)]
    with_none = [np.zeros(3), None]
    objects = [np.array([{}], dtype=object)] * 2
    for states in (mixed_dtype, mixed_shape, with_none, objects, [np.zeros(3)]):
        assert pack_states(states) is states


ARRAYS = {
    "float rows": np.arange(12.0).reshape(3, 4),
    "strided ints": np.arange(12).reshape(3, 4)[:, ::2],
    "big-endian": np.arange(3, dtype=">f8"),
    "bools": np.array([True, False]),
    "0-d": np.array(5),
    "empty": np.zeros((2, 0)),
    "structured": np.zeros(2, dtype=[("a", "f4"), ("b", "i2")]),
    "objects": np.array([{}, None], dtype=object),
    "strings": np.array(["ab", "c"]),
}


@pytest.mark.parametrize("array", ARRAYS.values(), ids=ARRAYS.keys())
def test_pair_shares_and_results_pickle_their_arrays_back_equal_and_writable(array):
    pairs = pickle.loads(pickle.dumps(Pairs((0,), array, array, array), protocol=5))
    results = PairResults(array, array, array, array, array, [{}], {})
    results = pickle.loads(pickle.dumps(results, protocol=5))
    for got in (pairs.snapshots, pairs.actions, pairs.dts, results.obs, results.truncated):
        assert (got.dtype, got.shape) == (array.dtype, array.shape)
        np.testing.assert_array_equal(got, array)
        assert got.flags.writeable  # a state the caller gets back may be changed in place
