"""worker: a worker's loop on a vector's real shared memory, done pipes and socket, in-process."""

import functools
import os
import threading

import numpy as np
import pytest

from multienv.wire import framing
from multienv.wire.framing import (
    DONE_OK,
    DONE_RECORD,
    DONE_REPLY,
    MessageReader,
    decode,
    encode,
    frame,
)
from multienv.wire.protocol import Command, Request
from tests.envs import CountingEnv, RaiseOnStep

pytestmark = pytest.mark.timeout(30)


def plan(shared, seq, actions, slot=1):
    """Write a planned step of every env as the parent does; its seq for worker 0."""
    n = shared.num_envs
    shared.actions[:] = actions
    shared.plan_flags[:] = framing.item_flags(
        np.zeros(n, np.bool_), np.full(n, slot), False, info_columns=True
    )
    shared.done.expect(0, seq)


def records(shared):
    data = os.read(shared.done.done_read(0), 4096)
    return list(DONE_RECORD.iter_unpack(data))


def reply(parent_end):
    """The next message the worker wrote on its socket (the parent's end)."""
    return decode(MessageReader(parent_end.fileno()).read())


def test_a_planned_step_is_answered_in_shared_memory_and_by_its_record(worker):
    shared, loop, parent_end = worker(CountingEnv, CountingEnv)
    plan(shared, 1, np.array([1, 0]))
    loop._fast_batch(*loop.writer.planned_items(), False, True)
    assert records(shared) == [(0, 1, DONE_REPLY)]  # the first info's schema travels
    assert reply(parent_end).schemas
    plan(shared, 2, np.array([1, 1]), slot=0)
    loop._fast_batch(*loop.writer.planned_items(), False, True)
    assert records(shared) == [(0, 2, DONE_OK)]  # from now on the record is the answer
    assert shared.status[0] == 2
    assert shared.rewards.tolist() == [1.0, 1.0]
    assert shared.obs_slots[0, :, 0].tolist() == [2.0, 2.0]


def test_an_env_that_raises_is_answered_in_the_reply_and_its_sibling_steps(worker):
    shared, loop, parent_end = worker(CountingEnv, functools.partial(RaiseOnStep, at_count=1))
    plan(shared, 1, np.array([1, 1]))
    loop._fast_batch(*loop.writer.planned_items(), False, True)
    assert records(shared) == [(0, 1, DONE_REPLY)]
    assert shared.status[0] == 0  # not all of it in shared memory
    answer = reply(parent_end)
    assert answer.value[1].failure.type_name == "ValueError"
    assert set(answer.value) == {1}  # env 0 stepped: its info is in its row
    assert shared.rewards[0] == 1.0


def test_the_loop_runs_a_planned_seq_once_however_often_it_is_woken_and_ends_on_close(worker):
    shared, loop, parent_end = worker(CountingEnv)
    thread = threading.Thread(target=loop.serve)
    thread.start()
    plan(shared, 1, np.array([1]))
    parent_end.sendall(framing.PLANNED_FRAMES[False] * 2)  # woken twice for one seq
    parent_end.sendall(frame(encode(Request(Command.CLOSE, -1))))
    thread.join(10)
    assert not thread.is_alive()
    assert [seq for _, seq, _ in records(shared)] == [1]
    assert loop.runner.envs[0].unwrapped.count == 1
