"""What a worker's failures become in the parent: the restart ledger and the errors told."""

from __future__ import annotations

import gymnasium as gym
import pytest

from multienv import EnvCrashedError, EnvCrashLoopError, RestartPolicy
from multienv.errors import EnvError
from multienv.supervision.failures import (
    RestartLedger,
    envs_text,
    registration_hint,
    remote_error,
)
from multienv.wire.protocol import RemoteFailure, RemoteTraceback


def failure_of(exc: BaseException) -> RemoteFailure:
    return RemoteFailure(type(exc).__qualname__, str(exc), "Traceback (most recent...)\n", exc)


def test_the_ledger_allows_the_policys_respawns_then_raises_naming_the_keyword():
    ledger = RestartLedger(RestartPolicy(max_restarts=2, window_s=60, backoff=0.0), [3, 4])
    ledger.note_success()  # the env ran before it crash-looped
    assert ledger.record_death(101, "SIGKILL", tuple) == 0.0
    assert ledger.record_death(102, "SIGKILL", tuple) == 0.0
    error = ledger.record_death(103, "exit code 1", lambda: ("boom",))
    assert isinstance(error, EnvCrashLoopError)
    assert error.env_index == 3
    assert (error.restarts, error.cause, error.stderr_tail) == (3, "exit code 1", ("boom",))
    message = str(error)
    assert message.startswith("env 3: worker hosting envs 3-4 died 3 times in 60 s")
    assert "restart_policy=RestartPolicy(max_restarts=20, window_s=60) in MultiEnv" in message
    assert message.endswith("\nboom")


def test_an_env_no_call_of_which_ever_completed_is_told_so_not_to_raise_the_budget():
    ledger = RestartLedger(RestartPolicy(max_restarts=1, window_s=60, backoff=0.0), [2])
    assert ledger.record_death(101, "SIGSEGV", tuple) == 0.0
    assert ledger.deaths_in_a_row == 1
    error = ledger.record_death(102, "SIGSEGV", lambda: ("about to dereference NULL",))
    assert isinstance(error, EnvCrashLoopError)
    assert str(error) == (
        "env 2: worker died 2 times in 60 s (RestartPolicy max_restarts=1, window_s=60); last "
        "cause SIGSEGV; no call to it ever completed: it fails on every start, and more "
        "respawns will not mend that. Fix the crash; its last stderr lines follow.\n"
        "about to dereference NULL"
    )


def test_a_success_starts_a_new_run_of_respawns_without_backoff():
    ledger = RestartLedger(RestartPolicy(max_restarts=5, backoff=0.1), [0])
    assert ledger.record_death(1, "SIGKILL", tuple) == 0.0
    assert ledger.record_death(2, "SIGKILL", tuple) == pytest.approx(0.1)  # a loop forming
    ledger.note_success()
    assert ledger.record_death(3, "SIGKILL", tuple) == 0.0


def test_never_means_the_first_death_raises():
    error = RestartLedger(RestartPolicy.never(), [7]).record_death(9, "SIGSEGV", tuple)
    assert type(error) is EnvCrashedError
    assert "env 7: worker (pid 9) died (SIGSEGV) and RestartPolicy.never() is set" in str(error)


def test_a_remote_error_chains_the_env_exception_and_its_worker_traceback():
    error = remote_error(failure_of(ValueError("bad")), "step", 5, 1234, "The worker lives.")
    assert isinstance(error, EnvError)
    assert isinstance(error, ValueError)  # except ValueError catches it, as with AsyncVectorEnv
    assert str(error) == (
        "env 5: step() raised ValueError in its worker (pid 1234): bad; the env's traceback "
        "is chained to this error (its __cause__). The worker lives."
    )
    assert isinstance(error.__cause__, ValueError)
    assert isinstance(error.__cause__.__cause__, RemoteTraceback)
    built = remote_error(failure_of(KeyError("k")), "initialize", 0, 1, "")
    assert str(built).startswith("env 0: env_fn raised KeyError in its worker (pid 1)")


def test_the_registration_hint_only_for_an_id_registered_here():
    gym.register(id="HereOnly-v0", entry_point="tests.envs:CountingEnv")
    try:
        with pytest.raises(gym.error.Error) as here:
            gym.make("HereOnlyy-v0")  # a typo: not registered here either
        assert registration_hint(failure_of(here.value)) == ""
        hint = registration_hint(
            failure_of(gym.error.NameNotFound("Environment `HereOnly` doesn't exist."))
        )
        assert "register it at module level, or inside env_fn" in hint
        assert registration_hint(failure_of(ValueError("HereOnly"))) == ""
    finally:
        del gym.registry["HereOnly-v0"]


@pytest.mark.parametrize(("indices", "text"), [([3], "env 3"), ([3, 4, 5], "envs 3-5")])
def test_envs_text(indices, text):
    assert envs_text(indices) == text
