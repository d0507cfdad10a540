"""Box bounds travel compactly from workers and are held once in the parent."""

import pickle

import gymnasium as gym
import numpy as np
import pytest

from multienv import MultiEnv, SubprocessEnv
from multienv.wire.space_bounds import dumps_compact
from tests.conftest import live_workers
from tests.envs import FrameEnv


def frame_box(seed=None):
    return gym.spaces.Box(0, 255, (210, 160, 3), np.uint8, seed=seed)


def test_a_uniform_frame_box_travels_as_a_few_numbers_and_comes_back_equal():
    box = frame_box(seed=3)
    message = dumps_compact(box)
    assert len(message) < 2000 < len(pickle.dumps(box))
    back = pickle.loads(message)
    assert back == box
    assert (back.sample() == frame_box(seed=3).sample()).all()  # its own generator state


def test_rebuilt_boxes_share_read_only_bounds_and_keep_their_own_generators():
    first, second = pickle.loads(dumps_compact([frame_box(seed=1), frame_box(seed=2)]))
    for name in ("low", "high", "bounded_below", "bounded_above"):
        assert getattr(first, name) is getattr(second, name)
        assert not getattr(first, name).flags.writeable
    assert first.np_random is not second.np_random
    assert (second.sample() == frame_box(seed=2).sample()).all()


@pytest.mark.parametrize(
    "box",
    [
        gym.spaces.Box(-np.inf, 5, (2000,), np.int32),  # -inf becomes the dtype's minimum
        gym.spaces.Box(np.arange(2000.0), 3000.0, (2000,), np.float64),  # not uniform
        gym.spaces.Box(0, 255, (4,), np.uint8),  # small
    ],
    ids=["int-minus-inf", "not-uniform", "small"],
)
def test_boxes_a_rebuild_would_change_are_pickled_whole(box):
    message = dumps_compact(box)
    assert message == pickle.dumps(box, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(message)
    assert back == box
    assert (back.bounded_below == box.bounded_below).all()


def test_a_frame_box_inside_a_dict_is_compact_too():
    space = gym.spaces.Dict({"frame": frame_box(), "x": gym.spaces.Box(-1, 1, (2,))})
    back = pickle.loads(dumps_compact(space))
    assert back == space
    assert len(dumps_compact(space)) < 4000


def test_a_worker_describes_its_frame_box_compactly():
    # Rebuilt from four numbers, the proxy's bounds are read-only (a whole pickle's are not).
    proxy = SubprocessEnv(FrameEnv)
    try:
        proxy.start()
        proxy.initialize()
        assert not proxy.observation_space.low.flags.writeable
        assert proxy.observation_space == FrameEnv().observation_space
    finally:
        proxy.close()


def test_a_vector_of_frame_envs_holds_their_bounds_once():
    with MultiEnv([FrameEnv] * 3) as envs:
        boxes = [proxy.observation_space for proxy in envs.envs]
        assert all(box.low is boxes[0].low and box.high is boxes[0].high for box in boxes)
        assert envs.single_observation_space == FrameEnv().observation_space
        assert np.shares_memory(envs.observation_space.low, boxes[0].low)
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3, 32, 32, 3)
        assert envs.observation_space.contains(obs)
    assert live_workers() == []


def test_small_boxes_keep_writable_bounds_as_sync_vector_env_has_them():
    # TorchRL's GymWrapper turns the bounds into tensors and warns at read-only arrays;
    # holding a CartPole's bounds N times costs nothing, a frame's 400 KiB a time does.
    with MultiEnv([lambda: gym.make("CartPole-v1")] * 3) as envs:
        spaces = [envs.single_observation_space, envs.observation_space]
        spaces += [envs.single_action_space, envs.action_space]
        spaces += [proxy.observation_space for proxy in envs.envs]
        for space in spaces:
            for name in ("low", "high"):
                bounds = getattr(space, name, None)
                if bounds is not None:
                    assert bounds.flags.writeable, (space, name)
        assert (
            envs.observation_space
            == gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3).observation_space
        )
    with MultiEnv([FrameEnv] * 2) as envs:  # a frame's stay shared, read-only
        assert not envs.observation_space.low.flags.writeable
