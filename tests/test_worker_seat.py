"""worker_seat: one worker's place in a vector's shared batch; how its batches travel and return."""

import pickle

import gymnasium as gym
import numpy as np
import pytest

from multienv.backends.subprocess.worker_seat import WorkerSeat
from multienv.wire import framing
from multienv.wire.protocol import Batch, Command, Outcome, Reply, StepPlan
from multienv.wire.shared_memory import BatchLayout, SharedBatch

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACTION = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

pytestmark = pytest.mark.skipif(
    not BatchLayout.supports(OBS), reason="shared memory needs Linux memfd_create"
)


@pytest.fixture
def shared():
    batch = SharedBatch(OBS, ACTION, 4, [[0, 1]], worker_of_env=[0, 0, 1, 1])
    yield batch
    batch.close()


def step(positions, actions, **fields):
    n = len(positions)
    return Batch(positions, np.zeros(n, dtype=np.bool_), actions, **fields)


def test_an_unlinked_seat_pickles_its_batches_and_numbers_nothing():
    seat = WorkerSeat(None, 0, [0, 1])
    message, seq = seat.batch_frame(step([0, 1], np.zeros((2, 2), np.float32)))
    assert seq == 0
    assert seat.seq == 0
    assert seat.read_obs(0) is None
    assert not seat.has_record(0)
    assert message[4] == 0x80  # the pickle protocol opcode: a framed, pickled Request


def test_a_whole_worker_travels_as_a_few_bytes_its_actions_in_shared_memory(shared):
    seat = WorkerSeat(shared, 1, [2, 3])
    actions = np.array([[0.5, -0.5], [0.25, 0.75]], np.float32)
    message, seq = seat.batch_frame(step([0, 1], actions, is_whole=True))
    assert seq == 1
    assert shared.done.seqs[1] == 1  # only this seq's record counts from now on
    assert np.array_equal(shared.actions[2:4], actions)
    assert not shared.actions[:2].any()  # another worker's rows are left alone
    payload = message[4:]
    assert payload[0] == framing.FAST_BATCH
    seq_sent, items = framing.decode_fast_batch(payload)
    items = list(items)
    assert seq_sent == 1
    assert [position for position, _ in items] == [0, 1]
    assert [framing.slot_of(flags) for _, flags in items] == [1, 1]  # not the slot seen last


def test_seqs_go_from_1_to_255_and_round_again(shared):
    seat = WorkerSeat(shared, 0, [0, 1])
    seat.seq = 254
    assert [seat.next_seq() for _ in range(3)] == [255, 1, 2]


def test_a_reset_with_seeds_is_pickled_each_item_naming_its_slot(shared):
    seat = WorkerSeat(shared, 0, [0, 1])
    batch = Batch([1], np.ones(1, dtype=np.bool_), [None], seeds=[7])
    message, seq = seat.batch_frame(batch)
    assert seq == 0
    request = pickle.loads(message[4:])
    assert request.command is Command.BATCH
    (order,) = request.payload
    assert order.position == 1
    assert order.seed == 7
    assert order.slot == 1


def test_actions_of_another_dtype_are_pickled_as_given(shared):
    seat = WorkerSeat(shared, 0, [0, 1])
    _, seq = seat.batch_frame(step([0, 1], np.zeros((2, 2), np.float64)))
    assert seq == 0
    assert not shared.actions.any()


def test_a_records_seq_answers_only_its_batch(shared):
    seat = WorkerSeat(shared, 0, [0, 1])
    _, seq = seat.batch_frame(step([0, 1], np.zeros((2, 2), np.float32), is_whole=True))
    assert not seat.has_record(seq)
    shared.done.note_records(framing.DONE_RECORD.pack(0, seq, framing.DONE_OK))
    assert seat.has_record(seq)
    assert not seat.has_record(seq + 1)


def test_a_fast_batch_result_comes_from_shared_memory_and_moves_the_slots(shared):
    seat = WorkerSeat(shared, 1, [2, 3])
    seat.batch_frame(step([0, 1], np.zeros((2, 2), np.float32), is_whole=True))
    shared.rewards[2:4] = [1.5, 2.5]
    shared.flags[0, 3] = True
    result = seat.result(Reply({1: Outcome(info={"x": 1})}))
    assert result.rewards.tolist() == [1.5, 2.5]
    assert result.terminated.tolist() == [False, True]
    assert result.extras[1].info == {"x": 1}
    shared.rewards[2] = 9.0
    assert result.rewards[0] == 1.5  # a copy: the next batch writes over the shared one
    assert shared.slot.tolist() == [0, 0, 1, 1]


def test_an_env_that_failed_keeps_the_slot_the_caller_saw(shared):
    seat = WorkerSeat(shared, 0, [0, 1])
    seat.batch_frame(step([0, 1], np.zeros((2, 2), np.float32), is_whole=True))
    seat.result(Reply({0: Outcome(failure=object())}))  # any failure: env 0 did not step
    assert shared.slot.tolist() == [0, 1, 0, 0]


def test_a_planned_steps_slice_is_answered_from_the_plans_slots(shared):
    seat = WorkerSeat(shared, 1, [2, 3])
    plan = StepPlan(
        np.zeros((4, 2), np.float32),
        np.zeros(4, dtype=np.bool_),
        False,
        np.array([1, 1, 0, 1], dtype=np.int8),
    )
    seat.take_planned(plan, slice(2, 4))
    result = seat.result(Reply({}))
    assert result.info_columns  # a planned step's infos are in the columns too
    assert shared.slot.tolist() == [0, 0, 0, 1]
