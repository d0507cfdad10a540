"""log_limit: failure lines that do not bury a long run, and the named last-resort output."""

import io
import logging
import sys

import pytest

from multienv.supervision.log_limit import FailureLog, NamedLastResort


@pytest.fixture
def lines():
    logger = logging.getLogger("test_log_limit")
    logger.propagate = False
    caught = []

    class Catch(logging.Handler):
        def emit(self, record):
            caught.append(record.getMessage())

    handler = Catch()
    logger.addHandler(handler)
    yield logger, caught
    logger.removeHandler(handler)


def test_the_first_failures_of_each_worker_are_logged_then_counted(lines):
    logger, caught = lines
    now = [0.0]
    log = FailureLog(logger, first_per_env=2, summary_every_s=60, clock=lambda: now[0])
    for number in range(1, 5):
        log.report(env_index=3, failure_number=number, cause="SIGKILL", message=f"died {number}")
    assert caught[0] == "died 1"
    assert caught[1].startswith("died 2 (this worker's later failures are counted")
    assert len(caught) == 2
    assert log.counts_by_cause() == {"SIGKILL": 2}


def test_a_repeat_failure_is_logged_as_a_crash_loop_may_be_forming(lines):
    logger, caught = lines
    log = FailureLog(logger, first_per_env=1, clock=lambda: 0.0)
    log.report(env_index=0, failure_number=1, cause="SIGKILL", message="one")
    assert log.report(
        env_index=0, failure_number=2, cause="SIGKILL", message="two", deaths_in_a_row=2
    )
    assert [line[:3] for line in caught] == ["one", "two"]


def test_a_long_crash_loop_is_logged_at_powers_of_two_then_counted(lines):
    logger, caught = lines
    log = FailureLog(logger, first_per_env=3, clock=lambda: 0.0)
    for number in range(1, 21):  # 20 respawns with no call completed between them
        log.report(
            env_index=0,
            failure_number=number,
            cause="SIGSEGV",
            message=f"died {number}",
            deaths_in_a_row=number,
        )
    assert [line.split(" (")[0] for line in caught] == [
        "died 1",
        "died 2",
        "died 3",
        "died 4",
        "died 8",
        "died 16",
    ]
    assert caught[2].endswith(
        "(a crash loop: its next failures are logged at 4, 8, 16... in a row)"
    )
    assert log.counts_by_cause() == {"SIGSEGV": 14}


def test_the_summary_line_counts_by_cause_and_names_the_envs_as_ranges(lines):
    logger, caught = lines
    now = [0.0]
    log = FailureLog(logger, first_per_env=0, summary_every_s=10, clock=lambda: now[0])
    for env_index, cause in ((0, "SIGKILL"), (1, "SIGKILL"), (2, "timeout"), (5, "SIGKILL")):
        assert not log.report(env_index=env_index, failure_number=9, cause=cause, message="-")
    now[0] = 11.0
    assert log.report(env_index=5, failure_number=9, cause="SIGKILL", message="-")
    assert caught == [
        "5 more worker failures in the last 11 s, each respawned: SIGKILL 4, timeout 1; envs 0-2, 5"
    ]
    assert log.counts_by_cause() == {}
    log.flush()  # nothing held: no line
    assert len(caught) == 1


def test_flush_logs_what_is_held_at_once(lines):
    logger, caught = lines
    log = FailureLog(logger, first_per_env=0, clock=lambda: 0.0)
    log.report(env_index=0, failure_number=1, cause="timeout", message="-")
    log.flush()
    assert caught[0].startswith("1 more worker failures")


def test_the_last_resort_names_multienv_and_yields_to_a_configured_handler(monkeypatch):
    logger = logging.getLogger("multienv.test_last_resort")
    handler = NamedLastResort()
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    record = logger.makeRecord(logger.name, logging.WARNING, "f", 1, "worker died", (), None)
    monkeypatch.setattr(logging.getLogger("multienv"), "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    handler.emit(record)
    assert stream.getvalue() == "multienv WARNING: worker died\n"
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    handler.emit(record)
    assert stream.getvalue() == "multienv WARNING: worker died\n"  # theirs decides now
