"""MultiEnv in place of Gymnasium's AsyncVectorEnv: its arguments, async API and errors."""

import functools
import multiprocessing

import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from multienv import EnvError, MultiEnv
from tests.conftest import live_workers
from tests.envs import (
    ActionTypeEcho,
    CountingEnv,
    RaiseOnReset,
    SequenceObsEnv,
    SlowReset,
    WideObsEnv,
)


def test_async_vector_envs_arguments_are_accepted():
    envs = MultiEnv(
        [CountingEnv] * 2,
        shared_memory=True,
        copy=False,
        context="forkserver",
        daemon=False,
        observation_mode="same",
        autoreset_mode="SameStep",
        max_concurrency=2,
    )
    try:
        obs, _ = envs.reset(seed=1)
        assert obs[:, 0].tolist() == [0.0, 0.0]
        assert envs.np_random_seed == (1, 2)
    finally:
        envs.close(terminate=True)
    assert live_workers() == []


def test_a_custom_worker_function_is_refused_clearly():
    with pytest.raises(ValueError, match=r"worker=\.\.\.\): multienv's workers are not a function"):
        MultiEnv([CountingEnv], worker=lambda *args: None)
    with pytest.raises(ValueError, match="Invalid `observation_mode`"):
        MultiEnv([CountingEnv], observation_mode="mixed")


def test_shared_memory_true_on_a_dynamic_space_raises_as_async_vector_env_does():
    with pytest.raises(TypeError, match="dynamic shape"):
        MultiEnv([SequenceObsEnv] * 2, shared_memory=True)
    with MultiEnv([CountingEnv] * 2, shared_memory=False) as envs:  # pickled, same results
        assert envs.reset()[0][:, 0].tolist() == [0.0, 0.0]
    assert live_workers() == []


def test_reset_async_and_reset_wait_with_gymnasiums_errors():
    with MultiEnv([functools.partial(SlowReset, 0.3)] * 2) as envs:
        with pytest.raises(NoAsyncCallError, match="without any prior call to `reset_async`"):
            envs.reset_wait()
        envs.reset_async(seed=3)
        with pytest.raises(AlreadyPendingCallError, match="pending call to `reset`"):
            envs.step_async(np.ones(2, dtype=np.int64))
        with pytest.raises(multiprocessing.TimeoutError, match="timed out"):
            envs.reset_wait(timeout=0.05)
        obs, infos = envs.reset_wait(timeout=5)  # the reset stayed in flight
        assert obs[:, 0].tolist() == [0.0, 0.0]
        assert infos["seed_used"].tolist() == [3, 4]
        envs.step_async(np.ones(2, dtype=np.int64))
        with pytest.warns(UserWarning, match="pending call to `step`"):
            envs.close()


def test_observation_mode_different_batches_differing_spaces():
    with pytest.raises(RuntimeError, match="observation spaces are not equivalent"):
        MultiEnv([CountingEnv, WideObsEnv])
    with MultiEnv([CountingEnv, WideObsEnv], observation_mode="different") as envs:
        assert envs.observation_space.high.tolist() == [[1000.0], [2000.0]]
        envs.reset()
        obs, *_ = envs.step(np.ones(2, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0, 1.0]


def test_an_env_raising_in_reset_raises_an_env_error_that_is_also_its_type():
    with MultiEnv([CountingEnv, RaiseOnReset]) as envs:
        with pytest.raises(ValueError, match=r"env 1: .*reset boom") as caught:
            envs.reset()
        assert isinstance(caught.value, EnvError)
        assert caught.value.env_index == 1


@pytest.mark.parametrize("shared_memory", [True, False, None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_actions_reach_the_env_in_the_dtype_given_as_gymnasium_passes_them(shared_memory, dtype):
    # Gymnasium's own step-timeout test passes float64 seconds to a float32 Box action
    # space and calls time.sleep() on them; a cast to float32 would break it.
    options = {} if shared_memory is None else {"shared_memory": shared_memory}
    with MultiEnv([ActionTypeEcho] * 2, **options) as envs:
        envs.reset(seed=0)
        for _ in range(2):  # the planned path, then the general one after a step
            infos = envs.step(np.full((2, 2), 0.25, dtype=dtype))[4]
            assert infos["dtype"].tolist() == [np.dtype(dtype).name] * 2
        envs.send(np.full((1, 2), 0.5, dtype=dtype), env_ids=[1])
        assert envs.recv()[4]["dtype"].tolist() == [np.dtype(dtype).name]
