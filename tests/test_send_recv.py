"""send_recv: InFlight against fakes, and send/recv over real workers (the deadline former)."""

import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv import EnvStateError, MultiEnv
from multienv.errors import WaitTimeoutError
from multienv.vector.assembly import Assembly
from multienv.vector.fan_out import group_by_worker
from multienv.vector.send_recv import InFlight
from multienv.wire.autoreset import Autoreset
from multienv.wire.protocol import BatchResult, StepPlan
from tests.envs import CountingEnv

OBS = gym.spaces.Box(-100.0, 100.0, (1,), np.float32)


class Worker:
    """A supervisor whose batch's result is its actions, as rewards and observations."""

    def __init__(self, num_envs):
        self.num_envs = num_envs
        self.sent = []
        self.deadline = None
        self.handle = self

    def submit(self, batch):
        self.sent.append(batch)

    def finish(self):
        actions = np.asarray(self.sent[-1].actions, dtype=np.float64)
        n = len(actions)
        obs = [np.array([a], np.float32) for a in actions]
        return BatchResult(actions, np.zeros(n, bool), np.zeros(n, bool), obs, {}), {}


class FanOut:
    """The workers, and a multi-wait that says which of them are ready."""

    def __init__(self, workers, positions):
        self.groups = group_by_worker(workers, positions)
        self.ready: list[int] = []  # worker numbers, in the order they finish

    def wait_any(self, numbers, timeout):
        return [numbers.index(n) for n in self.ready if n in numbers][:1]


class Parts:
    """A parts plane that takes whole workers when told to, and hands them over."""

    def __init__(self, takes):
        self.takes = takes
        self.sent = 0
        self.busy: list[int] = []

    def is_busy(self):
        return bool(self.busy)

    def num_busy(self):
        return len(self.busy)

    def env_ids(self):
        return sorted(self.busy)

    def send(self, actions, env_ids):
        if not self.takes:
            return False
        self.sent += 1
        self.busy += list(env_ids)
        return True

    def hand_over(self):
        self.busy = []
        return {}


def in_flight_of(workers, positions):
    fan_out = FanOut(workers, positions)
    num_envs = len(positions)
    autoreset = Autoreset(AutoresetMode.NEXT_STEP, num_envs)
    autoreset.after_reset(list(range(num_envs)))
    assembly = Assembly(OBS, num_envs, object(), autoreset, True, lambda i: (None, None, {}))
    return InFlight(fan_out, assembly, autoreset), fan_out


def test_send_submits_each_workers_share_as_one_batch():
    a, b = Worker(2), Worker(2)
    in_flight, _ = in_flight_of([a, a, b, b], [0, 1, 0, 1])
    in_flight.send([3, 0, 1], np.array([30, 0, 10]))
    assert [list(batch.positions) for batch in a.sent] == [[0, 1]]
    assert np.asarray(a.sent[0].actions).tolist() == [0, 10]
    assert [list(batch.positions) for batch in b.sent] == [[1]]
    assert in_flight.env_ids() == [0, 1, 3]
    assert in_flight.is_busy()
    with pytest.raises(EnvStateError, match=r"env 2: its worker is stepping envs \[3\]"):
        in_flight.send([2], np.array([20]))


def test_recv_returns_the_first_workers_to_finish_and_keeps_the_rest():
    a, b = Worker(2), Worker(2)
    in_flight, fan_out = in_flight_of([a, a, b, b], [0, 1, 0, 1])
    in_flight.send([0, 1, 2, 3], np.array([0, 10, 20, 30]))
    fan_out.ready = [1, 0]  # b finishes first
    obs, rewards, _, _, infos = in_flight.recv(1, None)
    assert infos["env_id"].tolist() == [2]
    assert rewards.tolist() == [20.0]
    assert obs[:, 0].tolist() == [20.0]
    assert in_flight.env_ids() == [0, 1, 3]  # env 3 is kept, collected, for the next recv
    *_, infos = in_flight.recv(None, None)
    assert infos["env_id"].tolist() == [0, 1, 3]
    assert not in_flight.is_busy()


def test_recv_checks_its_batch_size_and_that_anything_is_in_flight():
    in_flight, _ = in_flight_of([Worker(1)], [0])
    with pytest.raises(EnvStateError, match="no env in flight"):
        in_flight.recv(None, None)
    in_flight.send([0], np.array([1]))
    with pytest.raises(ValueError, match="recv\\(batch_size=2\\) with 1 envs in flight"):
        in_flight.recv(2, None)


def test_a_recv_timeout_loses_nothing():
    in_flight, fan_out = in_flight_of([Worker(1), Worker(1)], [0, 0])
    in_flight.send([0, 1], np.array([5, 6]))
    with pytest.raises(WaitTimeoutError, match="0 of the 2 envs ready"):
        in_flight.recv(None, 0.01)
    assert in_flight.env_ids() == [0, 1]
    fan_out.ready = [0, 1]
    *_, infos = in_flight.recv(None, None)
    assert infos["env_id"].tolist() == [0, 1]


def test_whole_workers_go_to_the_parts_plane_first():
    in_flight, _ = in_flight_of([Worker(1), Worker(1)], [0, 0])
    parts = in_flight.parts = Parts(takes=True)
    assert in_flight.send_parts(np.array([1, 2]), [0, 1])
    assert parts.sent == 1
    assert in_flight.env_ids() == [0, 1]  # the parts plane's envs count as in flight
    assert in_flight.is_busy()


def test_what_the_parts_plane_declines_goes_the_general_way_with_what_it_had():
    a, b = Worker(1), Worker(1)
    in_flight, _ = in_flight_of([a, b], [0, 0])
    parts = in_flight.parts = Parts(takes=False)
    handed = StepPlan(np.array([7, 0]), np.zeros(2, bool), False)
    parts.hand_over = lambda: {0: handed}  # env 0's worker was in flight there
    assert not in_flight.send_parts(np.array([2]), [1])
    assert in_flight.env_ids() == [0]  # now the general path's, as a planned part
    with pytest.raises(EnvStateError, match="env 0: its worker is stepping envs \\[0\\]"):
        in_flight.send([0], np.array([1]))
    in_flight.send([1], np.array([2]))
    assert in_flight.env_ids() == [0, 1]


@pytest.mark.parametrize("k", [1, 4])
def test_step_reset_and_call_refuse_while_envs_are_in_flight_and_the_advice_works(k):
    """send() then step() before recv(): refused (the data plane once stepped anyway);
    recv() until none is left, as the refusal says, returns every env in flight."""
    with MultiEnv([CountingEnv] * 8, envs_per_worker=k) as envs:
        envs.reset(seed=0)
        actions = np.zeros(8, dtype=np.int64)
        envs.send(actions)
        for name, call in [
            ("step", lambda: envs.step(actions)),
            ("reset", envs.reset),
            ("call", lambda: envs.call("add", 1)),
        ]:
            with pytest.raises(EnvStateError, match=f"{name}\\(\\) called while envs .* in flight"):
                call()
        for _ in range(4):  # the EnvPool loop, then the refusal's advice
            infos = envs.recv(batch_size=4, timeout=10)[4]
            envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
        with pytest.raises(EnvStateError, match="call recv\\(\\) until none is left"):
            envs.step(actions)
        returned = []
        while len(returned) < 8:
            returned += envs.recv(timeout=10)[4]["env_id"].tolist()
        with pytest.raises(EnvStateError, match="no env in flight"):
            envs.recv(timeout=10)
        assert sorted(returned) == list(range(8))
        assert envs.step(actions)[0].shape == (8, 1)


def _slow_last(k):
    """Four envs; the last worker's steps take 0.8 s (IncarnationEnv: obs[1] counts steps)."""
    from tests.envs import IncarnationEnv

    slow = functools.partial(IncarnationEnv, step_sleep_s=0.8)
    return MultiEnv([IncarnationEnv] * (4 - k) + [slow] * k, envs_per_worker=k)


@pytest.mark.parametrize("k", [1, 2])
def test_recv_at_its_deadline_returns_what_is_done_from_min_batch(k):
    with _slow_last(k) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        began = time.monotonic()
        obs, rewards, *_, infos = envs.recv(batch_size=4, timeout=0.3, min_batch=2)
        assert time.monotonic() - began < 0.7
        fast = list(range(4 - k))
        assert infos["env_id"].tolist() == fast
        assert obs[:, 1].tolist() == [1.0] * len(fast)  # each stepped once
        assert rewards.tolist() == [1.0] * len(fast)
        obs, *_, infos = envs.recv(timeout=10)  # the stragglers, still in flight
        assert infos["env_id"].tolist() == list(range(4 - k, 4))
        assert obs[:, 1].tolist() == [1.0] * k


def test_recv_below_min_batch_at_its_deadline_raises_and_loses_nothing():
    with _slow_last(1) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        with pytest.raises(WaitTimeoutError):
            envs.recv(batch_size=4, timeout=0.3, min_batch=4)
        with pytest.raises(WaitTimeoutError):
            envs.recv(batch_size=4, timeout=0.3)  # min_batch=None: batch_size
        obs, *_, infos = envs.recv(timeout=10)
        assert infos["env_id"].tolist() == [0, 1, 2, 3]
        assert obs[:, 1].tolist() == [1.0] * 4  # none lost, none stepped twice


@pytest.mark.parametrize("min_batch", [0, 5, 2.0, True, "2"])
def test_a_min_batch_out_of_range_or_not_an_int_is_a_value_error_naming_it(min_batch):
    with MultiEnv([CountingEnv] * 4) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        with pytest.raises(ValueError, match="min_batch"):
            envs.recv(batch_size=4, timeout=1, min_batch=min_batch)
        assert envs.recv(timeout=10)[4]["env_id"].tolist() == [0, 1, 2, 3]  # nothing taken


@pytest.mark.parametrize("k", [1, 2])
def test_a_worker_killed_in_flight_comes_back_flagged_through_a_deadline_recv(k):
    with _slow_last(k) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        os.kill(envs.envs[3].pid, signal.SIGKILL)
        returned, truncated = [], []
        while len(returned) < 4:
            try:
                _, _, _, trunc, infos = envs.recv(batch_size=4, timeout=0.5, min_batch=1)
            except WaitTimeoutError:
                continue
            returned += infos["env_id"].tolist()
            truncated += infos["env_id"][trunc].tolist()
            if "multienv" in infos:
                assert infos["multienv"]["_restarted"][trunc].all()
        assert sorted(returned) == [0, 1, 2, 3]
        assert 3 in truncated


def _three_fast_one_slow(slow_s, k=1):
    """Four envs; the last one's steps take ``slow_s`` (IncarnationEnv: obs[1] counts steps)."""
    from tests.envs import IncarnationEnv

    fast = functools.partial(IncarnationEnv, episode_length=10**9)
    slow = functools.partial(IncarnationEnv, step_sleep_s=slow_s)
    return MultiEnv([fast] * 3 + [slow], envs_per_worker=k)


def _loop(envs, seconds, **recv):
    """Keep every env in flight for ``seconds``; returns the steps returned, by env."""
    counts = np.zeros(envs.num_envs, dtype=np.int64)
    envs.send(np.zeros(envs.num_envs, dtype=np.int64))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            obs, *_, infos = envs.recv(**recv)
        except WaitTimeoutError:
            continue  # none done by the deadline (a busy machine): every step still in flight
        ids = infos["env_id"]
        assert ids.tolist() == sorted(set(ids.tolist()))
        counts[ids] += 1
        assert obs[:, 1].tolist() == counts[ids].tolist()  # each step once, none lost
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)
    obs, *_, infos = envs.recv(timeout=10)
    counts[infos["env_id"]] += 1
    assert obs[:, 1].tolist() == counts[infos["env_id"]].tolist()
    return counts


def test_take_ready_returns_the_fast_envs_without_holding_them_for_a_slow_one():
    with _three_fast_one_slow(0.05) as envs:
        envs.reset(seed=0)
        counts = _loop(envs, 1.0, batch_size=4, timeout=0.01, min_batch=1, take="ready")
        # A full batch with its deadline returns the fast envs once per 10 ms deadline,
        # about 5 times as often as the slow one's 50 ms; ready ones come back at once.
        assert counts[:3].min() >= 20 * counts[3], counts.tolist()


@pytest.mark.parametrize("k", [1, 2])
def test_take_ready_returns_at_once_what_is_done_and_keeps_the_rest(k):
    with _slow_last(k) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        began = time.monotonic()
        *_, infos = envs.recv(take="ready", timeout=10)  # min_batch: 1
        assert time.monotonic() - began < 0.6
        assert set(infos["env_id"].tolist()) <= set(range(4 - k))
        returned = infos["env_id"].tolist()
        while len(returned) < 4 - k:  # the fast ones, then only the slow worker is left
            returned += envs.recv(take="ready", timeout=0.5)[4]["env_id"].tolist()
        with pytest.raises(WaitTimeoutError, match="0 of the 1 envs ready"):
            envs.recv(take="ready", timeout=0.1)
        assert sorted(returned) == list(range(4 - k))
        *_, infos = envs.recv(batch_size=4, take="ready", min_batch=k, timeout=10)
        assert infos["env_id"].tolist() == list(range(4 - k, 4))


@pytest.mark.parametrize("k", [1, 2])
def test_a_batch_size_above_the_envs_in_flight_takes_a_min_batch_they_can_meet(k):
    with MultiEnv([CountingEnv] * 4, envs_per_worker=k) as envs:
        envs.reset(seed=0)
        kept = 4 - k  # a loop that holds one worker's envs out of flight
        envs.send(np.zeros(kept, dtype=np.int64), np.arange(kept))
        with pytest.raises(ValueError, match="or a min_batch the envs in flight can meet"):
            envs.recv(batch_size=4)
        with pytest.raises(ValueError, match=f"min_batch=4\\) with {kept} envs in flight"):
            envs.recv(batch_size=4, min_batch=4)
        returned = 0
        for _ in range(20):
            *_, infos = envs.recv(batch_size=4, min_batch=1, timeout=10)
            ids = infos["env_id"]
            assert 1 <= len(ids) <= kept
            assert ids.max() < kept
            returned += len(ids)
            envs.send(np.zeros(len(ids), dtype=np.int64), ids)
        assert envs.recv(batch_size=4, min_batch=kept)[4]["env_id"].tolist() == list(range(kept))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"take": "all"}, "take='all'"),
        ({"batch_size": "auto", "take": "ready"}, "picks a full batch"),
        ({"batch_size": "two"}, "batch_size='two'"),
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_recv_names_a_wrong_take_or_batch_size_and_takes_nothing(kwargs, match):
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(2, dtype=np.int64))
        with pytest.raises(ValueError, match=match):
            envs.recv(**kwargs)
        assert envs.recv(timeout=10)[4]["env_id"].tolist() == [0, 1]


@pytest.mark.parametrize("k", [1, 2])
def test_a_picked_batch_returns_every_step_once_and_says_what_it_picked(k):
    with MultiEnv([_endless()] * 8, envs_per_worker=k) as envs:
        envs.reset(seed=0)
        assert envs.auto_batch is None
        counts = _loop(envs, 1.5, batch_size="auto")
        assert counts.min() > 10
        picked = envs.auto_batch
        assert picked is not None
        assert picked.in_flight == 8
        assert picked.batch_size in (8, 8 // 2 // k * k or k)
        assert "envs in flight" in str(picked)


def test_a_picked_batch_takes_whole_batches_when_the_policy_dominates():
    with MultiEnv([CountingEnv] * 4) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        end = time.monotonic() + 2.0
        while time.monotonic() < end and (
            envs.auto_batch is None or "ran" not in str(envs.auto_batch)
        ):
            *_, infos = envs.recv(batch_size="auto")
            time.sleep(0.01)  # a policy of 10 ms against envs of microseconds: 2x per call
            envs.send(np.zeros(len(infos["env_id"]), dtype=np.int64), infos["env_id"])
        envs.recv()
        assert envs.auto_batch.batch_size == 4, str(envs.auto_batch)
        assert envs.auto_batch.whole_rate > 1.5 * envs.auto_batch.half_rate


def _endless():
    """IncarnationEnv whose episodes do not end: obs[1] counts every step of the env."""
    from tests.envs import IncarnationEnv

    return functools.partial(IncarnationEnv, episode_length=10**9)


def _whole_batches(envs, policy_s=0.01):
    """An auto loop whose policy dominates: the picker settles on whole batches."""
    envs.reset(seed=0)
    envs.send(np.zeros(envs.num_envs, dtype=np.int64))
    end = time.monotonic() + 20
    while envs.auto_batch is None or "ran" not in str(envs.auto_batch):
        assert time.monotonic() < end, str(envs.auto_batch)
        *_, infos = envs.recv(batch_size="auto")
        time.sleep(policy_s)
        envs.send(np.zeros(len(infos["env_id"]), dtype=np.int64), infos["env_id"])
    assert envs.auto_batch.batch_size == envs.num_envs


@pytest.mark.parametrize("k", [1, 2])
def test_whole_picked_batches_step_on_the_data_plane_once_per_send(k):
    with MultiEnv([_endless()] * 4, envs_per_worker=k) as envs:
        _whole_batches(envs)
        parts = envs._data_plane.parts
        sent = parts.sent
        *_, infos = envs.recv(batch_size="auto")
        counts = None
        for _ in range(20):
            ids = infos["env_id"]
            assert ids.tolist() == [0, 1, 2, 3]
            envs.send(np.zeros(4, dtype=np.int64), ids)
            assert envs._in_flight._stepping  # on the data plane
            with pytest.raises(EnvStateError, match="in flight"):
                envs.reset()
            time.sleep(0.01)  # the policy's time, as it was: the choice holds
            obs, *_, infos = envs.recv(batch_size="auto")
            if counts is not None:
                assert (obs[:, 1] == counts + 1).all()  # each env stepped once a call
            counts = obs[:, 1].copy()
        assert parts.sent == sent  # none went by the parts plane
        envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])


@pytest.mark.parametrize("k", [1, 2])
def test_a_worker_killed_in_a_whole_picked_batch_comes_back_flagged(k):
    from tests.envs import IncarnationEnv

    # Whole batches: 4 steps per 0.15 s; half ones (whole workers): 2 per 0.1 s.
    slow = functools.partial(IncarnationEnv, episode_length=10**9, step_sleep_s=0.05)
    with MultiEnv([_endless()] * 3 + [slow], envs_per_worker=k) as envs:
        _whole_batches(envs, policy_s=0.1)
        *_, infos = envs.recv(batch_size="auto")
        time.sleep(0.1)
        envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
        assert envs._in_flight._stepping  # on the data plane
        time.sleep(0.02)  # the slow env is in its step
        os.kill(envs.envs[3].pid, signal.SIGKILL)
        _, _, _, truncated, infos = envs.recv(batch_size="auto")
        assert infos["env_id"].tolist() == [0, 1, 2, 3]
        assert truncated.tolist() == [False] * (4 - k) + [True] * k
        assert infos["multienv"]["cause"][3] == "SIGKILL"


def test_other_recvs_of_a_whole_picked_batch_and_close_take_it_the_general_way():
    with MultiEnv([_endless()] * 4, envs_per_worker=2) as envs:
        _whole_batches(envs)
        *_, infos = envs.recv(batch_size="auto")
        envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
        first = envs.recv(batch_size=2)[4]["env_id"].tolist()  # one worker's envs
        rest = envs.recv()[4]["env_id"].tolist()
        assert sorted(first + rest) == [0, 1, 2, 3]
        assert first in ([0, 1], [2, 3])
        envs.send(np.zeros(4, dtype=np.int64))
        *_, infos = envs.recv(batch_size="auto")
        envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
    # closed with a whole step in flight: nothing left behind (the session checks workers)
