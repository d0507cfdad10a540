"""The typed messages between the parent and a worker: batches, results, pairs, states."""

from __future__ import annotations

import pickle

import numpy as np

from multienv.wire.protocol import (
    Batch,
    BatchResult,
    Outcome,
    PairResults,
    Pairs,
    RemoteFailure,
    StepPlan,
    failed_batch,
    pack_states,
    unpack_outcomes,
)


def test_a_subset_keeps_the_chosen_items_and_their_order():
    batch = Batch([0, 1, 2], np.array([False, True, False]), [5, 6, 7], seeds=[None, 3, None])
    part = batch.subset([2, 1])
    assert part.positions == [2, 1]
    assert part.is_reset.tolist() == [False, True]
    assert part.actions == [7, 6]
    assert part.seeds == [None, 3]
    orders = part.orders()
    assert [(o.position, o.is_reset, o.action, o.seed) for o in orders] == [
        (2, False, 7, None),
        (1, True, None, 3),  # a reset's action is not sent
    ]


def test_a_plans_batch_is_one_workers_slice_of_it():
    plan = StepPlan(np.arange(6), np.array([0, 0, 1, 0, 0, 0], dtype=np.bool_), False)
    batch = plan.batch(slice(2, 4))
    assert batch.positions == [0, 1]
    assert batch.is_reset.tolist() == [True, False]
    assert batch.actions.tolist() == [2, 3]
    assert batch.is_whole


def test_outcomes_unpack_into_a_result_with_extras_only_where_there_is_more_to_say():
    outcomes = [
        Outcome(np.zeros(1), 1.0, False, False, {}),
        Outcome(np.ones(1), 2.0, True, False, {"k": 1}),
        Outcome(np.full(1, 9.0), 0.5, True, False, {}, reset=(np.zeros(1), {"r": 1})),
    ]
    result = unpack_outcomes(outcomes)
    assert result.rewards.tolist() == [1.0, 2.0, 0.5]
    assert result.terminated.tolist() == [False, True, True]
    assert sorted(result.extras) == [1, 2]
    assert result.obs[2].tolist() == [0.0]  # after a same-step autoreset: the new episode's
    whole = BatchResult.empty(4)
    whole.obs = [None] * 4
    whole.merge(result, [3, 0, 1])
    assert whole.rewards.tolist() == [2.0, 0.5, 0.0, 1.0]
    assert sorted(whole.extras) == [0, 1]


def test_a_failed_batch_carries_the_failure_on_every_item():
    failure = RemoteFailure("OSError", "pipe", "", None)
    result = failed_batch(3, failure, has_obs=True)
    assert [result.extras[item].failure for item in range(3)] == [failure] * 3
    assert result.obs == [None, None, None]


def test_states_of_one_shape_and_dtype_travel_as_one_array():
    same = [np.arange(3.0), np.ones(3)]
    assert isinstance(pack_states(same), np.ndarray)
    assert pack_states(same).shape == (2, 3)
    mixed = [np.arange(3.0), np.arange(3)]  # float and int
    assert pack_states(mixed) is mixed
    assert pack_states([{"a": 1}, {"a": 2}])[0] == {"a": 1}


def test_pairs_and_their_results_pickle_their_arrays_as_raw_bytes_and_come_back_writable():
    pairs = Pairs([0, 1], np.arange(6.0).reshape(2, 3), np.array([1, 0]), np.array([5, 5]))
    back = pickle.loads(pickle.dumps(pairs))
    np.testing.assert_array_equal(back.snapshots, pairs.snapshots)
    back.snapshots[0, 0] = 42.0  # writable
    results = PairResults(
        [None, np.zeros(2)],
        np.zeros((2, 4)),
        np.ones(2),
        np.zeros(2, np.bool_),
        np.ones(2, np.bool_),
        [{}, {"x": 1}],
        {},
    )
    again = pickle.loads(pickle.dumps(results))
    assert again.truncated.dtype == np.bool_
    assert again.infos == [{}, {"x": 1}]
    assert again.snapshots[0] is None
