"""assembly: from per-worker results to the vector's batch, infos merged Gymnasium's way."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv.vector.assembly import Assembly, InfoMerger
from multienv.vector.fan_out import group_by_worker
from multienv.wire.autoreset import Autoreset
from multienv.wire.protocol import BatchResult, Outcome

OBS = gym.spaces.Box(-10.0, 10.0, (1,), np.float32)


class Worker:
    """A stand-in for a worker's supervisor: fan_out groups envs by it."""

    def __init__(self, num_envs):
        self.num_envs = num_envs


def assembly_of(num_envs, mode=AutoresetMode.NEXT_STEP):
    crashes = []

    def reset_after_crash(env_index):
        crashes.append(env_index)
        return np.array([-1.0], np.float32), np.array([0.0], np.float32), {"fresh": 1}

    autoreset = Autoreset(mode, num_envs)
    assembly = Assembly(OBS, num_envs, object(), autoreset, True, reset_after_crash)
    return assembly, autoreset, crashes


def result(rewards, terminated=None, obs=None, extras=None):
    n = len(rewards)
    return BatchResult(
        np.array(rewards, dtype=np.float64),
        np.zeros(n, np.bool_) if terminated is None else np.array(terminated),
        np.zeros(n, np.bool_),
        [np.array([v], np.float32) for v in (obs or [0.0] * n)],
        extras or {},
    )


def test_info_merger_merges_in_env_order_as_gymnasium_does():
    merged = InfoMerger(3).merge({2: {"a": 2}, 0: {"a": 0, "b": 1.5}})
    assert merged["a"].tolist() == [0, 0, 2]
    assert merged["_a"].tolist() == [True, False, True]
    assert merged["_b"].tolist() == [True, False, False]


def test_a_step_batch_puts_each_workers_results_at_its_envs():
    assembly, autoreset, _ = assembly_of(4)
    a, b = Worker(2), Worker(2)
    groups = group_by_worker([a, b, a, b], [0, 0, 1, 1])  # scattered: 0, 2 and 1, 3
    outcome = {
        0: (result([1.0, 3.0], [False, True], [10, 30], {1: Outcome(info={"k": 7})}), {}),
        1: (result([2.0, 4.0], obs=[20, 40]), {}),
    }
    (obs, rewards, terminations, _, infos), errors = assembly.step_batch(outcome, groups, None)
    assert errors == {}
    assert obs[:, 0].tolist() == [10, 20, 30, 40]
    assert rewards.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert terminations.tolist() == [False, False, True, False]
    assert infos["k"].tolist() == [0, 0, 7, 0]
    assert autoreset.needs_reset.tolist() == [False, False, True, False]


def test_an_env_that_raised_returns_zeros_and_its_error_and_keeps_its_observation():
    assembly, _, _ = assembly_of(2)
    a = Worker(2)
    groups = group_by_worker([a, a], [0, 1])
    assembly.env_obs = [np.array([5.0], np.float32)] * 2
    boom = ValueError("boom")
    outcome = {0: (result([1.0, 2.0], obs=[6, 7]), {1: boom})}
    (obs, rewards, *_), errors = assembly.step_batch(outcome, groups, None)
    assert errors == {1: boom}
    assert rewards.tolist() == [1.0, 0.0]
    assert obs[:, 0].tolist() == [6, 5]


def test_same_step_a_crash_resets_the_env_and_reports_the_final_observation():
    assembly, _, crashes = assembly_of(1, AutoresetMode.SAME_STEP)
    groups = group_by_worker([Worker(1)], [0])
    crashed = result([0.0], obs=[3])
    crashed.truncated[:] = True
    crashed.extras[0] = Outcome(info={"multienv": {"cause": "SIGKILL"}})
    (obs, *_, infos), _ = assembly.step_batch({0: (crashed, {})}, groups, None)
    assert crashes == [0]
    assert obs[:, 0].tolist() == [0.0]  # the new episode's first
    assert infos["final_obs"][0].tolist() == [-1.0]
    assert infos["fresh"].tolist() == [1]


def test_received_envs_are_filed_in_the_order_they_came_and_returned_as_asked():
    assembly, autoreset, _ = assembly_of(4)
    flying = {0: [0, 1], 1: [3]}
    received: dict = {}
    outcome = {1: (result([4.0], [True], [40]), {}), 0: (result([1.0, 2.0], obs=[10, 20]), {})}
    errors = assembly.receive(outcome, flying, received, {})
    assert errors == {}
    assert flying == {}
    assert list(received) == [3, 0, 1]
    assert received[3][:3] == (4.0, True, False)
    assert autoreset.needs_reset.tolist() == [False, False, False, True]
    rows = [received[0], received[3]]
    obs, rewards, terminations, _, infos = assembly.partial_batch([0, 3], rows)
    assert obs[:, 0].tolist() == [10, 40]
    assert rewards.tolist() == [1.0, 4.0]
    assert terminations.tolist() == [False, True]
    assert infos["env_id"].tolist() == [0, 3]


def test_a_reset_batch_takes_only_the_masked_envs():
    assembly, _, _ = assembly_of(3)
    assembly.env_obs = [np.array([-1.0], np.float32)] * 3
    groups = group_by_worker([Worker(3)] * 3, [0, 1, 2])
    reset = result([0.0, 0.0], obs=[5, 7], extras={1: Outcome(info={"seed_used": 3})})
    mask = np.array([True, False, True])
    obs, infos, errors = assembly.reset_batch({0: (reset, {})}, groups, mask)
    assert errors == {}
    assert obs[:, 0].tolist() == [5, -1, 7]
    assert infos["seed_used"].tolist() == [0, 0, 3]


@pytest.mark.parametrize("copy", [True, False])
def test_observations_are_copies_only_when_asked(copy):
    autoreset = Autoreset(AutoresetMode.NEXT_STEP, 1)
    assembly = Assembly(OBS, 1, object(), autoreset, copy, lambda i: (None, None, {}))
    assembly.env_obs = [np.array([1.0], np.float32)]
    first, second = assembly.observations(), assembly.observations()
    assert (first is second) is not copy
