import pytest

from multienv import RestartPolicy


def test_first_restart_in_window_is_immediate():
    assert RestartPolicy(max_restarts=3, window_s=10, backoff=0.1).next_delay([], now=100.0) == 0.0


def test_backoff_doubles_with_consecutive_failures_and_is_capped():
    policy = RestartPolicy(max_restarts=10, window_s=100, backoff=0.1, max_backoff_s=0.3)
    assert policy.next_delay([1.0], now=2.0, consecutive=1) == pytest.approx(0.1)
    assert policy.next_delay([1.0, 2.0], now=3.0, consecutive=2) == pytest.approx(0.2)
    assert policy.next_delay([1.0, 2.0, 3.0], now=4.0, consecutive=3) == pytest.approx(0.3)


def test_respawn_after_a_working_worker_is_immediate_even_with_recent_restarts():
    policy = RestartPolicy(max_restarts=10, window_s=100, backoff=0.1)
    assert policy.next_delay([1.0, 2.0, 3.0], now=4.0, consecutive=0) == 0.0


def test_budget_spent_returns_none_and_old_restarts_expire():
    policy = RestartPolicy(max_restarts=2, window_s=10)
    assert policy.next_delay([1.0, 2.0], now=5.0) is None
    assert policy.next_delay([1.0, 2.0], now=11.5) is not None


def test_never_allows_no_restart():
    assert RestartPolicy.never().is_never
    assert RestartPolicy.never().next_delay([], now=0.0) is None


def test_invalid_policy_is_rejected():
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="window_s"):
        RestartPolicy(window_s=0)
