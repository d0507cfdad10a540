"""EnvRunner, the k envs of one worker, in this process: no transport, no worker process."""

from __future__ import annotations

import functools

import cloudpickle
import numpy as np
import pytest

from multienv.wire.protocol import Command, Order, Request
from multienv.worker.runner import BuildError, EnvRunner
from tests.envs import CountingEnv, RaiseOnStep, WrongObsShape


def runner_of(*env_fns) -> EnvRunner:
    runner = EnvRunner([cloudpickle.dumps(fn) for fn in env_fns])
    runner.build()
    return runner


def test_build_describes_each_env_by_position():
    runner = EnvRunner([cloudpickle.dumps(CountingEnv), cloudpickle.dumps(WrongObsShape)])
    try:
        first, second = runner.build()
        assert first.observation_space == CountingEnv().observation_space
        assert first.env_type.endswith("CountingEnv")
        assert second.env_type.endswith("WrongObsShape")
    finally:
        runner.close()


def test_orders_run_in_position_order_and_a_failing_env_does_not_stop_the_others():
    runner = runner_of(CountingEnv, functools.partial(RaiseOnStep, at_count=1), CountingEnv)
    try:
        for position in range(3):
            assert runner.run(Order(position, is_reset=True, seed=position)).failure is None
        outcomes = [runner.run(Order(position, is_reset=False, action=1)) for position in range(3)]
        assert [o.failure is None for o in outcomes] == [True, False, True]
        assert outcomes[1].failure.type_name == "ValueError"
        assert outcomes[1].failure.position == 1
        assert [o.obs.tolist() for o in outcomes if o.failure is None] == [[1.0], [1.0]]
        assert outcomes[0].reward == 1.0
    finally:
        runner.close()


def test_same_step_autoreset_returns_the_final_obs_and_the_new_episodes_first():
    runner = runner_of(functools.partial(CountingEnv, episode_length=1))
    try:
        runner.run(Order(0, is_reset=True, seed=0))
        outcome = runner.run(Order(0, is_reset=False, action=1, autoreset=True))
        assert outcome.terminated
        assert outcome.obs.tolist() == [1.0]  # the final observation
        assert outcome.reset is not None
        assert outcome.reset[0].tolist() == [0.0]  # the next episode's first
    finally:
        runner.close()


def test_an_observation_outside_its_space_is_an_error_of_that_env():
    runner = runner_of(WrongObsShape)
    try:
        assert runner.run(Order(0, is_reset=True)).failure is None
        outcome = runner.run(Order(0, is_reset=False, action=1))  # its step's obs is (3,)
        assert outcome.failure is not None
        assert "observation_space" in outcome.failure.message
    finally:
        runner.close()


def test_a_build_error_names_the_env_and_closes_those_built():
    def broken():
        raise RuntimeError("no such level")

    runner = EnvRunner([cloudpickle.dumps(CountingEnv), cloudpickle.dumps(broken)])
    with pytest.raises(BuildError) as caught:
        runner.build()
    assert caught.value.failure.position == 1
    assert caught.value.failure.message == "no such level"
    assert runner.envs == []


def test_serve_answers_a_call_and_turns_an_env_exception_into_the_failure():
    runner = runner_of(CountingEnv)
    try:
        reply = runner.serve(Request(Command.CALL, 0, ("add", (2,), {"b": 3})))
        assert reply.failure is None
        assert reply.value == 5
        reply = runner.serve(Request(Command.CALL, 0, ("add", ("x",), {})))
        assert reply.failure is not None
        assert reply.failure.type_name == "TypeError"
        assert np.isclose(runner.step(0, 1)[1], 1.0)
    finally:
        runner.close()
