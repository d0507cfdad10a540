"""vector_checks: every input check of the vector, before anything is sent; errors name the env."""

import gymnasium as gym
import numpy as np
import pytest

from multienv import EnvStateError
from multienv.vector import vector_checks
from tests.envs import CountingEnv

DISCRETE = gym.spaces.Discrete(3)
BOX = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


def test_unknown_options_are_refused_in_the_owners_name_listing_the_valid_ones():
    with pytest.raises(
        TypeError,
        match=r"MultiEnv\(\) got .* \['stepp_timeout'\]; did you mean 'step_timeout' for "
        r"'stepp_timeout'\? valid .*",
    ):
        vector_checks.check_options("MultiEnv", {"stepp_timeout"}, {"step_timeout"})
    with pytest.raises(TypeError, match=r"\['xyz'\]; valid options are"):  # no close match
        vector_checks.check_options("MultiEnv", {"xyz"}, {"step_timeout"})
    vector_checks.check_options("MultiEnv", {"step_timeout"}, {"step_timeout", "wait"})


def test_envs_come_once_as_the_first_argument_or_as_env_fns():
    fns = [object()]
    assert vector_checks.envs_given(fns, None) is fns
    assert vector_checks.envs_given(None, fns) is fns
    for envs, env_fns in ((fns, fns), (None, None)):
        with pytest.raises(TypeError, match="takes its envs once"):
            vector_checks.envs_given(envs, env_fns)


def test_constructor_arguments_are_checked_as_async_vector_env_checks_them():
    with pytest.raises(ValueError, match="not a function to replace"):
        vector_checks.check_constructor(print, "same", None)
    with pytest.raises(ValueError, match="Invalid `observation_mode`"):
        vector_checks.check_constructor(None, "sometimes", None)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        vector_checks.check_constructor(None, "same", 0)
    vector_checks.check_constructor(None, (DISCRETE, DISCRETE), 2)


def test_ready_proxies_only():
    with pytest.raises(TypeError, match="env 0: expected a SubprocessEnv"):
        vector_checks.check_ready([object()])


def test_seeds_one_per_env_as_python_ints():
    assert vector_checks.seeds(None, 2) == [None, None]
    assert vector_checks.seeds(np.int64(5), 3) == [5, 6, 7]
    seeds = vector_checks.seeds([np.int32(1), None], 2)
    assert seeds == [1, None]
    assert type(seeds[0]) is int
    with pytest.raises(ValueError, match="got 1 seeds for 2 envs"):
        vector_checks.seeds([1], 2)
    with pytest.raises(TypeError, match="env 1: reset\\(\\) seed must be an int or None"):
        vector_checks.seeds([1, 2.5], 2)
    with pytest.raises(TypeError, match="got str"):
        vector_checks.seeds("7", 2)


def test_reset_options_shared_per_env_and_the_mask():
    per_env, mask = vector_checks.options_per_env({"level": 2, "reset_mask": "m"}, 2)
    assert per_env == [{"level": 2}, {"level": 2}]
    assert mask == "m"
    assert vector_checks.options_per_env({"reset_mask": "m"}, 2) == ([None, None], "m")
    assert vector_checks.options_per_env([None, {"a": 1}], 2) == ([None, {"a": 1}], None)
    with pytest.raises(ValueError, match="options for 1 envs, but there are 2"):
        vector_checks.options_per_env([{}], 2)
    with pytest.raises(TypeError, match="env 1: reset\\(\\) options must be a dict or None"):
        vector_checks.options_per_env([{}, 3], 2)
    with pytest.raises(ValueError, match="env 0: reset_mask goes in one options dict"):
        vector_checks.options_per_env([{"reset_mask": None}, None], 2)


def test_reset_mask_is_a_boolean_array_of_every_env_with_one_set():
    assert vector_checks.reset_mask(None, 3).tolist() == [True, True, True]
    mask = np.array([False, True])
    assert vector_checks.reset_mask(mask, 2) is mask
    for bad, error in (
        ([True, False], TypeError),
        (np.array([1, 0]), TypeError),
        (np.array([True]), ValueError),
        (np.zeros(2, dtype=np.bool_), ValueError),
    ):
        with pytest.raises(error, match="reset_mask"):
            vector_checks.reset_mask(bad, 2)


def test_actions_of_array_spaces_become_one_array_and_errors_name_the_env():
    batched = gym.vector.utils.batch_space(BOX, 2)
    actions = np.zeros((2, 2), np.float32)
    assert vector_checks.split_actions(actions, [0, 1], BOX, batched, 2) is actions
    lists = vector_checks.split_actions([[0, 0], [1, 1]], [3, 4], BOX, batched, 5)
    assert lists.shape == (2, 2)
    with pytest.raises(ValueError, match=r"env 4: action has shape \(3,\); expected \(2,\)"):
        vector_checks.split_actions([[0, 0], [1, 1, 1]], [3, 4], BOX, batched, 5)
    with pytest.raises(ValueError, match="expected 2 actions"):
        vector_checks.split_actions([[0, 0]], [0, 1], BOX, batched, 2)
    with pytest.raises(TypeError, match="got a single value of type int"):
        vector_checks.split_actions(1, [0, 1], DISCRETE, batched, 2)
    with pytest.raises(ValueError, match="expected integer actions"):
        vector_checks.split_actions(np.zeros(2), [0, 1], DISCRETE, batched, 2)


def test_actions_of_other_spaces_become_one_per_env():
    space = gym.spaces.Tuple((DISCRETE, DISCRETE))
    batched = gym.vector.utils.batch_space(space, 2)
    actions = (np.array([0, 1]), np.array([2, 0]))
    per_env = vector_checks.split_actions(actions, [0, 1], space, batched, 2)
    assert [tuple(int(v) for v in action) for action in per_env] == [(0, 2), (1, 0)]
    with pytest.raises(TypeError, match="iterating it raised"):
        vector_checks.split_actions(3, [0, 1], space, batched, 2)


def test_env_ids_to_send_are_distinct_existing_and_not_in_flight():
    assert vector_checks.env_ids_to_send(None, 3, ()) == [0, 1, 2]
    assert vector_checks.env_ids_to_send(np.array([2, 0]), 3, {1}) == [2, 0]
    with pytest.raises(ValueError, match="got no env_ids"):
        vector_checks.env_ids_to_send([], 3, ())
    with pytest.raises(ValueError, match="env 3: no such env"):
        vector_checks.env_ids_to_send([3], 3, ())
    with pytest.raises(ValueError, match="env 1: appears twice"):
        vector_checks.env_ids_to_send([1, 1], 3, ())
    with pytest.raises(EnvStateError, match="env 1: already in flight") as caught:
        vector_checks.env_ids_to_send([0, 1], 3, {1})
    assert caught.value.env_index == 1


def test_multi_env_takes_ready_envs_or_factories_and_options_only_with_factories():
    with pytest.raises(ValueError, match="at least one env"):
        vector_checks.proxies_for([], "subprocess", 1, True, {}, ())
    with pytest.raises(TypeError, match="env 1: MultiEnv takes either all ready envs"):
        vector_checks.proxies_for([CountingEnv(), CountingEnv], "subprocess", 1, True, {}, ())
    with pytest.raises(TypeError, match="ready envs and options \\['envs_per_worker'\\]"):
        vector_checks.proxies_for([CountingEnv()], "subprocess", 2, True, {}, ())
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) \\['bogus'\\]"):
        vector_checks.proxies_for([CountingEnv], "subprocess", 1, True, {"bogus": 1}, ("copy",))
