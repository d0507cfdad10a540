"""A worker's counters, and a vector's: steps, episodes, latencies, restarts, recycles."""

from __future__ import annotations

import numpy as np

from multienv.supervision.worker_stats import LatencyRing, VectorCounters, WorkerStats
from multienv.wire.protocol import Batch, BatchResult


def batch(positions: list[int], resets: list[bool], *, is_whole: bool = False) -> Batch:
    return Batch(positions, np.array(resets), [0] * len(positions), is_whole=is_whole)


def result(done: list[bool]) -> BatchResult:
    n = len(done)
    return BatchResult(np.zeros(n), np.array(done), np.zeros(n, dtype=np.bool_), None, {})


def test_a_batch_counts_the_envs_that_stepped_not_those_reset_or_failed():
    stats = WorkerStats(3)
    stats.note_batch(
        batch([0, 1, 2], [False] * 3, is_whole=True), result([True, False, False]), 0.01, []
    )
    stats.note_batch(
        batch([0, 1, 2], [True, False, False]), result([False, True, False]), 0.02, [2]
    )
    assert stats.steps.tolist() == [1, 2, 1]
    assert stats.episodes.tolist() == [1, 1, 0]
    assert sorted(stats.step_latencies_s) == [0.01, 0.02]
    stats.note_batch(batch([1], [False]), result([False]), 0.03, [])  # one env: the scalar path
    assert stats.steps.tolist() == [1, 3, 1]


def test_a_row_reports_counts_and_the_latency_percentiles():
    stats = WorkerStats(1)
    for elapsed in (0.001, 0.002, 0.003):
        stats.note_batch(batch([0], [False]), result([False]), elapsed, [])
    stats.note_failure("SIGKILL")
    stats.note_restart()
    stats.note_recycle()
    row = stats.row(0)
    assert (row["steps"], row["episodes"], row["restarts"], row["recycles"]) == (3, 0, 1, 1)
    assert row["last_failure"] == "SIGKILL"
    assert row["step_latency_p50_s"] == 0.002


def test_since_spawn_counts_only_the_current_workers_steps():
    stats = WorkerStats(2)
    stats.note_batch(batch([0, 1], [False, False], is_whole=True), result([True, False]), 0.0, [])
    stats.note_spawn()
    stats.note_batch(batch([0, 1], [False, False], is_whole=True), result([False, True]), 0.0, [])
    assert stats.since_spawn() == (2, 1)


def test_a_vector_adopts_its_workers_counts_and_flushes_what_it_holds_back():
    first, second = WorkerStats(2), WorkerStats(1)
    first.note_batch(batch([0, 1], [False, False], is_whole=True), result([False, False]), 0.0, [])
    counters = VectorCounters(3)
    counters.adopt(first, slice(0, 2))
    counters.adopt(second, slice(2, 3))
    assert counters.steps.tolist() == [1, 1, 0]  # the counts so far are kept
    held = [np.array([False, True, False])]  # a step the data plane has not counted yet

    def flush() -> None:
        while held:
            counters.note_steps(held.pop())

    counters.pending = flush
    assert second.row(0)["steps"] == 1  # reading flushes what the data plane held back
    assert second.row(0)["episodes"] == 0
    assert first.row(1)["episodes"] == 1
    assert not held
    counters.note_planned(slice(0, 2), np.array([True, False]), np.array([False, True]))
    assert counters.steps.tolist() == [2, 3, 1]
    assert counters.episodes.tolist() == [0, 2, 0]
    assert first.steps.tolist() == [2, 3]  # the worker's counters are views of the vector's


def test_the_latency_ring_keeps_the_latest_round_trips():
    ring = LatencyRing(size=3)
    assert ring.recent().size == 0
    for count, value in enumerate((1.0, 2.0, 3.0, 4.0), start=1):
        ring.values[ring.count % ring.size] = value
        ring.count = count
    assert sorted(ring.recent().tolist()) == [2.0, 3.0, 4.0]
