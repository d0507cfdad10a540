"""Gymnasium's vector wrappers on a MultiEnv give what they give on SyncVectorEnv."""

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from gymnasium.wrappers import vector as wrappers

from multienv import MultiEnv
from tests.envs import BoxActionEnv

N = 3


def cartpole():
    return gym.make("CartPole-v1")


def double(obs):
    return obs * 2


WRAPPED = {
    "RecordEpisodeStatistics": (cartpole, wrappers.RecordEpisodeStatistics),
    "NormalizeObservation": (cartpole, wrappers.NormalizeObservation),
    "NormalizeReward": (cartpole, wrappers.NormalizeReward),
    "TransformObservation": (
        cartpole,
        functools.partial(wrappers.TransformObservation, func=double),
    ),
    "DictInfoToList": (cartpole, wrappers.DictInfoToList),
    "ClipAction": (BoxActionEnv, wrappers.ClipAction),
}


def same(got, want, what):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for key in want:
            same(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{what}[{i}]")
    elif isinstance(want, np.ndarray) and want.dtype == object:
        for g, w in zip(got, want, strict=True):
            same(g, w, what)
    elif isinstance(want, np.ndarray | float | int | np.generic):
        np.testing.assert_allclose(got, want, err_msg=what)
    else:
        assert got == want, what


@pytest.mark.parametrize("name", list(WRAPPED))
def test_vector_wrapper_on_multienv_equals_it_on_sync_vector_env(name):
    factory, wrapper = WRAPPED[name]
    ours, ref = wrapper(MultiEnv([factory] * N)), wrapper(SyncVectorEnv([factory] * N))
    try:
        same(ours.reset(seed=4), ref.reset(seed=4), "reset")
        ref.action_space.seed(0)
        for t in range(120):
            actions = ref.action_space.sample() * (3 if name == "ClipAction" else 1)
            got, want = ours.step(actions), ref.step(actions)
            for part, (g, w) in enumerate(zip(got, want, strict=True)):
                if "episode" in (w if isinstance(w, dict) else {}) and name != "DictInfoToList":
                    g, w = dict(g), dict(w)
                    for info in (g, w):  # wall-clock times differ by nature
                        info["episode"] = {k: v for k, v in info["episode"].items() if k != "t"}
                same(g, w, f"{name} step {t} part {part}")
    finally:
        ours.close()
        ref.close()


def test_numpy_to_torch_on_multienv_gives_sync_vector_envs_tensors():
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    pytest.importorskip(
        "array_api_compat", reason='NumpyToTorch needs pip install "gymnasium[torch]"'
    )
    from gymnasium.wrappers.vector import NumpyToTorch

    ours, ref = NumpyToTorch(MultiEnv([cartpole] * N)), NumpyToTorch(SyncVectorEnv([cartpole] * N))
    try:
        got, want = ours.reset(seed=4), ref.reset(seed=4)
        assert isinstance(got[0], torch.Tensor)
        assert torch.equal(got[0], want[0])
        for t in range(60):
            actions = torch.tensor([t % 2] * N)
            got, want = ours.step(actions), ref.step(actions)
            for part in range(4):
                assert isinstance(got[part], torch.Tensor), (t, part)
                assert torch.equal(got[part], want[part]), (t, part)
    finally:
        ours.close()
        ref.close()
