"""The shared batch layout and the slot rule, parent and worker views in one process."""

from __future__ import annotations

import os
import pickle

import gymnasium as gym
import numpy as np
import pytest

from multienv.wire.done_pipes import DoneNotifier
from multienv.wire.framing import DONE_OK, DONE_RECORD, DONE_REPLY, IS_RESET, IS_SLOT_1
from multienv.wire.shared_memory import BatchLayout, SharedBatch, SlotWriter
from tests.envs import FrameDictObsEnv, FrameObsEnv

_OBS = gym.spaces.Dict(
    {
        "image": gym.spaces.Box(0, 255, (3, 4), np.uint8),
        "pos": gym.spaces.Tuple((gym.spaces.Discrete(5), gym.spaces.Box(-1.0, 1.0, (2,)))),
    }
)
_ACTION = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

pytestmark = pytest.mark.skipif(
    not BatchLayout.supports(_OBS), reason="shared memory needs Linux memfd_create"
)


@pytest.fixture
def shared():
    batch = SharedBatch(_OBS, _ACTION, 4, [[0, 1]])
    yield batch
    batch.close()


def writer_for(shared: SharedBatch, worker_number: int, env_indices: list[int]) -> SlotWriter:
    layout = pickle.loads(pickle.dumps(shared.layout))  # as the worker receives it
    assert shared.fd is not None
    fds = tuple(os.dup(fd) for fd in shared.done.worker_fds(worker_number))
    return SlotWriter(layout, os.dup(shared.fd), DoneNotifier(worker_number, fds), env_indices)


def test_layout_pickles_to_the_same_offsets(shared: SharedBatch) -> None:
    copy = pickle.loads(pickle.dumps(shared.layout))
    assert copy.size == shared.layout.size
    assert all(offset % 64 == 0 for offset, _, _ in copy._arrays.values())
    assert copy._arrays == shared.layout._arrays


def test_worker_rows_round_trip_to_the_parent(shared: SharedBatch) -> None:
    writer = writer_for(shared, 1, [2, 3])  # the worker hosting envs 2 and 3
    sample = _OBS.sample()
    slots = shared.next_slots(slice(2, 4))
    writer.write_obs(1, int(slots[1]), sample)
    writer.write_results([0, 1], [0.5, -1.0], [False, True], [True, False])
    shared.done.expect(1, 7)
    writer.notifier.notify(7, DONE_OK, is_counted=False)
    shared.done.drain(shared.done.done_read(1))
    assert (shared.done.done_seq[1], shared.done.done_kind[1]) == (7, DONE_OK)
    shared.move_to(slice(2, 4), slots)
    got = shared.read(3)
    assert np.array_equal(got["image"], sample["image"])
    assert got["pos"][0] == sample["pos"][0]
    assert np.allclose(got["pos"][1], sample["pos"][1])
    assert shared.rewards[2:].tolist() == [0.5, -1.0]
    assert shared.flags[:, 2:].tolist() == [[False, True], [True, False]]
    del writer


def test_a_planned_step_is_read_from_shared_memory_and_answered_in_the_status(
    shared: SharedBatch,
) -> None:
    writer = writer_for(shared, 1, [2, 3])  # the worker hosting envs 2 and 3
    shared.plan_flags[:] = [IS_RESET, 0, IS_SLOT_1, IS_RESET | IS_SLOT_1]
    shared.done.expect(1, 9)
    assert writer.planned_items() == (9, [(0, IS_SLOT_1), (1, IS_RESET | IS_SLOT_1)])
    writer.notifier.notify(9, DONE_OK, is_counted=False, is_planned=True)
    assert shared.status[1] == 9
    shared.done.expect(1, 10)
    writer.notifier.notify(10, DONE_REPLY, is_counted=False, is_planned=True)
    assert shared.status[1] == 0  # a reply follows: no seq, so the parent reads it
    writer.notifier.notify(11, DONE_OK, is_counted=False)  # not planned: status untouched
    assert shared.status[1] == 0
    del writer


def test_next_slot_is_never_the_one_the_caller_saw(shared: SharedBatch) -> None:
    shared.move_to(np.array([1, 3]), np.ones(2, dtype=np.int8))
    assert shared.next_slots(slice(None)).tolist() == [1, 0, 1, 0]
    shared.move_to(np.array([1, 2]), np.array([0, 1], dtype=np.int8))
    assert shared.slot.tolist() == [0, 0, 1, 1]


def test_a_write_to_the_next_slot_leaves_the_seen_observation_intact(shared: SharedBatch) -> None:
    writer = writer_for(shared, 0, [0, 1])
    seen = _OBS.sample()
    writer.write_obs(0, int(shared.slot[0]), seen)
    half_written = _OBS.sample()
    writer.write_obs(0, int(shared.next_slots(slice(0, 1))[0]), half_written)  # never moved
    assert np.array_equal(shared.read(0)["image"], seen["image"])
    del writer


def test_actions_written_by_the_parent_are_read_by_the_worker(shared: SharedBatch) -> None:
    writer = writer_for(shared, 1, [2, 3])
    assert shared.actions is not None
    shared.actions[2:] = [[0.25, -0.5], [1.0, 0.0]]
    assert np.allclose(writer.read_actions([1, 0]), [[1.0, 0.0], [0.25, -0.5]])
    assert DONE_RECORD.size == 4
    del writer


def test_a_whole_vector_step_and_a_partial_one_both_return_the_newest_observations(
    shared: SharedBatch,
) -> None:
    writers = [writer_for(shared, 0, [0, 1]), writer_for(shared, 1, [2, 3])]
    first = [_OBS.sample() for _ in range(4)]
    slots = shared.next_slots(slice(None))
    for env_index, obs in enumerate(first):
        writers[env_index // 2].write_obs(env_index % 2, int(slots[env_index]), obs)
    shared.move_to(slice(None), slots)  # every env, clean: all on the other slot now
    got = shared.observations(copy=True)
    np.testing.assert_array_equal(got["image"], np.stack([o["image"] for o in first]))
    second = _OBS.sample()
    partial = shared.next_slots(slice(2, 3))
    writers[1].write_obs(0, int(partial[0]), second)
    shared.move_to(slice(2, 3), partial)  # env 2 alone: its slot differs from the others'
    got = shared.observations(copy=True)
    np.testing.assert_array_equal(got["image"][2], second["image"])
    np.testing.assert_array_equal(got["image"][0], first[0]["image"])
    assert len(set(shared.slot.tolist())) == 1
    del writers


def test_workers_write_large_observations_one_by_one_and_small_ones_at_once() -> None:
    """The layout tests' frame envs (16 KiB) take the one-by-one path; CartPole's do not."""
    for space, is_large in [
        (FrameObsEnv().observation_space, True),
        (FrameDictObsEnv().observation_space, True),
        (gym.make("CartPole-v1").observation_space, False),
        (_OBS, False),
    ]:
        batch = SharedBatch(space, _ACTION, 2, [[0]])
        try:
            writer = writer_for(batch, 0, [0, 1])
            assert writer.writes_each_obs is is_large, space
            del writer
        finally:
            batch.close()
