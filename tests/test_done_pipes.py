"""The done pipes: of a round's workers, only the last to finish wakes the parent.

Unit tests over real pipes, in one process: each ``DoneNotifier`` stands for a worker.
The behaviour with real workers, killed in a round, is in ``test_layouts.py`` (every fault
test runs with two or more workers) and at the end of this file.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

from multienv import MultiEnv
from multienv.wire import done_pipes
from multienv.wire.done_pipes import DoneChannels, DoneNotifier
from multienv.wire.done_pipes import _drain as _real_drain
from multienv.wire.framing import DONE_OK, DONE_REPLY
from tests.envs import HangOnStep, QuietSlowReset, SleepyEnv


@pytest.fixture
def channels():
    done = DoneChannels([[0, 1, 2], [3]])
    yield done
    done.close()


def notifier(channels: DoneChannels, worker_number: int) -> DoneNotifier:
    """A worker's end, with its own copies of the fds, as a worker receives them."""
    fds = channels.worker_fds(worker_number)
    return DoneNotifier(worker_number, (os.dup(fds[0]), os.dup(fds[1]), os.dup(fds[2])))


@pytest.fixture
def workers(channels):
    """The ends of the first slice's three workers."""
    ends = [notifier(channels, w) for w in range(3)]
    yield ends
    for end in ends:
        end.close()


def open_round(channels: DoneChannels, seq: int) -> None:
    """The parent starts a round and sends batch ``seq`` to each of the first slice's workers."""
    channels.open_round()
    for w in range(3):
        channels.expect(w, seq)


def is_woken(channels: DoneChannels, worker_number: int) -> bool:
    """Whether the parent, asleep on the worker's slice's done pipe, would wake now."""
    poller = select.poll()
    poller.register(channels.done_read(worker_number), select.POLLIN)
    return bool(poller.poll(0))


def test_in_a_round_only_the_last_worker_to_finish_wakes_the_parent(channels, workers):
    for round_number in range(1, 4):  # rounds follow each other with no stale tokens
        open_round(channels, round_number)
        for w in (2, 0):
            workers[w].notify(round_number, DONE_OK, is_counted=True)
            assert not is_woken(channels, 0)
        workers[1].notify(round_number, DONE_REPLY, is_counted=True)
        assert is_woken(channels, 0)
        channels.drain(channels.done_read(0))
        assert channels.done_seq[:3] == [round_number] * 3
        assert channels.done_kind[:3] == [DONE_OK, DONE_REPLY, DONE_OK]
        assert not is_woken(channels, 0)


def collect_round(channels: DoneChannels, workers, seq: int, order=(2, 0, 1)) -> None:
    """Each worker finishes batch ``seq`` in ``order``; only the last wakes; all are taken."""
    for w in order[:-1]:
        workers[w].notify(seq, DONE_OK, is_counted=True)
        assert not is_woken(channels, 0), f"worker {w} of round {seq} woke the parent"
    workers[order[-1]].notify(seq, DONE_OK, is_counted=True)
    assert is_woken(channels, 0)
    channels.drain(channels.done_read(0))
    assert [channels.take(w, is_counted=True) for w in range(3)] == [DONE_OK] * 3


def test_after_a_round_collected_whole_the_tokens_are_not_drained(channels, workers, monkeypatch):
    drained = []

    def counting_drain(read_fd: int) -> None:
        drained.append(read_fd)
        _real_drain(read_fd)

    monkeypatch.setattr(done_pipes, "_drain", counting_drain)
    for seq in range(1, 5):
        open_round(channels, seq)
        collect_round(channels, workers, seq)
    assert len(drained) == 1  # before the first round only: none was left after each round


def test_a_token_left_by_a_round_not_collected_whole_is_drained(channels, workers):
    open_round(channels, 1)
    workers[0].notify(1, DONE_OK, is_counted=True)  # takes one of the two tokens
    channels.drain(channels.done_read(0))
    channels.take(0, is_counted=True)  # workers 1 and 2 never answer: one token is left
    open_round(channels, 2)
    collect_round(channels, workers, 2)  # with the stale token, nobody would wake it


def test_a_batch_outside_a_round_wakes_the_parent_at_once(channels):
    worker = notifier(channels, 0)
    channels.open_round()  # tokens in the pipe do not matter to an uncounted batch
    channels.expect(0, 9)
    worker.notify(9, DONE_OK, is_counted=False)
    assert is_woken(channels, 0)
    channels.drain(channels.done_read(0))
    assert channels.done_seq[0] == 9
    worker.close()


def test_a_slice_of_one_worker_is_never_counted(channels):
    assert [channels.has_others(w) for w in range(4)] == [True, True, True, False]
    worker = notifier(channels, 3)
    channels.open_round()
    channels.expect(3, 1)
    worker.notify(1, DONE_OK, is_counted=False)
    assert is_woken(channels, 3)
    assert not is_woken(channels, 0)  # each slice has its own pipes
    worker.close()


def test_a_worker_that_leaves_the_round_makes_the_others_wake_the_parent(channels, workers):
    open_round(channels, 4)
    channels.leave_round(1)  # its part went as a general batch: it answers uncounted
    workers[0].notify(4, DONE_OK, is_counted=True)
    assert not is_woken(channels, 0)
    workers[2].notify(4, DONE_OK, is_counted=True)
    assert is_woken(channels, 0)  # the last counted one


def test_giving_up_more_tokens_than_the_round_has_only_wakes_the_parent_sooner(channels, workers):
    open_round(channels, 2)
    for w in range(3):
        channels.leave_round(w)
    workers[0].notify(2, DONE_OK, is_counted=True)
    assert is_woken(channels, 0)


def test_records_of_an_earlier_batch_are_dropped_from_either_pipe(channels, workers):
    open_round(channels, 5)
    workers[0].notify(5, DONE_OK, is_counted=True)  # quiet pipe
    workers[1].notify(5, DONE_OK, is_counted=True)  # quiet pipe
    workers[2].notify(5, DONE_OK, is_counted=True)  # both: the last
    channels.expect(2, 6)  # the parent collected worker 2 from the quiet pipe, sent batch 6
    channels.drain(channels.done_read(0))  # the done pipe still holds the record of batch 5
    assert channels.done_seq[:3] == [5, 5, 0]
    workers[2].notify(6, DONE_OK, is_counted=False)
    channels.drain(channels.done_read(0))
    assert channels.done_seq[2] == 6


def test_a_round_sentinel_is_forgotten_once_given_up(channels):
    channels.open_round()
    channels.join_round(0, 100, None)
    channels.join_round(1, 101, 5.0)
    assert channels.round_sentinels(0) == [101]
    channels.leave_round(0, sentinel=101)
    assert channels.round_sentinels(0) == []
    assert channels.round_deadline(0) is None  # a dead worker's deadline goes with it
    channels.open_round()
    assert channels.round_sentinels(1) == []


def test_the_round_deadline_is_the_earliest_of_the_others_still_stepping(channels, workers):
    open_round(channels, 7)
    channels.join_round(0, 100, None)  # a reset with no reset_timeout
    channels.join_round(1, 101, 9.0)
    channels.join_round(2, 102, 8.0)
    assert channels.round_deadline(0) == 8.0
    assert channels.round_deadline(2) == 9.0  # its own does not count
    workers[2].notify(7, DONE_OK, is_counted=True)  # in, not yet collected
    channels.drain_quiet(channels.done_read(0))
    assert channels.round_deadline(0) == 9.0
    channels.settle(1)  # collected
    assert channels.round_deadline(0) is None


def test_a_broken_round_makes_every_worker_that_finishes_wake_the_parent(channels, workers):
    open_round(channels, 7)
    for w in range(3):
        channels.join_round(w, 100 + w, 1.0)
    channels.break_round(0)
    assert channels.round_deadline(0) is None
    workers[0].notify(7, DONE_OK, is_counted=True)
    assert is_woken(channels, 0)  # no token left to take


# ---------------------------------------------------------------- real workers


def step_soon(envs: MultiEnv) -> list[tuple[bool, str | None]]:
    """Step both envs, within 5 s; each env's truncation and its cause (None if not cut)."""
    began = time.monotonic()
    _, _, _, truncations, infos = envs.step(np.ones(2, dtype=np.int64))
    assert time.monotonic() - began < 5.0
    causes = infos.get("multienv", {}).get("cause", [None, None])
    return [
        (bool(cut), str(cause) if cut else None)
        for cut, cause in zip(truncations, causes, strict=True)
    ]


@pytest.mark.fault
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["sleep", "spin"])
def test_a_worker_of_a_round_killed_while_the_parent_waits_for_another(wait):
    # The parent waits for worker 0; worker 1 is killed, so it takes no token, and worker 0
    # takes the round's only one when it finishes: the parent must see the death itself.
    fns = [functools.partial(SleepyEnv, 0.6), functools.partial(SleepyEnv, 0.6)]
    with MultiEnv(fns, envs_per_worker=1, wait=wait) as envs:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))  # its infos' columns: later answers are records
        envs.envs[1].set_attr("slow_s", 3.0)
        timer = threading.Timer(0.2, os.kill, (envs.envs[1].pid, signal.SIGKILL))
        timer.start()
        try:
            _, _, _, truncations, infos = envs.step(np.ones(2, dtype=np.int64))
        finally:
            timer.cancel()
        assert truncations.tolist() == [False, True]
        assert infos["multienv"]["cause"][1] == "SIGKILL"
        envs.step(np.ones(2, dtype=np.int64))


@pytest.mark.fault
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["sleep", "spin"])
def test_a_worker_killed_as_a_step_is_sent_leaves_its_token_to_a_mate_then_read(wait):
    # Worker 0 is killed as the step is sent, and takes a while to be gone; worker 1 takes
    # the round's only token meanwhile and wakes no one. The parent gives worker 0's token
    # up too late, and must read worker 1's record from the quiet pipe.
    fns = [functools.partial(SleepyEnv, 0.0)] * 2
    with MultiEnv(fns, envs_per_worker=1, wait=wait) as envs:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))  # its infos' columns: later answers are records
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        assert step_soon(envs) == [(True, "SIGKILL"), (False, None)]
        envs.step(np.ones(2, dtype=np.int64))


@pytest.mark.fault
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["sleep", "spin"])
@pytest.mark.parametrize("reset_s", [0.2, 1.0])
def test_a_hang_past_step_timeout_is_killed_while_a_mate_resets_with_no_timeout(wait, reset_s):
    # Worker 0 resets (its episode ended; no reset_timeout: no deadline of its own) and
    # finishes after the parent fell asleep on it, waking no one; worker 1 hangs. Sleeping
    # until the round's last worker woke it, the parent waited out the whole hang:
    # step_timeout was not kept. A reset of 1 s is still running when worker 1's deadline
    # passes: the round is broken, so that worker 0 wakes the parent when it is done.
    fns = [functools.partial(QuietSlowReset, reset_s), functools.partial(HangOnStep, 2, 30.0)]
    with MultiEnv(fns, envs_per_worker=1, wait=wait, step_timeout=0.5) as envs:
        envs.reset(seed=0)
        envs.envs[0].set_attr("episode_length", 1)
        _, _, terminations, _, _ = envs.step(np.ones(2, dtype=np.int64))
        assert terminations.tolist() == [True, False]
        cpu_began = time.process_time()
        assert step_soon(envs) == [(False, None), (True, "timeout")]
        assert time.process_time() - cpu_began < 0.25  # it slept, not polled, for worker 0
        envs.step(np.ones(2, dtype=np.int64))
