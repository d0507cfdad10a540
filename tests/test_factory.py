"""factory: env factories checked and pickled, workers grouped and built, one error for many."""

import logging
import threading

import pytest

from multienv import EnvError
from multienv.supervision.env_proxy import RemoteEnv
from multienv.supervision.factory import (
    create_envs,
    one_error,
    pickle_env_fn,
    warn_unbounded_batches,
)
from tests.envs import CountingEnv


def test_a_factory_must_be_a_picklable_callable_and_the_error_names_the_env():
    assert pickle_env_fn(CountingEnv, 0)
    with pytest.raises(TypeError, match="env 3: env_fn must be a zero-argument callable"):
        pickle_env_fn("CountingEnv", 3)
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"env 1: env_fn .* cannot be pickled with cloudpickle"):
        pickle_env_fn(lambda: lock, 1)


def test_step_timeout_with_several_envs_per_worker_and_no_reset_timeout_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="multienv"):
        warn_unbounded_batches(1, {"step_timeout": 1.0})
        warn_unbounded_batches(4, {"step_timeout": 1.0, "reset_timeout": 1.0})
        assert not caplog.records
        warn_unbounded_batches(4, {"step_timeout": 1.0})
    assert "pass reset_timeout too" in caplog.text


def env_error(env_index, message):
    error = EnvError(f"env {env_index}: env_fn raised ValueError", env_index=env_index)
    error.__cause__ = ValueError(message)
    return error


def test_the_same_error_of_many_workers_is_said_once_naming_the_others(caplog):
    errors = [env_error(0, "no ROM"), env_error(1, "no ROM"), env_error(2, "other")]
    with caplog.at_level(logging.ERROR, logger="multienv"):
        first = one_error(errors)
    assert first is errors[0]
    assert str(first).endswith("Env(s) 1 raised the same.")
    assert "initialize() failed too: env 2" in caplog.text


class Supervisor:
    """What create_envs uses of a WorkerSupervisor; records the calls."""

    def __init__(self, env_indices, calls, fail=False):
        self.env_indices = env_indices
        self.calls = calls
        self.fail = fail

    def start(self):
        self.calls.append(("start", self.env_indices[0]))

    def initialize(self):
        if self.fail:
            raise env_error(self.env_indices[0], "broken")

    def close(self, timeout):
        self.calls.append(("close", self.env_indices[0]))

    def abandon_env(self, position):  # a proxy dropped unclosed (its finalizer)
        return False


class Proxy(RemoteEnv):
    def describe(self):
        self.observation_space = self.action_space = None


def test_workers_get_runs_of_envs_and_each_env_a_proxy():
    calls = []

    def supervise(fns, first):
        return Supervisor(list(range(first, first + len(fns))), calls)

    order = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("multienv.supervision.factory.share_bounds", lambda a, b: None)
        envs = create_envs([CountingEnv] * 5, 2, supervise, Proxy, "f", lambda: order.append(1))
    assert [env.supervisor.env_indices for env in envs[::2]] == [[0, 1], [2, 3], [4]]
    assert [env.position for env in envs] == [0, 1, 0, 1, 0]
    assert order == [1]  # before any worker starts
    assert calls == [("start", 0), ("start", 2), ("start", 4)]


def test_a_worker_that_fails_to_start_closes_them_all():
    calls = []

    def supervise(fns, first):
        return Supervisor(list(range(first, first + len(fns))), calls, fail=first == 2)

    with pytest.raises(EnvError, match="env 2"):
        create_envs([CountingEnv] * 4, 2, supervise, Proxy, "f")
    assert ("close", 0) in calls
    assert ("close", 2) in calls
    with pytest.raises(ValueError, match=r"f\(\): envs_per_worker must be an int >= 1"):
        create_envs([CountingEnv], 0, supervise, Proxy, "f")
