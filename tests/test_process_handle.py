"""process_handle: one worker process, spawned, asked, waited for and stopped; real processes."""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from multienv.backends.subprocess.process_handle import ProcessHandle
from multienv.backends.subprocess.process_launch import WorkerRecipe
from multienv.supervision.factory import pickle_env_fn
from multienv.supervision.handles import Death
from multienv.wire.protocol import Batch, BatchResult, Reply
from tests.envs import CountingEnv, HangOnStep

pytestmark = pytest.mark.timeout(60)


def handle_of(*env_fns):
    recipe = WorkerRecipe(
        multiprocessing.get_context("forkserver"),
        [pickle_env_fn(fn, i) for i, fn in enumerate(env_fns)],
        0,
    )
    return ProcessHandle(recipe)


@pytest.fixture
def handle():
    made = []

    def make(*env_fns):
        made.append(handle_of(*env_fns))
        return made[-1]

    yield make
    for each in made:
        each.stop(5.0)


def ready(handle):
    handle.spawn()
    reply = handle.handshake(time.monotonic() + 30)
    assert isinstance(reply, Reply)
    assert reply.failure is None
    return handle


def steps(positions, action=1):
    n = len(positions)
    return Batch(positions, np.zeros(n, dtype=np.bool_), [action] * n)


def resets(positions):
    n = len(positions)
    return Batch(positions, np.ones(n, dtype=np.bool_), [None] * n)


def test_before_its_first_spawn_a_handle_has_no_process():
    handle = handle_of(CountingEnv)
    assert handle.pid is None
    assert handle.rss_mb() is None
    assert handle.plane_fds() is None
    assert not handle.is_linked
    assert handle.collect(None) == Death("unknown")
    handle.kill()  # nothing to kill: no error
    handle.stop(1.0)


def test_a_spawned_worker_answers_pickled_batches_of_its_envs(handle):
    worker = ready(handle(CountingEnv, CountingEnv))
    assert worker.pid is not None
    assert worker.pid != os.getpid()
    assert worker.rss_mb() > 1
    worker.submit_batch(resets([0, 1]))
    worker.collect_batch(None)
    worker.submit_batch(steps([1]))
    result = worker.collect_batch(None)
    assert isinstance(result, BatchResult)
    assert result.rewards.tolist() == [1.0]
    assert [obs.tolist() for obs in result.obs] == [[1.0]]
    assert result.extras[0].info == {"count": 1}


def test_a_worker_killed_by_a_signal_is_a_death_named_by_its_signal(handle):
    worker = ready(handle(CountingEnv))
    worker.submit_batch(resets([0]))
    worker.collect_batch(None)
    os.kill(worker.pid, signal.SIGKILL)
    worker.submit_batch(steps([0]))  # a dead worker's pipe: noticed by the wait
    assert worker.collect_batch(None) == Death("SIGKILL")


def test_a_worker_past_its_deadline_is_killed_and_reported_as_timed_out(handle):
    worker = ready(handle(lambda: HangOnStep(at_count=1)))
    worker.submit_batch(resets([0]))
    worker.collect_batch(None)
    pid = worker.pid
    worker.submit_batch(steps([0]))
    began = time.monotonic()
    assert worker.collect_batch(time.monotonic() + 0.3) == Death("timeout")
    assert time.monotonic() - began < 10
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_spawn_again_replaces_the_worker(handle):
    worker = ready(handle(CountingEnv))
    first = worker.pid
    worker.kill()
    ready(worker)
    assert worker.pid != first
    worker.submit_batch(resets([0]))
    assert isinstance(worker.collect_batch(None), BatchResult)


def test_stop_ends_the_worker_and_is_idempotent(handle):
    worker = ready(handle(CountingEnv))
    pid = worker.pid
    worker.stop(5.0)
    worker.stop(5.0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
