"""planned_step: a worker's usual planned step, on a vector's real shared memory, in-process.

Each test writes a planned step as the parent does (``plan``) and runs it through the
worker's ``PlannedStep``, then reads what the parent would: records, status, shared rows and
the reply on the worker's socket.
"""

import functools
import os
import select
import threading

import numpy as np
import pytest

from multienv.wire import framing
from multienv.wire.framing import (
    DONE_OK,
    DONE_RECORD,
    DONE_REPLY,
    IS_NEXT_STEP,
    IS_RESET,
    PLANNED_ROUND,
    PLANNED_STEP,
    encode,
    frame,
)
from multienv.wire.protocol import Command, Request
from tests.envs import BigFrameEnv, BoxActionEnv, CountingEnv, DictObsEnv, RaiseOnStep
from tests.test_worker import plan, records, reply

pytestmark = pytest.mark.timeout(30)


class TextRewardEnv(CountingEnv):
    """A CountingEnv whose reward is no number."""

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, "high", terminated, truncated, info


def register(shared, schemas):
    """The parent's side of a reply's schemas; the fixture's vector has a worker per env."""
    for worker_number in range(shared.num_envs):
        shared.infos.register(worker_number, schemas)


def learn_schema(shared, loop, parent_end, seq=1):
    """Run a first step: its reply carries the info's schema; steps after it answer in full."""
    plan(shared, seq, np.ones(shared.num_envs, np.int64))
    loop.planned.run(PLANNED_STEP)
    assert records(shared) == [(0, seq, DONE_REPLY)]
    schemas = reply(parent_end).schemas
    assert schemas
    register(shared, schemas)


def test_a_usual_step_is_answered_in_shared_memory_alone(worker):
    shared, loop, parent_end = worker(CountingEnv, CountingEnv, CountingEnv)
    learn_schema(shared, loop, parent_end)
    plan(shared, 2, np.array([1, 0, 1]), slot=0)
    assert loop.planned.run(PLANNED_STEP) is False  # no env was reset
    assert records(shared) == [(0, 2, DONE_OK)]
    assert shared.status[0] == 2
    assert shared.rewards.tolist() == [1.0, 0.0, 1.0]
    assert shared.obs_slots[0, :, 0].tolist() == [2.0, 2.0, 2.0]
    assert shared.obs_slots[1, :, 0].tolist() == [1.0, 1.0, 1.0]  # the caller's, untouched
    assert shared.infos.merge({}, slice(None), lambda *a: {})["count"].tolist() == [2, 2, 2]
    assert [env.unwrapped.count for env in loop.runner.envs] == [2, 2, 2]


def actions_seen(loop):
    """Wrap each env's step to keep the actions it is given."""
    seen = []
    for env in loop.runner.envs:
        step = env.step
        env.step = lambda action, step=step: (seen.append(action), step(action))[1]
    return seen


def test_each_env_gets_its_own_discrete_action_as_a_numpy_integer(worker):
    shared, loop, _ = worker(CountingEnv, CountingEnv)
    seen = actions_seen(loop)
    plan(shared, 1, np.array([0, 1]))
    loop.planned.run(PLANNED_STEP)
    assert [int(action) for action in seen] == [0, 1]
    assert all(isinstance(action, np.integer) for action in seen)


def test_box_actions_are_copies_that_the_parents_next_actions_leave_alone(worker):
    shared, loop, _ = worker(BoxActionEnv, BoxActionEnv)
    seen = actions_seen(loop)
    plan(shared, 1, np.array([[0.5, 0.25], [-0.5, 0.0]], np.float32))
    loop.planned.run(PLANNED_STEP)
    shared.actions[:] = 0.75  # the next step's, written while an env may keep the last
    assert [action.tolist() for action in seen] == [[0.5, 0.25], [-0.5, 0.0]]
    assert not any(np.shares_memory(action, shared.actions) for action in seen)


def test_under_next_step_autoreset_an_env_whose_last_result_ended_resets(worker):
    shared, loop, parent_end = worker(CountingEnv, CountingEnv)
    learn_schema(shared, loop, parent_end)
    shared.flags[0] = [False, True]  # env 1's last step terminated its episode
    plan(shared, 2, np.array([1, 1]), slot=0)
    shared.plan_flags[:] |= IS_NEXT_STEP
    assert loop.planned.run(PLANNED_STEP) is True
    assert [env.unwrapped.count for env in loop.runner.envs] == [2, 0]
    assert records(shared) == [(0, 2, DONE_REPLY)]  # the reset's info: another schema
    answer = reply(parent_end)
    assert answer.schemas
    assert shared.rewards.tolist() == [1.0, 0.0]
    assert shared.flags.tolist() == [[False, False], [False, False]]
    assert shared.obs_slots[0, :, 0].tolist() == [2.0, 0.0]


def test_an_env_that_raises_is_answered_in_the_reply_and_its_siblings_step(worker):
    shared, loop, parent_end = worker(
        functools.partial(RaiseOnStep, at_count=1), CountingEnv, CountingEnv
    )
    plan(shared, 1, np.array([1, 1, 1]))
    loop.planned.run(PLANNED_STEP)
    assert records(shared) == [(0, 1, DONE_REPLY)]
    assert shared.status[0] == 0  # not all of it in shared memory
    answer = reply(parent_end)
    assert answer.value[0].failure.type_name == "ValueError"
    assert set(answer.value) == {0}  # envs 1 and 2 stepped: their infos are in their rows
    assert shared.rewards[1:].tolist() == [1.0, 1.0]
    assert shared.obs_slots[1, 1:, 0].tolist() == [1.0, 1.0]  # each written to its own row
    register(shared, answer.schemas)
    assert shared.infos.row_infos(np.arange(3)) == {1: {"count": 1}, 2: {"count": 1}}


def test_a_reward_that_is_no_number_is_that_envs_error_and_the_worker_goes_on(worker):
    shared, loop, parent_end = worker(CountingEnv, TextRewardEnv)
    plan(shared, 1, np.array([1, 1]))
    loop.planned.run(PLANNED_STEP)
    answer = reply(parent_end)
    assert answer.value[1].failure.type_name == "TypeError"
    assert set(answer.value) == {1}
    assert shared.rewards[0] == 1.0


def test_an_unusual_plan_goes_to_the_general_fast_batch(worker):
    shared, loop, parent_end = worker(CountingEnv, CountingEnv)
    learn_schema(shared, loop, parent_end)
    plan(shared, 2, np.array([1, 1]), slot=0)
    shared.plan_flags[0] |= IS_RESET  # a masked reset of env 0: flags differ between envs
    assert loop.planned.run(PLANNED_STEP) is False  # the general batch trims on its own
    assert [env.unwrapped.count for env in loop.runner.envs] == [0, 2]
    assert records(shared) == [(0, 2, DONE_REPLY)]  # the reset's info has its own schema
    reply(parent_end)
    plan(shared, 3, np.array([1, 1]), slot=1)
    loop.planned.run(PLANNED_STEP)
    assert records(shared) == [(0, 3, DONE_OK)]


@pytest.mark.parametrize("env_fn", [BigFrameEnv, DictObsEnv], ids=["large", "nested"])
def test_large_and_nested_observations_are_written_env_by_env(worker, env_fn):
    shared, loop, parent_end = worker(env_fn, env_fn)
    actions = np.zeros((2, *shared.actions.shape[1:]), shared.actions.dtype)
    plan(shared, 1, actions)
    loop.planned.run(PLANNED_STEP)
    reply(parent_end)  # the first info's schema
    shared.move_all_to(1)
    for position, env in enumerate(loop.runner.envs):
        expected = env.unwrapped._obs()
        got = shared.read(position) if shared.obs_slots is None else shared.obs_slots[1, position]
        if isinstance(expected, dict):
            assert got["position"].tolist() == expected["position"].tolist()
            assert int(got["mode"]) == expected["mode"]
        else:
            assert np.array_equal(got, expected)


def test_the_worker_reads_its_pipe_itself_while_planned_steps_come(worker):
    shared, loop, parent_end = worker(CountingEnv)
    thread = threading.Thread(target=loop.serve)
    thread.start()
    for seq in (1, 2, 3):
        plan(shared, seq, np.array([1]), slot=seq % 2)
        parent_end.sendall(framing.PLANNED_FRAMES[False])
        select.select([shared.done.done_read(0)], [], [], 10)
        assert [found for _, found, _ in records(shared)] == [seq]
    parent_end.sendall(frame(encode(Request(Command.CLOSE, -1))))  # not a planned step
    thread.join(10)
    assert not thread.is_alive()  # the loop took the CLOSE from the planned steps' reader
    assert loop.runner.envs[0].unwrapped.count == 3


def quiet_records(shared):
    """The records in the quiet pipe (none: an empty list)."""
    try:
        data = os.read(shared.done.pipes()[1], 4096)
    except BlockingIOError:
        return []
    return list(DONE_RECORD.iter_unpack(data))


def test_in_a_data_planes_round_a_full_answer_is_the_status_alone(worker):
    shared, loop, parent_end = worker(CountingEnv, CountingEnv)
    learn_schema(shared, loop, parent_end)
    tokens_write = shared.done.pipes()[2]
    os.write(tokens_write, bytes(1))  # another worker of the round is still stepping
    plan(shared, 2, np.array([1, 1]), slot=0)
    loop.planned.run(PLANNED_ROUND)
    assert shared.status[0] == 2
    assert quiet_records(shared) == []  # no record: it took the token and said nothing more
    with pytest.raises(BlockingIOError):
        records(shared)
    plan(shared, 3, np.array([1, 1]), slot=1)
    loop.planned.run(PLANNED_ROUND)  # no token left: the last of its round wakes the parent
    assert quiet_records(shared) == []
    assert records(shared) == [(0, 3, DONE_OK)]


def test_in_a_round_an_answer_with_a_reply_still_leaves_its_record(worker):
    shared, loop, parent_end = worker(CountingEnv, functools.partial(RaiseOnStep, at_count=1))
    os.write(shared.done.pipes()[2], bytes(1))
    plan(shared, 1, np.array([1, 1]))
    loop.planned.run(PLANNED_ROUND)
    assert shared.status[0] == 0
    assert quiet_records(shared) == [(0, 1, DONE_REPLY)]  # the handed-over round reads it
    assert reply(parent_end).value[1].failure.type_name == "ValueError"
