"""batch_picker: what recv(batch_size="auto") picks, on a clock the test moves."""

import logging

import pytest

from multienv.vector import batch_picker
from multienv.vector.batch_picker import BatchPicker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(picker, clock, calls, in_flight, policy_s, env_s_of):
    """``calls`` loop turns: recv (the envs' time for its batch), then the policy's time."""
    sizes = []
    for _ in range(calls):
        size = picker.size(in_flight)
        sizes.append(size)
        clock.now += env_s_of(size)
        picker.returned(size)
        clock.now += policy_s
    return sizes


def test_it_keeps_half_batches_only_when_they_ran_faster_by_its_margin():
    clock = Clock()
    picker = BatchPicker(8, clock)
    # Whole batches: 16 steps per 3 ms. Half: 8 per 1.2 ms, 6.7k/s against 5.3k/s.
    sizes = run(picker, clock, 1000, 16, 1e-3, lambda size: 2e-3 if size == 16 else 0.2e-3)
    assert sizes[0] == 16
    assert 8 in sizes
    assert sizes[-50:] == [8] * 50  # held
    report = picker.current()
    assert report.batch_size == 8
    assert report.in_flight == 16
    assert report.half_rate > report.whole_rate
    assert "half batches ran faster" in report.reason
    assert str(report) == report.reason


def test_a_tie_goes_to_whole_batches():
    clock = Clock()
    picker = BatchPicker(8, clock)
    # Half batches take half the time: the same rate, within the margin.
    sizes = run(picker, clock, 1000, 16, 0.0, lambda size: size * 0.1e-3)
    assert sizes[-50:] == [16] * 50
    assert "whole batches ran faster" in picker.current().reason


def test_it_measures_again_when_the_policy_s_time_moves_and_not_before():
    clock = Clock()
    picker = BatchPicker(8, clock)
    env_s = {16: 2e-3, 8: 0.2e-3}.__getitem__
    run(picker, clock, 1000, 16, 1e-3, env_s)
    assert picker.current().batch_size == 8
    assert run(picker, clock, 1000, 16, 1e-3, env_s) == [8] * 1000  # steady: no remeasuring
    # The policy now takes 20 ms a call: whole batches win, and it says so.
    sizes = run(picker, clock, 300, 16, 20e-3, env_s)
    assert 16 in sizes
    assert sizes[-20:] == [16] * 20
    assert picker.current().policy_s == pytest.approx(20e-3)


def test_with_one_worker_in_flight_it_takes_all_without_timing_halves():
    clock = Clock()
    picker = BatchPicker(8, clock)
    assert set(run(picker, clock, 100, 8, 1e-3, lambda size: 1e-3)) == {8}
    assert "one worker's envs are in flight" in picker.current().reason


def test_before_its_first_choice_it_says_it_is_timing(caplog):
    clock = Clock()
    picker = BatchPicker(1, clock)
    run(picker, clock, 3, 4, 1e-3, lambda size: 1e-3)
    assert "timing whole and half batches" in picker.current().reason
    with caplog.at_level(logging.INFO, logger="multienv"):
        run(picker, clock, 1000, 4, 1e-3, lambda size: 4e-3 if size == 4 else 0.5e-3)
    assert [r.getMessage() for r in caplog.records if "auto" in r.getMessage()][:1] == [
        "recv(batch_size='auto'): " + picker.current().reason
    ]


def test_a_half_batch_is_whole_workers():
    picker = BatchPicker(3)
    assert [picker._half(n) for n in (3, 6, 9, 12, 4)] == [3, 3, 3, 6, 3]
    assert batch_picker.MARGIN > 1
