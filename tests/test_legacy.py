"""Old-Gym-API envs through the worker's adapter, and per-env reset options."""

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv import MultiEnv
from multienv.worker.legacy import LegacyEnv, adapt
from tests.envs import CountingEnv, OldApiEnv, OptionsEcho

# Env 0 always plays 0: its 4th step is a time-limit truncation. Env 1 plays 2 on its 2nd
# step: a termination. Observations are [count, seed]; reset(seed=5) seeds 5 and 6.
ACTIONS = [[0, 0], [0, 2], [0, 0], [0, 0], [0, 0]]
EXPECTED = {  # per step: obs, rewards, terminated, truncated
    AutoresetMode.NEXT_STEP: [
        ([[1, 5], [1, 6]], [1, 1], [0, 0], [0, 0]),
        ([[2, 5], [2, 6]], [1, 10], [0, 1], [0, 0]),
        ([[3, 5], [0, 6]], [1, 0], [0, 0], [0, 0]),
        ([[4, 5], [1, 6]], [1, 1], [0, 0], [1, 0]),
        ([[0, 5], [2, 6]], [0, 1], [0, 0], [0, 0]),
    ],
    AutoresetMode.SAME_STEP: [
        ([[1, 5], [1, 6]], [1, 1], [0, 0], [0, 0]),
        ([[2, 5], [0, 6]], [1, 10], [0, 1], [0, 0]),
        ([[3, 5], [1, 6]], [1, 1], [0, 0], [0, 0]),
        ([[0, 5], [2, 6]], [1, 1], [0, 0], [1, 0]),
        ([[1, 5], [3, 6]], [1, 1], [0, 0], [0, 0]),
    ],
}


@pytest.mark.parametrize("mode", list(EXPECTED), ids=lambda m: m.value)
def test_an_old_api_env_steps_as_hand_written_in_each_autoreset_mode(mode):
    with MultiEnv([OldApiEnv] * 2, autoreset_mode=mode) as envs:
        obs, _ = envs.reset(seed=5)
        assert obs.tolist() == [[0, 5], [0, 6]]
        for t, (actions, want) in enumerate(zip(ACTIONS, EXPECTED[mode], strict=True)):
            obs, rewards, terminated, truncated, infos = envs.step(np.array(actions))
            got = (obs.tolist(), rewards.tolist(), terminated.tolist(), truncated.tolist())
            assert got == (
                want[0],
                want[1],
                [bool(v) for v in want[2]],
                [bool(v) for v in want[3]],
            ), t
            assert "TimeLimit.truncated" not in infos  # it became the truncated flag


def test_an_old_api_env_steps_as_hand_written_without_autoreset():
    with MultiEnv([OldApiEnv] * 2, autoreset_mode="Disabled") as envs:
        envs.reset(seed=5)
        obs, rewards, terminated, truncated, _ = envs.step(np.array([2, 0]))
        assert (obs.tolist(), rewards.tolist()) == ([[1, 5], [1, 6]], [10.0, 1.0])
        assert (terminated.tolist(), truncated.tolist()) == ([True, False], [False, False])
        obs, _ = envs.reset(options={"reset_mask": np.array([True, False])})
        assert obs.tolist() == [[0, 5], [1, 6]]
        for _ in range(3):
            obs, _, terminated, truncated, _ = envs.step(np.array([0, 0]))
        assert (obs.tolist(), terminated.tolist(), truncated.tolist()) == (
            [[3, 5], [4, 6]],
            [False, False],
            [False, True],
        )


def test_the_adapter_leaves_gymnasium_envs_alone_and_names_what_is_missing():
    env = CountingEnv()
    assert adapt(env) is env
    assert isinstance(adapt(OldApiEnv()), LegacyEnv)
    with pytest.raises(TypeError, match=r"not a gymnasium\.Env and has no reset, step"):
        adapt(object())


def test_old_gym_spaces_become_gymnasium_spaces():
    gym_spaces = pytest.importorskip("gym.spaces", reason="the old gym package is not installed")
    env = OldApiEnv()
    env.observation_space = gym_spaces.Box(0, 1000, shape=(2,), dtype=np.float32)
    env.action_space = gym_spaces.Discrete(3)
    adapted = adapt(env)
    assert adapted.observation_space == OldApiEnv().observation_space
    assert adapted.action_space == OldApiEnv().action_space


def test_reset_takes_one_options_dict_per_env():
    with MultiEnv([OptionsEcho] * 3) as envs:
        _, infos = envs.reset(options=[{"a": 1}, None, {"a": 3}])
        assert infos["a"].tolist() == [1, -1, 3]
        _, infos = envs.reset(options={"a": 7})  # one dict for all, as before
        assert infos["a"].tolist() == [7, 7, 7]
        _, infos = envs.reset(options={"a": 8, "reset_mask": np.array([False, True, False])})
        assert infos["_a"].tolist() == [False, True, False]
        with pytest.raises(ValueError, match="options for 2 envs, but there are 3"):
            envs.reset(options=[{}, {}])
        with pytest.raises(TypeError, match=r"env 1: reset\(\) options must be a dict or None"):
            envs.reset(options=[{}, 3, {}])
