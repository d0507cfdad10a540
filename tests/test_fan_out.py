"""fan_out: workers grouped and sliced, batches made per worker, sent, collected, errors by env."""

import logging
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from multienv.errors import WaitTimeoutError
from multienv.vector.fan_out import (
    FanOut,
    collect_slices,
    finish,
    group_by_worker,
    raise_first,
    reset_batches,
    run_slice,
    step_batches,
)


class FakeSupervisor:
    """What fan_out uses of a WorkerSupervisor: submit, finish, num_envs; records threads."""

    def __init__(self, num_envs, fail_items=(), submit_error=None, finish_error=None):
        self.num_envs = num_envs
        self.env_indices = [-1] * num_envs
        self.fail_items = fail_items
        self.submit_error = submit_error
        self.finish_error = finish_error
        self.sent = []
        self.threads = set()
        self.deadline = None
        self.handle = self

    def submit(self, batch):
        if self.submit_error is not None:
            raise self.submit_error
        self.sent.append(batch)
        self.threads.add(threading.get_ident())

    def finish(self):
        if self.finish_error is not None:
            raise self.finish_error
        return ("result", self), {item: ValueError(f"item {item}") for item in self.fail_items}


class FakeLink:
    """A multi-wait that finds the first worker asked about ready."""

    def __init__(self):
        self.asked = []

    def wait_any(self, handles, deadlines, timeout):
        self.asked.append(len(handles))
        return [0]


def test_workers_are_grouped_in_order_of_their_first_env_with_their_envs_and_places():
    a, b = FakeSupervisor(2), FakeSupervisor(2)
    groups = group_by_worker([a, a, b, b], [0, 1, 1, 0])
    assert [g.supervisor for g in groups] == [a, b]
    assert groups[0].env_ids == [0, 1]
    assert groups[0].index == slice(0, 2)
    assert groups[0].is_whole
    assert groups[1].positions == [1, 0]
    assert not groups[1].is_whole  # all there, but not in position order
    assert groups[1].position_of == {2: 1, 3: 0}
    scattered = group_by_worker([a, b, a], [0, 0, 1])
    assert scattered[0].index.tolist() == [0, 2]


def test_reset_batches_cover_the_masked_envs_with_their_seeds_and_options():
    a, b = FakeSupervisor(2), FakeSupervisor(2)
    groups = group_by_worker([a, a, b, b], [0, 1, 0, 1])
    make = reset_batches([10, 11, 12, 13], [None, {"x": 1}, None, None], np.array([0, 1, 0, 0]))
    batch = make(groups[0])
    assert batch.positions == [1]
    assert batch.is_reset.tolist() == [True]
    assert batch.seeds == [11]
    assert batch.options == [{"x": 1}]
    assert make(groups[1]) is None  # no env of this worker resets
    plain = reset_batches([None] * 4, [None] * 4, np.ones(4, dtype=np.bool_))(groups[1])
    assert plain.seeds is None
    assert plain.options is None


def test_step_batches_take_each_workers_actions_and_resets():
    a, b = FakeSupervisor(2), FakeSupervisor(1)
    groups = group_by_worker([a, a, b], [0, 1, 0])
    make = step_batches(np.array([5, 6, 7]), np.array([False, True, False]), True)
    batch = make(groups[0])
    assert np.asarray(batch.actions).tolist() == [5, 6]
    assert batch.is_reset.tolist() == [False, True]
    assert batch.autoreset
    assert batch.is_whole
    as_list = step_batches(["p", "q", "r"], np.zeros(3, dtype=np.bool_), False)(groups[1])
    assert as_list.actions == ["r"]


def test_finish_gives_errors_by_env_index_and_one_error_for_every_env():
    supervisor = FakeSupervisor(2, fail_items=(1,))
    group = group_by_worker([supervisor, supervisor], [0, 1])[0]
    group.env_ids = [4, 5]  # as a vector numbers them
    result, errors = finish(group)
    assert result == ("result", supervisor)
    assert list(errors) == [5]
    supervisor.fail_items, supervisor.finish_error = (), RuntimeError("crash loop")
    result, errors = finish(group)
    assert result is None
    assert list(errors) == [4, 5]
    assert all(str(e) == "crash loop" for e in errors.values())


def test_a_batch_that_cannot_be_sent_fails_its_envs_and_the_others_are_still_collected():
    good, bad = FakeSupervisor(1), FakeSupervisor(1, submit_error=TypeError("unpicklable"))
    groups = group_by_worker([good, bad], [0, 0])
    outcome = run_slice(groups, [0, 1], step_batches(np.zeros(2), np.zeros(2, bool), False))
    assert outcome[0][1] == {}
    assert outcome[1][0] is None
    assert isinstance(outcome[1][1][1], TypeError)


def test_raise_first_raises_the_lowest_env_and_logs_the_others(caplog):
    with caplog.at_level(logging.ERROR, logger="multienv"):
        with pytest.raises(ValueError, match="two"):
            raise_first({7: ValueError("seven"), 2: ValueError("two")})
    assert "env 7: failed too: seven" in caplog.text


def test_fan_out_runs_the_first_slice_inline_and_the_others_on_its_threads():
    supervisors = [FakeSupervisor(1) for _ in range(4)]
    groups = group_by_worker(supervisors, [0] * 4)
    fan_out = FanOut(groups, num_threads=2)
    try:
        assert fan_out.slices == [[0, 1], [2, 3]]
        outcome = fan_out.run(step_batches(np.zeros(4), np.zeros(4, bool), False))
        assert sorted(outcome) == [0, 1, 2, 3]
        assert supervisors[0].threads == {threading.get_ident()}
        assert supervisors[2].threads != {threading.get_ident()}
        only = fan_out.run(step_batches(np.zeros(4), np.zeros(4, bool), False), numbers=[3])
        assert list(only) == [3]
    finally:
        fan_out.shutdown()
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        FanOut(groups, num_threads=0)


def test_run_limited_keeps_at_most_max_concurrency_envs_in_flight():
    supervisors = [FakeSupervisor(2) for _ in range(3)]
    groups = group_by_worker([s for s in supervisors for _ in range(2)], [0, 1] * 3)
    fan_out = FanOut(groups, num_threads=1)
    link = FakeLink()
    fan_out.link = link
    try:
        outcome = fan_out.run_limited(step_batches(np.zeros(6), np.zeros(6, bool), False), 4)
    finally:
        fan_out.shutdown()
    assert sorted(outcome) == [0, 1, 2]
    assert max(link.asked) == 2  # two workers of 2 envs at once, never three


def test_map_calls_every_env_and_keeps_errors_by_env():
    groups = group_by_worker([FakeSupervisor(1) for _ in range(3)], [0] * 3)
    fan_out = FanOut(groups, num_threads=3)

    def call(env_index):
        if env_index == 1:
            raise KeyError("one")
        return env_index * 10

    try:
        results, errors = fan_out.map(call, 3)
    finally:
        fan_out.shutdown()
    assert results[0] == 0
    assert results[2] == 20
    assert list(errors) == [1]


def test_collect_slices_times_out_leaving_them_in_flight():
    future: Future = Future()
    began = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="1 of 1 slices still running"):
        collect_slices([future], 0.05, "step")
    assert time.monotonic() - began < 5
    future.set_result({0: (None, {})})
    assert collect_slices([future], 0.05, "step") == {0: (None, {})}
