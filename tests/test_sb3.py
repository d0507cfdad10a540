"""MultiEnvVecEnv against SB3's own SubprocVecEnv; skips when SB3 is not installed."""

import functools
import os
import signal

import gymnasium as gym
import numpy as np
import pytest

sb3 = pytest.importorskip(
    "stable_baselines3", reason='Stable-Baselines3 is not installed: pip install -e ".[sb3]"'
)
from stable_baselines3.common.vec_env import (  # noqa: E402
    SubprocVecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
)

from multienv.sb3 import MultiEnvVecEnv  # noqa: E402
from tests.envs import CountingEnv, DictActionEnv, OptionsEcho, TupleActionEnv  # noqa: E402

N = 4


def cartpole():
    return gym.make("CartPole-v1")


def counting_rgb():
    return gym.wrappers.TimeLimit(CountingEnv(render_mode="rgb_array"), 100)


def both(fns):
    return MultiEnvVecEnv(fns), SubprocVecEnv(fns)


def close(*envs):
    for env in envs:
        env.close()


def test_reset_and_steps_match_subproc_vec_env_on_the_same_seeds():
    ours, theirs = both([cartpole] * 2)  # SB3's workers import torch: keep them few
    try:
        assert ours.seed(3) == theirs.seed(3)
        np.testing.assert_array_equal(ours.reset(), theirs.reset())
        assert ours.reset_infos == list(theirs.reset_infos)
        rng = np.random.default_rng(0)
        ended = 0
        for t in range(300):
            actions = rng.integers(2, size=2)
            got, want = ours.step(actions), theirs.step(actions)
            for part_got, part_want in zip(got[:3], want[:3], strict=True):
                np.testing.assert_array_equal(part_got, part_want, err_msg=f"step {t}")
            assert got[1].dtype == want[1].dtype
            for info_got, info_want in zip(got[3], want[3], strict=True):
                assert info_got.keys() == info_want.keys(), t
                assert info_got["TimeLimit.truncated"] == info_want["TimeLimit.truncated"]
                if "terminal_observation" in info_want:
                    np.testing.assert_array_equal(
                        info_got["terminal_observation"], info_want["terminal_observation"]
                    )
                    ended += 1
        assert ended > 2
    finally:
        close(ours, theirs)


@pytest.mark.parametrize("env_class", [DictActionEnv, TupleActionEnv])
def test_dict_and_tuple_actions_one_per_env_or_batched_give_subproc_vec_envs_results(env_class):
    ours, theirs = both([env_class] * 2)
    try:
        ours.reset(), theirs.reset()
        space = ours.action_space
        space.seed(0)
        for t in range(10):
            per_env = [space.sample() for _ in range(2)]
            got, want = ours.step(per_env), theirs.step(per_env)
            for part_got, part_want in zip(got[:3], want[:3], strict=True):
                np.testing.assert_array_equal(part_got, part_want, err_msg=f"step {t}")
        batched = gym.vector.utils.concatenate(
            space, per_env, gym.vector.utils.create_empty_array(space, n=2)
        )
        np.testing.assert_array_equal(ours.step(batched)[1], theirs.step(per_env)[1])
    finally:
        close(ours, theirs)


def test_a_per_env_action_of_the_wrong_layout_names_the_env():
    envs = MultiEnvVecEnv([DictActionEnv] * 2)
    try:
        envs.reset()
        good = envs.action_space.sample()
        with pytest.raises(ValueError, match=r"env 1: action .* does not have the layout"):
            envs.step([good, {"a": 1}])
        rewards = envs.step([good, good])[1]  # nothing was sent before
        assert rewards.shape == (2,)
    finally:
        envs.close()


def test_options_set_through_set_options_are_used_at_the_next_reset_only():
    ours, theirs = both([OptionsEcho] * 2)
    try:
        for env in (ours, theirs):
            env.set_options([{"a": 1}, {"a": 2}])
            env.reset()
        assert ours.reset_infos == list(theirs.reset_infos) == [{"a": 1}, {"a": 2}]
        for env in (ours, theirs):
            env.reset()
        assert ours.reset_infos == list(theirs.reset_infos) == [{"a": -1}, {"a": -1}]
    finally:
        close(ours, theirs)


def test_attributes_methods_indices_wrappers_and_images_as_subproc_vec_env():
    ours, theirs = both([counting_rgb] * 3)
    try:
        for env in (ours, theirs):
            env.reset()
            env.set_attr("marker", 7, indices=[0, 2])
        assert ours.get_attr("marker", [0, 2]) == theirs.get_attr("marker", [0, 2]) == [7, 7]
        assert ours.env_method("get_wrapper_attr", "marker", indices=0) == [7]
        wrapped = ours.env_is_wrapped(gym.wrappers.TimeLimit)
        assert wrapped == theirs.env_is_wrapped(gym.wrappers.TimeLimit) == [True] * 3
        assert ours.env_is_wrapped(gym.wrappers.RecordEpisodeStatistics) == [False] * 3
        images = ours.get_images()
        assert [image.shape for image in images] == [image.shape for image in theirs.get_images()]
        assert ours.render().shape == theirs.render().shape
        assert images[0][0, 0, 0] == 0  # CountingEnv draws its count
    finally:
        close(ours, theirs)


def test_a_bad_start_method_raises_as_subproc_vec_env_does():
    with pytest.raises(ValueError, match="nope") as theirs:
        SubprocVecEnv([cartpole], start_method="nope")
    with pytest.raises(ValueError, match="nope") as ours:
        MultiEnvVecEnv([cartpole], start_method="nope")
    assert str(ours.value) == str(theirs.value)


@pytest.mark.fault
def test_a_worker_crash_reaches_sb3_as_a_bootstrappable_time_limit_truncation():
    env = MultiEnvVecEnv([functools.partial(CountingEnv, 50)] * 2)
    try:
        env.reset()
        for _ in range(3):
            obs, *_ = env.step(np.ones(2, dtype=np.int64))
        seen = obs[1].copy()
        os.kill(env.envs[1].pid, signal.SIGKILL)
        obs, rewards, dones, infos = env.step(np.ones(2, dtype=np.int64))
        assert dones.tolist() == [False, True]
        assert infos[1]["TimeLimit.truncated"] is True
        np.testing.assert_array_equal(infos[1]["terminal_observation"], seen)
        assert infos[1]["multienv"]["cause"] == "SIGKILL"
        assert rewards[1] == 0.0
        assert obs[1].tolist() == [0.0]  # the new episode's first observation
        assert "multienv" not in infos[0]
    finally:
        env.close()


def test_sb3_wrappers_work_on_top():
    env = VecNormalize(VecFrameStack(VecMonitor(MultiEnvVecEnv([cartpole] * 2)), n_stack=4))
    try:
        obs = env.reset()
        assert obs.shape == (2, 16)
        for _ in range(30):
            obs, *_ = env.step(np.zeros(2, dtype=np.int64))
        assert obs.shape == (2, 16)
    finally:
        env.close()


class FramesEnv(CountingEnv):
    """CountingEnv whose frames are 32x32, each filled with its step count."""

    def __init__(self) -> None:
        super().__init__(episode_length=7, render_mode="rgb_array")

    def render(self):
        return np.full((32, 32, 3), 20 * self.count, dtype=np.uint8)


def test_vec_video_recorder_records_the_same_frames_as_on_subprocvecenv(tmp_path):
    pytest.importorskip("moviepy", reason="VecVideoRecorder needs moviepy: pip install moviepy")
    from stable_baselines3.common.vec_env import VecVideoRecorder

    def rgb_counting():
        return gym.wrappers.TimeLimit(FramesEnv(), 100)

    videos = {}
    for name, vec_class in (("ours", MultiEnvVecEnv), ("sb3", SubprocVecEnv)):
        folder = tmp_path / name
        env = VecVideoRecorder(
            vec_class([rgb_counting] * 2),
            str(folder),
            record_video_trigger=lambda step: step == 0,
            video_length=20,
        )
        try:
            env.seed(0)
            env.reset()
            for _ in range(25):
                env.step(np.zeros(2, dtype=np.int64))
        finally:
            env.close()
        videos[name] = sorted(folder.glob("*.mp4"))
        assert len(videos[name]) == 1, list(folder.iterdir())
    sizes = {name: paths[0].stat().st_size for name, paths in videos.items()}
    assert sizes["ours"] > 1000
    assert videos["ours"][0].read_bytes() == videos["sb3"][0].read_bytes(), sizes  # same frames


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(120)
def test_ppo_learns_through_a_worker_sigkilled_mid_rollout():
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import Logger

    class KillOnce(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.killed = 0

        def _on_step(self) -> bool:
            if self.num_timesteps in (300, 1100):  # mid-rollout (n_steps=128 x 4 envs = 512)
                os.kill(self.training_env.envs[1].pid, signal.SIGKILL)
                self.killed += 1
            return True

    env = MultiEnvVecEnv([cartpole] * N)
    try:
        callback = KillOnce()
        model = PPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=2, seed=0, device="cpu")
        model.set_logger(Logger(folder=None, output_formats=[]))  # SB3's own leaves a /tmp dir
        model.learn(total_timesteps=2048, callback=callback)
        assert callback.killed == 2
        assert sum(row["restarts"] for row in env.stats()) == 2
    finally:
        env.close()
