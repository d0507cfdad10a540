"""shm_link: what a vector shares with its workers, and the planned step written once for all."""

import multiprocessing
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv.backends.subprocess.process_handle import ProcessHandle
from multienv.backends.subprocess.process_launch import WorkerRecipe
from multienv.backends.subprocess.shm_link import SubprocessLink, open_subprocess_link
from multienv.supervision.handles import VectorParts
from multienv.supervision.worker_stats import VectorCounters
from multienv.wire import framing
from multienv.wire.autoreset import Autoreset
from multienv.wire.shared_memory import BatchLayout

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACTION = gym.spaces.Discrete(2)

pytestmark = pytest.mark.skipif(
    not BatchLayout.supports(OBS), reason="shared memory needs Linux memfd_create"
)


def handles(count):
    """Handles of workers never spawned: a link only tells them their places."""
    context = multiprocessing.get_context("forkserver")
    return [ProcessHandle(WorkerRecipe(context, [b""], i)) for i in range(count)]


@pytest.fixture
def link():
    made = []

    def make(env_indices, slices=None, space=OBS, shared_memory=None):
        workers = handles(len(env_indices))
        slices = slices or [list(range(len(env_indices)))]
        made.append(SubprocessLink(workers, (space, ACTION), env_indices, slices, shared_memory))
        return made[-1], workers

    yield make
    for each in made:
        each.close()


def test_each_handle_learns_its_place_and_forgets_it_on_close(link):
    shared, workers = link([[0, 1], [2, 3]])
    assert shared.has_shared_obs
    assert all(worker.is_linked for worker in workers)
    shared.close()
    assert not any(worker.is_linked for worker in workers)


def test_steps_are_planned_only_for_workers_that_host_runs_of_envs_in_order(link):
    assert link([[0, 1], [2, 3]])[0].can_plan
    assert not link([[0, 2], [1, 3]])[0].can_plan  # scattered: each worker is batched
    assert not link([[1, 0], [2, 3]])[0].can_plan


def test_a_planned_step_writes_every_action_and_flag_once(link):
    shared, _ = link([[0, 1], [2, 3]])
    actions = np.array([1, 0, 1, 1])
    is_reset = np.array([False, True, False, False])
    plan = shared.plan_step(actions, is_reset, autoreset=False)
    memory = shared._shared
    assert memory.actions.tolist() == [1, 0, 1, 1]
    flags = memory.plan_flags
    assert [bool(f & framing.IS_RESET) for f in flags] == is_reset.tolist()
    assert {framing.slot_of(int(f)) for f in flags} == {1}  # never the slot seen last
    assert plan.num_resets == 1
    assert plan.wire.tolist() == [1, 1, 1, 1]
    assert shared.plan_step(actions.astype(np.int8), is_reset, False) is None  # as given


def test_a_clean_plan_moves_the_envs_to_their_new_slots(link):
    shared, _ = link([[0, 1], [2, 3]])
    plan = shared.plan_step(np.zeros(4, np.int64), np.zeros(4, np.bool_), False)
    memory = shared._shared
    memory.rewards[:] = [1.0, 2.0, 3.0, 4.0]
    rewards, terminated, _ = shared.commit(plan, slice(2, 4))
    assert rewards.tolist() == [3.0, 4.0]
    assert terminated.tolist() == [False, False]
    assert memory.slot.tolist() == [0, 0, 1, 1]


def vector_parts():
    return VectorParts(
        [SimpleNamespace(), SimpleNamespace()],
        [slice(0, 2), slice(2, 4)],
        Autoreset(AutoresetMode.NEXT_STEP, 4),
        VectorCounters(4),
        True,
        lambda infos, info, env_index: infos,
    )


def test_a_data_plane_needs_the_workers_in_one_slice(link):
    one, _ = link([[0, 1], [2, 3]])
    assert one.open_data_plane(vector_parts()) is not None
    several, _ = link([[0, 1], [2, 3]], slices=[[0], [1]])
    assert several.open_data_plane(vector_parts()) is None  # collected on several threads
    scattered, _ = link([[0, 2], [1, 3]])
    assert scattered.open_data_plane(vector_parts()) is None  # no planned steps


def test_a_space_of_no_fixed_shape_is_pickled_or_refused_as_async_vector_env_refuses_it(link):
    text = gym.spaces.Text(8)
    pickled, _ = link([[0], [1]], space=text)
    assert not pickled.has_shared_obs
    assert not pickled.can_plan
    unshared, _ = link([[0], [1]], shared_memory=False)
    assert not unshared.has_shared_obs


def test_a_link_takes_handles_of_one_backend():
    with pytest.raises(TypeError, match="same backend"):
        open_subprocess_link([object()], (OBS, ACTION), [[0]], [[0]], None)
