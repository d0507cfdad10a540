import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ClosedEnvironmentError

from multienv import (
    EnvError,
    EnvState,
    EnvStateError,
    SubprocessEnv,
    create_subprocess_envs,
)
from tests.conftest import live_workers
from tests.envs import (
    ChattyReset,
    CountingEnv,
    EnvironEcho,
    RaiseInInit,
    RaiseOnStep,
    SlowInitEnv,
)


@pytest.fixture
def env():
    proxy = SubprocessEnv(CountingEnv)
    proxy.start()
    proxy.initialize()
    yield proxy
    proxy.close()


def test_step_before_start_names_the_missing_call():
    proxy = SubprocessEnv(CountingEnv)
    with pytest.raises(
        EnvStateError, match=r"env 0: step\(\) called in state CREATED; call start\(\)"
    ):
        proxy.step(0)
    proxy.close()


def test_step_before_initialize_names_the_missing_call():
    proxy = SubprocessEnv(CountingEnv)
    proxy.start()
    try:
        with pytest.raises(EnvStateError, match=r"call initialize\(\) first"):
            proxy.reset()
    finally:
        proxy.close()


def test_call_after_close_raises_closed_environment_error(env):
    env.close()
    with pytest.raises(ClosedEnvironmentError, match="after close"):
        env.step(0)


def test_close_twice_is_noop(env):
    env.close()
    env.close()
    assert env.state is EnvState.CLOSED


def test_initialize_caches_spaces_metadata_and_spec():
    proxy = SubprocessEnv(lambda: gym.make("CartPole-v1", render_mode="rgb_array"))
    proxy.start()
    proxy.initialize()
    try:
        assert proxy.observation_space == gym.make("CartPole-v1").observation_space
        assert proxy.action_space == gym.spaces.Discrete(2)
        assert proxy.render_mode == "rgb_array"
        assert proxy.spec is not None
        assert proxy.spec.id == "CartPole-v1"
        assert proxy.metadata["render_fps"] == 50
        assert proxy.pid is not None
    finally:
        proxy.close()


def test_reset_step_render_call_get_set_attr(env):
    obs, info = env.reset(seed=3)
    assert obs.tolist() == [0.0]
    assert info == {"seed_used": 3}
    obs, reward, terminated, truncated, info = env.step(1)
    assert (obs.tolist(), reward, terminated, truncated, info) == (
        [1.0],
        1.0,
        False,
        False,
        {"count": 1},
    )
    assert env.render().shape == (2, 2, 3)
    assert env.call("add", 2, b=5) == 7
    assert env.get_attr("episode_length") == 5
    env.set_attr("scale", 3.0)
    assert env.step(1)[1] == 3.0


def test_start_returns_before_the_env_is_built():
    proxy = SubprocessEnv(lambda: SlowInitEnv(0.5))
    began = time.monotonic()
    proxy.start()
    started_in = time.monotonic() - began
    proxy.initialize()
    initialized_in = time.monotonic() - began
    proxy.close()
    assert started_in < 0.4 < initialized_in


def test_lambdas_and_closures_travel_with_cloudpickle():
    length = 3
    proxy = SubprocessEnv(lambda: CountingEnv(episode_length=length))
    proxy.start()
    proxy.initialize()
    try:
        proxy.reset()
        results = [proxy.step(0) for _ in range(3)]
        assert [r[2] for r in results] == [False, False, True]
    finally:
        proxy.close()


# "fork" forks this process, whose threads (other tests' stderr relay, thread pools) run
# on: CPython 3.12+ warns of it, as it should to a user who asks for "fork" (multienv's own
# forks come from the module server, which has no threads). The test checks it works.
@pytest.mark.filterwarnings(r"ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("context", ["forkserver", "spawn", "fork"])
def test_every_start_method_runs_the_env(context):
    proxy = SubprocessEnv(CountingEnv, context=context)
    proxy.start()
    proxy.initialize()
    try:
        proxy.reset()
        assert proxy.step(1)[0].tolist() == [1.0]
    finally:
        proxy.close()


def test_env_error_carries_index_type_message_and_traceback_and_worker_survives():
    proxy = SubprocessEnv(lambda: RaiseOnStep(at_count=2), env_index=4)
    proxy.start()
    proxy.initialize()
    try:
        proxy.reset()
        proxy.step(0)
        pid = proxy.pid
        with pytest.raises(EnvError) as caught:
            proxy.step(0)
        message = str(caught.value)
        assert message.startswith("env 4: step() raised ValueError in its worker (pid")
        assert "): boom at count 2; the env's traceback is chained to this error" in message
        assert caught.value.env_index == 4
        original = caught.value.__cause__
        assert isinstance(original, ValueError)
        worker_traceback = str(original.__cause__)
        assert "tests/envs.py" in worker_traceback
        assert "raise ValueError" in worker_traceback
        assert proxy.pid == pid
        proxy.reset()
        assert proxy.step(1)[0].tolist() == [1.0]
    finally:
        proxy.close()


def test_unpicklable_env_fn_is_rejected_before_anything_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"env 0: env_fn .* cannot be pickled"):
        SubprocessEnv(lambda: lock and CountingEnv())


def test_create_subprocess_envs_initializes_in_parallel():
    began = time.monotonic()
    envs = create_subprocess_envs([lambda: SlowInitEnv(0.5)] * 8)
    elapsed = time.monotonic() - began
    try:
        assert [e.env_index for e in envs] == list(range(8))
        assert all(e.state is EnvState.READY for e in envs)
    finally:
        for e in envs:
            e.close()
    assert elapsed < 8 * 0.5 * 0.6, f"took {elapsed:.2f} s: initialize() did not run in parallel"


def test_create_subprocess_envs_failure_names_index_and_closes_all():
    fns = [CountingEnv, CountingEnv, RaiseInInit, CountingEnv]
    with pytest.raises(EnvError, match=r"env 2: .*RuntimeError.*cannot build this env"):
        create_subprocess_envs(fns)
    assert live_workers() == []


def test_create_subprocess_envs_unpicklable_factory_names_index_and_starts_nothing():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="env 1: env_fn"):
        create_subprocess_envs([CountingEnv, lambda: lock and CountingEnv()])
    assert live_workers() == []


def test_invalid_timeout_is_rejected():
    with pytest.raises(ValueError, match="env 0: step_timeout must be > 0"):
        SubprocessEnv(CountingEnv, step_timeout=0)


def test_observation_round_trips_exactly(env):
    env.reset()
    obs = env.step(1)[0]
    assert obs.dtype == np.float32


def test_env_fn_error_in_initialize_says_the_worker_exited_and_a_retry_uses_a_new_one():
    proxy = SubprocessEnv(RaiseInInit)
    proxy.start()
    try:
        first_pid = proxy.pid
        with pytest.raises(EnvError, match=r"cannot build this env.*The worker has exited"):
            proxy.initialize()
        with pytest.raises(EnvError, match="cannot build this env"):
            proxy.initialize()
        assert proxy.pid != first_pid
    finally:
        proxy.close()


def test_every_workers_stderr_reaches_ours_and_stays_in_its_tail(capfd):
    # One relay thread reads the stderr pipes of all the workers (stderr_relay).
    envs = create_subprocess_envs([ChattyReset] * 3)
    try:
        for seed, proxy in enumerate(envs):
            proxy.reset(seed=seed)
    finally:
        for proxy in envs:
            proxy.close()
    err = capfd.readouterr().err
    for seed in range(3):
        assert f"chatty {seed} says hello" in err
    # The pipe is read to its end at close: each tail holds its own worker's lines only.
    for seed, proxy in enumerate(envs):
        assert proxy.supervisor.handle.stderr_tail() == (f"chatty {seed} says hello",)


def test_a_worker_sees_the_parents_environment_as_it_is_when_the_worker_starts(monkeypatch):
    # The module server's environment is the parent's when the server started (the first
    # vector of the session); each worker it forks gets the parent's current one.
    first = SubprocessEnv(EnvironEcho)
    first.start()
    first.initialize()
    first.close()
    monkeypatch.setenv("MULTIENV_TEST_SET_LATER", "egl")
    monkeypatch.delenv("HOME", raising=False)
    proxy = SubprocessEnv(EnvironEcho)
    proxy.start()
    proxy.initialize()
    try:
        assert proxy.call("getenv", "MULTIENV_TEST_SET_LATER") == "egl"
        assert proxy.call("getenv", "HOME") is None
    finally:
        proxy.close()


def test_create_subprocess_envs_names_an_unknown_option_in_its_own_name():
    with pytest.raises(TypeError, match=r"create_subprocess_envs\(\) got unexpected keyword"):
        create_subprocess_envs([CountingEnv], step_timout=1.0)
    with pytest.raises(TypeError, match="pin_cpu must be True, False or None"):
        create_subprocess_envs([CountingEnv], pin_cpu="yes")
