"""evaluate(): exactly num_episodes complete episodes, without the short-episode bias."""

import functools

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from multienv import MultiEnv, evaluate
from tests.envs import FixedLengthCrashOnce, FixedLengthEnv

SHORT, LONG = 3, 40
FNS = [functools.partial(FixedLengthEnv, SHORT), functools.partial(FixedLengthEnv, LONG)] * 2


def policy(obs):
    return np.ones(len(obs), dtype=np.int64)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("vector", ["MultiEnv", "SyncVectorEnv"])
def test_evaluate_counts_exactly_num_episodes_with_equal_shares_of_short_and_long(mode, vector):
    make = MultiEnv if vector == "MultiEnv" else SyncVectorEnv
    envs = make(FNS, autoreset_mode=mode)
    try:
        result = evaluate(envs, policy, num_episodes=8, seed=0)
    finally:
        envs.close()
    assert len(result.returns) == len(result.lengths) == 8
    assert sorted(result.lengths.tolist()) == [SHORT] * 4 + [LONG] * 4
    assert result.mean_length == (SHORT + LONG) / 2  # a first-8-to-finish count gives ~4.5
    assert result.returns.tolist() == result.lengths.astype(float).tolist()
    assert sorted(result.env_ids.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert result.crashed == 0


def test_evaluate_shares_out_a_count_that_n_does_not_divide():
    with MultiEnv(FNS) as envs:
        result = evaluate(envs, policy, num_episodes=6)
    assert np.bincount(result.env_ids).tolist() == [1, 1, 2, 2]  # (6 + i) // 4


@pytest.mark.fault
@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_a_crash_mid_evaluation_is_not_counted_and_is_run_again(mode, tmp_path):
    fns = list(FNS)
    fns[1] = functools.partial(FixedLengthCrashOnce, LONG, str(tmp_path / "segv"), at_count=10)
    with MultiEnv(fns, autoreset_mode=mode) as envs:
        result = evaluate(envs, policy, num_episodes=8)
        assert envs.stats()[1]["restarts"] == 1
    assert result.crashed == 1
    assert sorted(result.lengths.tolist()) == [SHORT] * 4 + [LONG] * 4


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_max_steps_caps_long_episodes_and_says_how_many(mode):
    with MultiEnv(FNS, autoreset_mode=mode) as envs:
        result = evaluate(envs, policy, num_episodes=8, max_steps=10)
    assert sorted(result.lengths.tolist()) == [SHORT] * 4 + [10] * 4
    assert result.capped == 4


def test_bad_arguments_raise():
    with MultiEnv(FNS[:1]) as envs:
        with pytest.raises(ValueError, match="num_episodes >= 1"):
            evaluate(envs, policy, 0)
        with pytest.raises(ValueError, match="max_steps >= 1"):
            evaluate(envs, policy, 1, max_steps=0)
