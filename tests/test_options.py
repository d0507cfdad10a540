"""options: keyword options read once into typed settings, each checked, errors named."""

import multiprocessing

import pytest

from multienv import RestartPolicy
from multienv.backends.subprocess.subprocess_env import SubprocessOptions
from multienv.supervision.options import SupervisorOptions, check_options


def test_timeouts_are_positive_or_none():
    SupervisorOptions(step_timeout=None, reset_timeout=0.5).check(0)
    with pytest.raises(ValueError, match="env 2: step_timeout must be > 0 or None, got 0"):
        SupervisorOptions(step_timeout=0).check(2)
    with pytest.raises(ValueError, match="env 0: init_timeout must be > 0"):
        SupervisorOptions(init_timeout=-1.0).check(0)


def test_supervisor_options_take_their_own_keywords_and_leave_the_others():
    policy = RestartPolicy(max_restarts=1)
    options = SupervisorOptions.of({"step_timeout": 2.0, "restart_policy": policy, "wait": "spin"})
    assert options == SupervisorOptions(step_timeout=2.0, restart_policy=policy)
    assert "close_timeout_s" in SupervisorOptions.names()
    assert "wait" not in SupervisorOptions.names()


def test_an_unknown_option_is_named_by_its_owner_with_the_valid_ones():
    with pytest.raises(TypeError, match=r"f\(\) got unexpected keyword argument\(s\) \['x'\]"):
        check_options("f", {"x", "step_timeout"}, SupervisorOptions.names())
    check_options("f", {"step_timeout"}, SupervisorOptions.names())


def test_subprocess_options_split_the_supervisors_from_the_processes():
    options = SubprocessOptions.of("g", {"step_timeout": 1.0, "wait": "spin", "daemon": False})
    assert options.supervision == SupervisorOptions(step_timeout=1.0)
    assert options.wait == "spin"
    assert not options.daemon
    assert SubprocessOptions.of("g", {}) == SubprocessOptions()
    with pytest.raises(TypeError, match=r"g\(\) got unexpected keyword argument\(s\) \['spin'\]"):
        SubprocessOptions.of("g", {"spin": True})
    with pytest.raises(TypeError, match="pin_cpu must be True, False or None, got 1"):
        SubprocessOptions.of("g", {"pin_cpu": 1})


def test_only_daemon_forkserver_workers_are_served_by_the_module_server():
    assert SubprocessOptions().is_served
    assert not SubprocessOptions(daemon=False).is_served
    assert not SubprocessOptions(context="spawn").is_served
    assert SubprocessOptions(context=multiprocessing.get_context("forkserver")).is_served
