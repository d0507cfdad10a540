"""env_proxy: RemoteEnv, one env of a supervised worker as a gymnasium.Env; abandon; states."""

import os
import signal
import warnings

import numpy as np
import pytest
from gymnasium.error import ClosedEnvironmentError

from multienv import EnvState, SubprocessEnv
from multienv.supervision.env_proxy import abandon_workers, check_state
from multienv.wire.protocol import EnvDescription, EnvSnapshot
from tests.envs import CountingEnv

pytestmark = pytest.mark.timeout(60)


def test_a_proxy_goes_from_created_to_ready_to_closed_and_refuses_calls_once_closed():
    env = SubprocessEnv(lambda: CountingEnv(episode_length=2))
    assert env.state is EnvState.CREATED
    assert env.pid is None
    env.start()
    assert env.state is EnvState.STARTED
    env.initialize()
    assert env.state is EnvState.READY
    assert env.pid != os.getpid()
    assert env.env_index == 0
    env.close()
    env.close()  # idempotent
    assert env.state is EnvState.CLOSED
    with pytest.raises(ClosedEnvironmentError):
        env.reset()


def test_a_proxys_counters_are_its_envs_steps_episodes_and_restarts():
    with SubprocessEnv(lambda: CountingEnv(episode_length=2)) as env:
        env.start()
        env.initialize()
        env.reset(seed=0)
        for _ in range(3):  # no autoreset: the third step ends the episode again
            env.step(1)
        assert (env.steps, env.episodes, env.restarts) == (3, 2, 0)
        os.kill(env.pid, signal.SIGKILL)
        _, _, _, truncated, info = env.step(1)
        assert truncated
        assert info["multienv"]["cause"] == "SIGKILL"
        assert env.restarts == 1
        assert env.last_failure == "SIGKILL"
        assert len(env.step_latencies_s) >= 3


class Supervisor:
    def __init__(self, killed):
        self.killed = killed
        self.abandoned = []

    def abandon(self):
        self.abandoned.append(None)
        return self.killed

    def abandon_env(self, position):
        self.abandoned.append(position)
        return self.killed


def test_abandoning_warns_only_when_it_killed_a_worker():
    idle, alive = Supervisor(False), Supervisor(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        abandon_workers([idle], "MultiEnv(2 envs)")
    with pytest.warns(ResourceWarning, match="unclosed SubprocessEnv\\(env 3\\)"):
        abandon_workers([alive], "SubprocessEnv(env 3)", position=1)
    assert idle.abandoned == [None]
    assert alive.abandoned == [1]  # a proxy's worker goes once none of its envs is open


def test_a_state_must_fit_the_env_that_takes_it():
    own = EnvDescription(None, None, {}, None, None, "envs.CountingEnv", has_own_state=True)
    plain = EnvDescription(None, None, {}, None, None, "envs.CountingEnv")
    check_state(np.zeros(3), own, 0)  # its own get_state()'s values
    check_state(EnvSnapshot("envs.CountingEnv", "object", b""), plain, 0)
    with pytest.raises(ValueError, match=r"env 2: the state is of a other\.Env env"):
        check_state(EnvSnapshot("other.Env", "object", b""), plain, 2)
    with pytest.raises(TypeError, match="env 1: the state is a ndarray, not a state from"):
        check_state(np.zeros(3), plain, 1)
