"""multienv.make_vec against gymnasium.make_vec: the one-line swap."""

import functools

import gymnasium as gym
import numpy as np
import pytest

from multienv import MultiEnv, make_vec
from tests.conftest import live_workers


def double(reward):
    return 2 * reward


def test_make_vec_matches_gymnasium_make_vec_with_wrappers_and_env_kwargs():
    wrappers = [functools.partial(gym.wrappers.TransformReward, func=double)]
    ours = make_vec(
        "CartPole-v1",
        3,
        vectorization_mode="async",
        vector_kwargs={"autoreset_mode": "SameStep"},
        wrappers=wrappers,
        max_episode_steps=10,
    )
    ref = gym.make_vec(
        "CartPole-v1",
        3,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        wrappers=wrappers,
        max_episode_steps=10,
    )
    try:
        assert isinstance(ours, MultiEnv)
        assert ours.spec.id == "CartPole-v1"
        np.testing.assert_array_equal(ours.reset(seed=2)[0], ref.reset(seed=2)[0])
        for _ in range(25):
            got, want = (
                ours.step(np.zeros(3, dtype=np.int64)),
                ref.step(np.zeros(3, dtype=np.int64)),
            )
            for part_got, part_want in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(part_got, part_want)
        assert set(got[1].tolist()) <= {0.0, 2.0}
    finally:
        ours.close()
        ref.close()


def test_make_vec_rejects_what_it_cannot_build_before_starting_workers():
    with pytest.raises(gym.error.Error, match="NoSuchEnv"):
        make_vec("NoSuchEnv-v0", 2)
    with pytest.raises(ValueError, match="vectorization_mode"):
        make_vec("CartPole-v1", 2, vectorization_mode="vector_entry_point")
    with pytest.raises(ValueError, match="num_envs >= 1"):
        make_vec("CartPole-v1", 0)
    assert live_workers() == []
