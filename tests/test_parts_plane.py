"""The parts plane: send()/recv() of whole workers in one pass, and what it hands over
(``parts_plane`` and ``parts_hand_over``)."""

import functools
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from multienv import EnvError, EnvStateError, MultiEnv
from multienv.supervision.supervisor import WorkerSupervisor
from tests.envs import (
    CountingEnv,
    DictObsEnv,
    FixedLengthEnv,
    HangOnStep,
    KilledAfterItsDoneRecord,
    RaiseOnStep,
    SleepyEnv,
)

pytestmark = pytest.mark.timeout(120)

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def sent_on_parts(envs: MultiEnv) -> int:
    """How many batches the vector's parts plane sent."""
    parts = envs._in_flight.parts
    assert parts is not None
    return parts.sent


def send_warm(envs: MultiEnv, actions: np.ndarray) -> None:
    """Two rounds of send/recv of every env (the first answer brings the info's keys), then
    a send of every env that must go on the parts plane."""
    for _ in range(2):
        envs.send(actions)
        envs.recv()
    before = sent_on_parts(envs)
    envs.send(actions)
    assert sent_on_parts(envs) == before + 1


def check_batch(batch, loops, pending, mode) -> list[int]:
    """Check each env of a recv'd batch against its own Gymnasium loop stepped with the
    action it was sent (taken off ``pending``); its env ids."""
    obs, rewards, terminations, truncations, infos = batch
    ids = infos["env_id"].tolist()
    assert ids == sorted(ids)
    for row, env_index in enumerate(ids):
        action = pending.pop(env_index)
        want = loops[env_index].step(np.asarray([action]))
        row_obs = {k: v[row] for k, v in obs.items()} if isinstance(obs, dict) else obs[row]
        got = (row_obs, rewards[row], terminations[row], truncations[row])
        if isinstance(want[0], dict):
            for key in want[0]:
                assert np.allclose(got[0][key], want[0][key][0]), (env_index, key)
        else:
            assert np.allclose(got[0], want[0][0]), env_index
        assert got[1:] == (want[1][0], want[2][0], want[3][0]), env_index
        for key in ("count", "t"):
            if f"_{key}" in want[4] and want[4][f"_{key}"][0]:
                assert infos[key][row] == want[4][key][0], (env_index, key)
        if mode is AutoresetMode.SAME_STEP and want[4].get("_final_obs", [False])[0]:
            assert infos["_final_obs"][row], env_index
            final, want_final = infos["final_obs"][row], want[4]["final_obs"][0]
            for key in want_final if isinstance(want_final, dict) else [None]:
                got_part = final if key is None else final[key]
                want_part = want_final if key is None else want_final[key]
                assert np.allclose(got_part, want_part), (env_index, key)
            if "_count" in want[4]["final_info"]:  # (CountingEnv's)
                assert infos["final_info"]["count"][row] == want[4]["final_info"]["count"][0]
    return ids


def replay(fns, k, mode, rounds, seed, whole_only):
    """Drive send/recv with random batch sizes and subsets; check each env against its own
    Gymnasium loop. Returns the batches sent on the parts plane and the sends."""
    n = len(fns)
    loops = [SyncVectorEnv([fn], autoreset_mode=mode) for fn in fns]
    for i, loop in enumerate(loops):
        loop.reset(seed=i)
    rng = np.random.default_rng(seed)
    sends = 0
    with MultiEnv(fns, envs_per_worker=k, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        space = envs.single_action_space
        pending: dict[int, object] = {}
        idle = list(range(n))
        for _ in range(rounds):
            busy = {env_index // k for env_index in pending}  # a worker steps one batch
            free = [env_index for env_index in idle if env_index // k not in busy]
            if free:
                if whole_only:
                    ids = np.array(free)
                else:
                    ids = rng.permutation(free)[: rng.integers(1, len(free) + 1)]
                actions = np.stack([space.sample() for _ in ids])
                envs.send(actions, ids)
                sends += 1
                pending.update(zip(ids.tolist(), actions, strict=True))
                idle = [i for i in idle if i not in set(ids.tolist())]
            if not pending:
                continue
            size = k * max(1, len(pending) // (2 * k)) if whole_only else None
            if size is None:
                size = int(rng.integers(1, len(pending) + 1))
            ids = check_batch(envs.recv(batch_size=size), loops, pending, mode)
            assert len(ids) == size
            idle += ids
        if pending:
            envs.recv()
        carried = sent_on_parts(envs)
        counts = envs.stats()
    for loop in loops:
        loop.close()
    return carried, sends, counts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [functools.partial(gym.make, "CartPole-v1"), CountingEnv])
def test_whole_workers_go_on_the_parts_plane_and_step_as_gymnasium_does(fn, mode):
    carried, sends, _ = replay([fn] * 6, 2, mode, 120, seed=1, whole_only=True)
    # Only the first sends, whose infos bring new keys, go back to the control plane.
    assert carried >= sends - 3


@pytest.mark.parametrize("mode", MODES)
def test_any_subset_and_batch_size_mixes_both_planes_and_loses_nothing(mode):
    fns = [CountingEnv] * 6
    carried, sends, _ = replay(fns, 2, mode, 150, seed=2, whole_only=False)
    assert 0 < carried < sends  # whole workers went one way, split ones the other


def resent_on_parts(envs: MultiEnv) -> int:
    """How many of those sent the envs the last recv() returned, the short way."""
    parts = envs._in_flight.parts
    assert parts is not None
    return parts.resent


@pytest.mark.parametrize("k", [2, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [functools.partial(gym.make, "CartPole-v1"), CountingEnv])
def test_the_envpool_loop_sends_back_what_recv_returned_and_steps_as_gymnasium_does(fn, mode, k):
    """recv(batch_size) then send(actions, infos["env_id"]), as EnvPool's users write it:
    the ids as returned, a copy, or a list; one to four workers per batch."""
    fns = [fn] * 6
    loops = [SyncVectorEnv([f], autoreset_mode=mode) for f in fns]
    for i, loop in enumerate(loops):
        loop.reset(seed=i)
    with MultiEnv(fns, envs_per_worker=k, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        space = envs.single_action_space
        space.seed(5)
        actions = np.stack([space.sample() for _ in fns])
        envs.send(actions)
        pending = dict(enumerate(actions))
        for cycle in range(90):
            ids = check_batch(envs.recv(batch_size=2 + 2 * (cycle % 2)), loops, pending, mode)
            actions = np.stack([space.sample() for _ in ids])
            sent = [np.asarray(ids), np.array(ids, dtype=np.int64), ids][cycle % 3]
            envs.send(actions, sent)
            pending.update(zip(ids, actions, strict=True))
        check_batch(envs.recv(), loops, pending, mode)
        assert not pending
        # The arrays went the short way but for the first sends, whose infos bring new
        # keys; the lists went the long way.
        assert 60 - 4 <= resent_on_parts(envs) <= 60
        if fn is CountingEnv:  # five steps an episode; next-step resets are not steps
            for index, stats in enumerate(envs.stats()):
                assert stats["steps"] > 10
                assert stats["episodes"] == stats["steps"] // 5, index
    for loop in loops:
        loop.close()


def test_the_envpool_loop_takes_the_long_way_for_other_envs_or_a_changed_id_array():
    with MultiEnv([CountingEnv] * 6, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(6, dtype=np.int64)
        send_warm(envs, ones)  # every env at count 3 when collected
        resent = resent_on_parts(envs)
        first = envs.recv(batch_size=2)[4]["env_id"]
        second = envs.recv(batch_size=2)[4]["env_id"]  # the first batch is no longer last
        envs.send(ones[:2], first)
        assert resent_on_parts(envs) == resent
        third = 2 * ({0, 1, 2} - {int(first[0]) // 2, int(second[0]) // 2}).pop()
        second[:] = [third, third + 1]  # changed in place after recv: envs still in flight
        with pytest.raises(EnvStateError, match=f"env {third}: already in flight"):
            envs.send(ones[:2], second)
        obs, _, _, _, infos = envs.recv()
        assert infos["env_id"].tolist() == sorted([*first.tolist(), third, third + 1])
        counts = dict(zip(infos["env_id"].tolist(), obs[:, 0].tolist(), strict=True))
        assert [counts[i] for i in first.tolist()] == [4.0, 4.0]
        assert [counts[i] for i in (third, third + 1)] == [3.0, 3.0]
        assert resent_on_parts(envs) == resent


def test_a_worker_killed_between_recv_and_its_send_back_comes_back_truncated():
    with MultiEnv([CountingEnv] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        ids = envs.recv(batch_size=2)[4]["env_id"]
        os.kill(envs.envs[int(ids[0])].pid, signal.SIGKILL)
        resent = resent_on_parts(envs)
        envs.send(ones[:2], ids)  # wakes the dead worker: its sentinel ends the wait
        assert resent_on_parts(envs) == resent + 1
        obs, rewards, _, truncations, infos = envs.recv(timeout=30)
        assert infos["env_id"].tolist() == [0, 1, 2, 3]
        killed = np.isin(np.arange(4), ids)
        assert truncations.tolist() == killed.tolist()
        assert infos["multienv"]["cause"][killed].tolist() == ["SIGKILL", "SIGKILL"]
        assert rewards.tolist() == (~killed).astype(float).tolist()
        assert obs[~killed, 0].tolist() == [3.0, 3.0]


def test_a_worker_hung_after_the_envpool_loops_send_back_is_killed_at_its_deadline():
    fns = [CountingEnv] * 2 + [functools.partial(HangOnStep, at_count=5)] * 2
    with MultiEnv(fns, envs_per_worker=2, step_timeout=0.5) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)  # every env at count 3 when collected
        time.sleep(1.5)  # past the deadlines of that send: a short send must set its own
        resent = resent_on_parts(envs)
        started = time.monotonic()
        # The hung worker's step to count 5 is sent back the short way; the healthy worker
        # goes round meanwhile.
        while time.monotonic() - started < 20:
            _, rewards, _, truncations, infos = envs.recv(batch_size=2, timeout=30)
            ids = infos["env_id"].tolist()
            if truncations.any():
                break
            envs.send(ones[:2], infos["env_id"])
        assert ids == [2, 3]
        assert truncations.tolist() == [True, True]
        assert infos["multienv"]["cause"].tolist() == ["timeout", "timeout"]
        assert rewards.tolist() == [0.0, 0.0]
        # The healthy worker went round the short way while the other hung: no early
        # hand-over, as a deadline left from an earlier send would make.
        assert resent_on_parts(envs) - resent >= 10
        assert time.monotonic() - started < 20


def test_disabled_autoreset_refuses_an_ended_env_sent_back_by_the_envpool_loop():
    with MultiEnv(
        [CountingEnv] * 4, envs_per_worker=2, autoreset_mode=AutoresetMode.DISABLED
    ) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        envs.send(ones)
        for _ in range(9):  # CountingEnv's episodes end at count 5
            *_, terminations, _, infos = envs.recv(batch_size=2)
            ids = infos["env_id"]
            if terminations.any():
                break
            envs.send(ones[:2], ids)
        assert terminations.all()
        with pytest.raises(EnvStateError, match=f"env {ids[0]}"):
            envs.send(ones[:2], ids)
        envs.recv()  # the other worker, then nothing in flight
        envs.reset()
        envs.send(ones)
        assert envs.recv()[0][:, 0].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_nested_observations_go_on_the_parts_plane():
    carried, sends, _ = replay([DictObsEnv] * 4, 2, AutoresetMode.NEXT_STEP, 60, 3, True)
    assert carried >= sends - 3


def test_counts_follow_the_steps_and_episodes_of_the_parts_plane():
    _, _, counts = replay([CountingEnv] * 4, 1, AutoresetMode.NEXT_STEP, 60, 4, True)
    # Each env stepped as often as the loop (next-step resets are not steps).
    for stats in counts:
        assert stats["steps"] > 0
        assert stats["episodes"] == (stats["steps"]) // 5


def test_a_worker_killed_on_the_parts_plane_comes_back_as_a_flagged_truncation():
    with MultiEnv([functools.partial(SleepyEnv, 0.2)] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        obs, rewards, _, truncations, infos = envs.recv()
        assert truncations.tolist() == [True, True, False, False]
        assert rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert infos["multienv"]["cause"][0] == "SIGKILL"
        assert obs[:, 0].tolist() == [2.0, 2.0, 3.0, 3.0]
        envs.send(ones)  # healthy again: whole workers go on the parts plane
        assert envs.recv()[0][:, 0].tolist() == [0.0, 0.0, 4.0, 4.0]


def test_a_worker_hung_on_the_parts_plane_is_killed_at_its_deadline():
    fns = [CountingEnv] * 2 + [functools.partial(HangOnStep, at_count=3)] * 2
    with MultiEnv(fns, envs_per_worker=2, step_timeout=0.5) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        *_, infos = envs.recv(batch_size=2)
        assert infos["env_id"].tolist() == [0, 1]  # not held back by the hung worker
        _, rewards, _, truncations, infos = envs.recv(timeout=30)
        assert infos["env_id"].tolist() == [2, 3]
        assert rewards.tolist() == [0.0, 0.0]
        assert truncations.tolist() == [True, True]
        assert infos["multienv"]["cause"].tolist() == ["timeout", "timeout"]


def test_recv_timeout_on_the_parts_plane_loses_nothing():
    fns = [CountingEnv] * 2 + [functools.partial(HangOnStep, at_count=3, hang_s=1.0)] * 2
    with MultiEnv(fns, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        with pytest.raises(TimeoutError, match="2 of the 4 envs ready"):
            envs.recv(timeout=0.2)
        with pytest.raises(EnvStateError, match=r"envs \[0, 1, 2, 3\] are in flight"):
            envs.step(ones)
        obs, *_ = envs.recv(timeout=30)
        assert obs[:, 0].tolist() == [3.0, 3.0, 3.0, 3.0]
        envs.step(ones)  # idle again


def test_disabled_autoreset_refuses_an_ended_env_before_sending():
    with MultiEnv([CountingEnv] * 2, autoreset_mode=AutoresetMode.DISABLED) as envs:
        envs.reset(seed=0)
        ones = np.ones(2, dtype=np.int64)
        for _ in range(5):
            envs.send(ones)
            *_, terminations, _, _ = envs.recv()
        assert terminations.all()
        with pytest.raises(EnvStateError, match="env 0"):
            envs.send(ones)
        envs.reset()
        envs.send(ones)
        assert envs.recv()[0][:, 0].tolist() == [1.0, 1.0]


def test_close_with_workers_in_flight_on_the_parts_plane():
    envs = MultiEnv([CountingEnv] * 4, envs_per_worker=2)
    envs.reset(seed=0)
    envs.send(np.ones(4, dtype=np.int64))
    envs.recv(batch_size=2)
    envs.close()
    assert envs.closed


def test_an_env_error_on_the_parts_plane_is_raised_and_the_other_steps_are_kept():
    fns = [CountingEnv] * 2 + [functools.partial(RaiseOnStep, at_count=3)] * 2
    with MultiEnv(fns, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        with pytest.raises(EnvError, match="env 2: step\\(\\) raised ValueError"):
            envs.recv()
        with pytest.raises(EnvError, match="env 3: step\\(\\) raised ValueError"):
            envs.recv()  # every env that raised is named, each by one recv
        obs, rewards, *_, infos = envs.recv()  # the envs that stepped
        assert infos["env_id"].tolist() == [0, 1]
        assert rewards.tolist() == [1.0, 1.0]
        assert obs[:, 0].tolist() == [3.0, 3.0]
        envs.send(ones[:2], [2, 3])  # the envs that raised did not step; send them again
        obs, *_ = envs.recv()
        assert obs[:, 0].tolist() == [4.0, 4.0]


def test_after_a_death_an_envpool_loop_goes_back_to_the_parts_plane():
    with MultiEnv([functools.partial(SleepyEnv, 0.05)] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        truncated = []
        before = sent_on_parts(envs)
        for _ in range(6):  # recv half, send those back: never all received at once
            _, _, _, truncations, infos = envs.recv(batch_size=2)
            truncated += infos["env_id"][truncations].tolist()
            envs.send(ones[:2], infos["env_id"])
        assert truncated == [0, 1]
        assert sent_on_parts(envs) >= before + 5  # the first send after the death too
        envs.recv()


def test_a_same_step_reset_kept_on_the_parts_plane_is_returned_once_after_a_hand_over():
    # Envs 1 and 2 end every step; env 0 is slow. Both fast workers' replies (with their
    # final observations) are read by one recv, which returns the first and keeps the
    # other; a send the parts plane declines then hands the kept one over, done.
    fns = [functools.partial(SleepyEnv, slow_s=0.5)] + [
        functools.partial(CountingEnv, episode_length=1)
    ] * 2
    with MultiEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP) as envs:
        envs.reset(seed=0)
        envs.send(np.ones(3, dtype=np.int64))
        time.sleep(0.2)  # the fast workers' records are both in before recv reads
        *_, infos = envs.recv(batch_size=1)
        (first,) = infos["env_id"].tolist()
        assert first in (1, 2)
        kept = 3 - first
        with pytest.raises(ValueError, match="expected integer actions"):
            envs.send(np.ones(1), [first])  # declined by the parts plane: all handed over
        obs, _, terminations, _, infos = envs.recv()
        assert infos["env_id"].tolist() == [0, kept]
        assert terminations.tolist() == [False, True]
        assert obs[:, 0].tolist() == [1.0, 0.0]  # the kept env: its new episode's first
        assert infos["_final_obs"].tolist() == [False, True]
        assert infos["final_obs"][1].tolist() == [1.0]  # its last step's, not a crash's
        assert envs.stats()[kept]["episodes"] == 1


def test_a_worker_killed_between_its_record_and_its_reply_on_the_parts_plane(tmp_path):
    # The reply of the worker's DONE record never comes: its supervisor respawns it while
    # collecting it, and the step comes back as a flagged truncation, the other env's kept.
    fn = functools.partial(KilledAfterItsDoneRecord, str(tmp_path / "killed"), at_count=3)
    with MultiEnv([CountingEnv, fn]) as envs:
        envs.reset(seed=0)
        ones = np.ones(2, dtype=np.int64)
        send_warm(envs, ones)  # the third step: the worker of env 1 dies in it
        obs, rewards, _, truncations, infos = envs.recv()
        assert truncations.tolist() == [False, True]
        assert rewards.tolist() == [1.0, 0.0]
        assert infos["multienv"]["cause"][1] == "SIGKILL"
        assert obs[:, 0].tolist() == [3.0, 2.0]  # env 1 keeps the observation seen last
        before = sent_on_parts(envs)
        envs.send(ones)  # everything was collected: the next send takes the parts plane
        assert sent_on_parts(envs) == before + 1
        assert envs.recv()[0][:, 0].tolist() == [4.0, 0.0]  # next-step: env 1 resets


# ------------------------------------------------ a recv that waits for several workers


def fourth_step_with_worker_3_killed(envs: MultiEnv):
    """Reset, warm up, send every env's fourth step (worker 3 hangs in it) and receive it,
    with worker 3 SIGKILLed 0.6 s after the send; the batch."""
    envs.reset(seed=0)
    ones = np.ones(4, dtype=np.int64)
    send_warm(envs, ones)
    envs.recv()
    envs.send(ones)
    killer = threading.Timer(0.6, os.kill, (envs.envs[3].pid, signal.SIGKILL))
    killer.start()
    try:
        return envs.recv(timeout=30)
    finally:
        killer.join()


def test_workers_done_while_recv_waits_are_collected_when_another_dies():
    # Workers 0-2 finish while the parent waits for all four; worker 3 hangs and is
    # killed. The three steps come back as they ended, the killed one truncated.
    fns = [functools.partial(SleepyEnv, step_s=0.1)] * 3 + [
        functools.partial(HangOnStep, at_count=4)
    ]
    with MultiEnv(fns) as envs:
        obs, rewards, _, truncations, infos = fourth_step_with_worker_3_killed(envs)
        assert infos["env_id"].tolist() == [0, 1, 2, 3]
        assert truncations.tolist() == [False, False, False, True]
        assert infos["multienv"]["cause"][3] == "SIGKILL"
        ones = np.ones(4, dtype=np.int64)
        assert rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
        assert obs[:3, 0].tolist() == [4.0, 4.0, 4.0]
        envs.send(ones)  # healthy again: on the parts plane
        assert envs.recv(timeout=30)[0][:, 0].tolist() == [5.0, 5.0, 5.0, 0.0]  # reset


def test_same_step_episode_ends_keep_the_envpool_loop_off_the_supervisors(monkeypatch):
    # Every worker ends an episode at every step or two: the finals stay in shared memory,
    # so no supervisor reads a reply once the infos' schemas are known.
    finished = []
    finish = WorkerSupervisor.finish
    monkeypatch.setattr(WorkerSupervisor, "finish", lambda self: finished.append(1) or finish(self))
    fns = [functools.partial(FixedLengthEnv, n) for n in (1, 2, 1, 2)]
    with MultiEnv(fns, envs_per_worker=2, autoreset_mode=AutoresetMode.SAME_STEP) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        before = len(finished)
        ended = 0
        for _ in range(50):
            *_, terminations, truncations, infos = envs.recv(batch_size=2)
            ended += int(np.count_nonzero(terminations | truncations))
            assert infos["_final_obs"].tolist() == (terminations | truncations).tolist()
            envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
        envs.recv()
        assert ended > 50
        assert len(finished) == before


def test_same_step_finals_left_in_shared_memory_are_collected_when_another_worker_dies():
    # Workers 0-2 end an episode at every step and answer all in shared memory, finals too;
    # worker 3 hangs and is killed: the hand-over reads their finals from shared memory.
    fns = [functools.partial(FixedLengthEnv, 1)] * 3 + [functools.partial(HangOnStep, at_count=4)]
    with MultiEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP) as envs:
        obs, _, terminations, truncations, infos = fourth_step_with_worker_3_killed(envs)
        assert infos["env_id"].tolist() == [0, 1, 2, 3]
        assert terminations.tolist() == [True, True, True, False]
        assert truncations.tolist() == [False, False, False, True]
        assert infos["_final_obs"].tolist() == [True, True, True, True]
        assert [infos["final_obs"][i].tolist() for i in range(4)] == [[1.0]] * 3 + [[3.0]]
        assert infos["final_info"]["count"][:3].tolist() == [1, 1, 1]
        assert obs[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0]  # each reset at once


def test_workers_done_while_recv_waits_are_collected_when_another_is_late():
    fns = [functools.partial(SleepyEnv, step_s=0.1)] * 3 + [
        functools.partial(HangOnStep, at_count=4)
    ]
    with MultiEnv(fns, step_timeout=0.5) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        send_warm(envs, ones)
        envs.recv()
        envs.send(ones)
        started = time.monotonic()
        obs, rewards, _, truncations, infos = envs.recv(timeout=30)
        assert time.monotonic() - started < 10
        assert truncations.tolist() == [False, False, False, True]
        assert infos["multienv"]["cause"][3] == "timeout"
        assert rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
        assert obs[:3, 0].tolist() == [4.0, 4.0, 4.0]
        assert [stats["restarts"] for stats in envs.stats()] == [0, 0, 0, 1]


@pytest.mark.parametrize("cycles", [10, 100])  # fewer than the batches held back, and more
@pytest.mark.parametrize("mode", MODES)
def test_stats_count_every_step_the_envpool_loop_returned(mode, cycles):
    with MultiEnv([CountingEnv] * 4, autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        ones = np.ones(4, dtype=np.int64)
        steps, episodes, ended = [0] * 4, [0] * 4, [False] * 4
        envs.send(ones)

        def count(batch) -> np.ndarray:
            *_, terminations, truncations, infos = batch
            for env_index, end in zip(
                infos["env_id"].tolist(), (terminations | truncations).tolist(), strict=True
            ):
                # under next-step autoreset, the step after an end is the env's reset
                steps[env_index] += not (ended[env_index] and mode is AutoresetMode.NEXT_STEP)
                episodes[env_index] += end
                ended[env_index] = end
            return infos["env_id"]

        for _ in range(cycles):
            ids = count(envs.recv(batch_size=2))
            envs.send(ones[:2], ids)
        # Every step returned is counted; one in flight may be too, if a recv read its
        # worker's reply (a same-step reset's final observation) and kept it for later.
        for env_index, stats in enumerate(envs.stats()):
            assert 0 <= stats["steps"] - steps[env_index] <= 1, env_index
            assert 0 <= stats["episodes"] - episodes[env_index] <= 1, env_index
        count(envs.recv())
        assert resent_on_parts(envs) >= cycles - 3
        assert [(s["steps"], s["episodes"]) for s in envs.stats()] == list(
            zip(steps, episodes, strict=True)
        )
