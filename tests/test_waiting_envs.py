"""A worker's envs that mostly wait step at once, on threads (``multienv.worker.waiting``).

Real workers throughout: the envs sleep in their steps, as I/O or a remote simulator
would, and the tests check what the caller sees, failures included.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv import MultiEnv
from multienv.errors import EnvError
from multienv.layout import MIN_WAIT_S, WAITING_SHARE
from multienv.worker import waiting
from multienv.worker.waiting import CONFIRM, FIRST_TIMED, SAMPLE_EVERY, WaitingEnvs
from tests.conftest import STEP_RAISED, wait_until_dead
from tests.envs import CountingEnv, WaitingEnv

ON_THREAD = "multienv-waiting-env"


def step_until_on_thread(envs, actions, steps: int, env_index: int) -> None:
    """Step ``steps`` times; by then env ``env_index`` steps on its worker's thread."""
    for _ in range(steps):
        *_, infos = envs.step(actions)
    assert infos["on_thread"][env_index]


def overlap(infos, env_ids) -> bool:
    """Whether the steps of these envs were all under way at one moment."""
    return max(infos["began"][env_ids]) < min(infos["ended"][env_ids])


def test_a_worker_s_waiting_envs_step_at_once_after_its_first_steps_show_they_wait():
    fns = [functools.partial(WaitingEnv, 1000, 0.05)] * 3 + [CountingEnv]
    with MultiEnv(fns, envs_per_worker=4) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        _, _, _, _, infos = envs.step(actions)
        assert not overlap(infos, [0, 1, 2])  # timed in the worker's loop, one after another
        assert not infos["on_thread"][:3].any()
        for _ in range(FIRST_TIMED):
            obs, _, _, _, infos = envs.step(actions)
        assert overlap(infos, [0, 1, 2])
        assert infos["on_thread"][:3].all()
        assert obs[:, 0].tolist() == [FIRST_TIMED + 1] * 4  # each stepped once a call


def test_a_lone_env_is_never_put_on_a_thread():
    with MultiEnv([functools.partial(WaitingEnv, 1000, 0.002)] * 2) as envs:
        envs.reset(seed=0)
        for _ in range(FIRST_TIMED + 3):
            *_, infos = envs.step(np.ones(2, dtype=np.int64))
        assert not infos["on_thread"].any()


def run(envs, steps: int, is_async: bool):
    """Each call's results (observations, rewards, flags, counts) over ``steps`` calls, and
    whether a thread stepped any env."""
    envs.reset(seed=0)
    results, on_thread = [], False
    for t in range(steps):
        actions = np.full(envs.num_envs, t % 2, dtype=np.int64)
        if is_async:
            envs.send(actions)
            obs, rewards, terminated, truncated, infos = envs.recv()
        else:
            obs, rewards, terminated, truncated, infos = envs.step(actions)
        counts = infos["count"].tolist() if "count" in infos else None
        results.append((obs.tolist(), rewards.tolist(), terminated, truncated, counts))
        on_thread = on_thread or bool(infos.get("on_thread", np.zeros(1)).any())
    return results, on_thread


@pytest.mark.parametrize(
    ("mode", "is_async"),
    [
        (AutoresetMode.NEXT_STEP, False),
        (AutoresetMode.SAME_STEP, False),
        (AutoresetMode.NEXT_STEP, True),
    ],
    ids=["next-step", "same-step", "send-recv"],
)
def test_envs_on_threads_give_what_the_worker_s_loop_gives(mode, is_async):
    # Episodes of 2 to 5 steps: resets at different steps, on the threads too.
    fns = [functools.partial(WaitingEnv, 2 + i % 4, 0.001) for i in range(6)] + [CountingEnv] * 2
    with MultiEnv(fns, envs_per_worker=1, autoreset_mode=mode) as alone:
        expected, _ = run(alone, 14, is_async)
    with MultiEnv(fns, envs_per_worker=4, autoreset_mode=mode) as shared:
        got, on_thread = run(shared, 14, is_async)
    for one, other in zip(expected, got, strict=True):
        assert one[:2] == other[:2]
        assert one[4] == other[4]
        np.testing.assert_array_equal(one[2], other[2])
        np.testing.assert_array_equal(one[3], other[3])
    assert on_thread  # the threads did step them


@pytest.mark.fault
def test_an_env_that_raises_on_its_thread_is_named_and_its_siblings_step_once():
    fns = [functools.partial(WaitingEnv, 1000, 0.005)] * 3
    fns[1] = functools.partial(WaitingEnv, 1000, 0.005, fail_at=FIRST_TIMED + 3)
    with MultiEnv(fns, envs_per_worker=3) as envs:
        envs.reset(seed=0)
        actions = np.ones(3, dtype=np.int64)
        step_until_on_thread(envs, actions, FIRST_TIMED + 2, 1)
        pid = envs.envs[0].pid
        with pytest.raises(EnvError, match=rf"env 1: {STEP_RAISED}: boom") as caught:
            envs.step(actions)
        assert caught.value.env_index == 1
        obs, *_ = caught.value.results
        assert obs[:, 0].tolist() == [FIRST_TIMED + 3, FIRST_TIMED + 2, FIRST_TIMED + 3]
        assert envs.envs[0].pid == pid  # no worker died
        assert envs.get_attr("steps") == (FIRST_TIMED + 3,) * 3  # each stepped once a call


@pytest.mark.fault
def test_a_hang_on_a_thread_past_step_timeout_truncates_its_worker_s_envs_and_goes_on():
    fns = [functools.partial(WaitingEnv, 1000, 0.005)] * 4
    fns[2] = functools.partial(WaitingEnv, 1000, 0.005, hang_at=FIRST_TIMED + 3)
    with MultiEnv(fns, envs_per_worker=2, step_timeout=1.0, reset_timeout=1.0) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        step_until_on_thread(envs, actions, FIRST_TIMED + 2, 2)
        hung = envs.envs[2].pid
        began = time.monotonic()
        _, _, _, truncated, infos = envs.step(actions)
        assert time.monotonic() - began < 10.0
        assert truncated.tolist() == [False, False, True, True]
        assert infos["multienv"]["cause"][2] == "timeout"
        assert envs.envs[2].pid != hung
        obs, *_ = envs.step(actions)  # the respawned worker resets them (next-step)
        assert obs[:, 0].tolist() == [FIRST_TIMED + 4, FIRST_TIMED + 4, 0.0, 0.0]


@pytest.mark.fault
def test_a_worker_killed_while_its_threads_step_truncates_its_envs():
    fns = [functools.partial(WaitingEnv, 1000, 0.3)] * 2 + [CountingEnv] * 2
    with MultiEnv(fns, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        step_until_on_thread(envs, actions, FIRST_TIMED + 1, 0)
        victim = envs.envs[0].pid
        envs.send(actions)
        time.sleep(0.1)  # both threads are asleep in their steps
        os.kill(victim, signal.SIGKILL)
        wait_until_dead([victim])
        _, _, _, truncated, infos = envs.recv()
        assert truncated.tolist() == [True, True, False, False]
        assert infos["multienv"]["cause"][0] == "SIGKILL"


class _Env:
    """Sleeps 2 ms a step, or spins 3 ms of CPU once ``busy``; notes the threads it ran on."""

    def __init__(self) -> None:
        self.busy = False
        self.threads: list[str] = []

    def step(self, action: int) -> str:
        self.threads.append(threading.current_thread().name)
        if self.busy:
            end = time.thread_time() + 0.003
            while time.thread_time() < end:
                pass
        else:
            time.sleep(0.002)
        return "stepped"

    def reset(self) -> str:
        return "reset"


class _Computes(_Env):
    def step(self, action: int) -> str:
        self.threads.append(threading.current_thread().name)
        return "stepped"


def _step(chosen: WaitingEnvs, envs: list[_Env]) -> list[str]:
    """One planned step's calls, as ``PlannedStep.run`` makes them."""
    call = chosen.begin(envs, [0] * len(envs), [False] * len(envs))
    if call is None:
        return [env.step(0) for env in envs]
    return [call(position, env.step, 0) for position, env in enumerate(envs)]


def test_an_env_goes_to_its_thread_after_timings_in_a_row_and_back_when_it_computes():
    envs = [_Env(), _Computes()]
    chosen = WaitingEnvs(2)
    for _ in range(CONFIRM - 1):
        _step(chosen, envs)
    assert chosen.waits == []  # one timing is not enough
    _step(chosen, envs)
    assert chosen.waits == [0]
    for _ in range(FIRST_TIMED - CONFIRM):  # the first steps are timed in the loop
        _step(chosen, envs)
    assert envs[0].threads == ["MainThread"] * (FIRST_TIMED)
    assert _step(chosen, envs) == ["stepped", "stepped"]
    assert envs[0].threads[-1].startswith(ON_THREAD)
    assert envs[1].threads == ["MainThread"] * (FIRST_TIMED + 1)
    envs[0].busy = True  # it computes now: timed in the loop in its turns, it comes back
    for _ in range(CONFIRM * SAMPLE_EVERY - FIRST_TIMED - 1):
        _step(chosen, envs)
    assert chosen.waits == []
    _step(chosen, envs)
    assert envs[0].threads[-1] == "MainThread"


@pytest.mark.timeout(60)
def test_a_computing_env_on_a_busy_machine_stays_in_the_loop(busy_cores):
    # Preempted, a step of 3 ms of CPU takes several times that in wall time, as a step
    # that waits would; but its thread never blocks (voluntary switches), so it stays.
    envs = [_Env(), _Env()]
    for env in envs:
        env.busy = True
    chosen = WaitingEnvs(2)
    slow = 0
    for _ in range(FIRST_TIMED + CONFIRM * SAMPLE_EVERY):
        began, cpu = time.perf_counter(), time.thread_time()
        _step(chosen, envs)
        slow += time.thread_time() - cpu < WAITING_SHARE * (time.perf_counter() - began)
        assert chosen.waits == []
    assert slow > CONFIRM, "the spinners did not slow the steps: the test proves nothing"
    assert set(envs[0].threads) == {"MainThread"}


def test_a_slow_step_that_did_not_block_does_not_count_as_waiting():
    chosen = WaitingEnvs(1)
    for _ in range(3 * CONFIRM):
        chosen._note(0, wall=10e-3, cpu=1e-3, blocked=False)
    assert chosen.waits == []
    for _ in range(CONFIRM):
        chosen._note(0, wall=10e-3, cpu=1e-3, blocked=True)
    assert chosen.waits == [0]


def test_the_worker_and_the_layout_agree_on_what_waits():
    assert waiting.WAITING_SHARE == WAITING_SHARE
    assert waiting.MIN_WAIT_S == MIN_WAIT_S
