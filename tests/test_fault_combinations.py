"""Faults that combine, or land in the loops around the step: the failure table still holds.

Each test reproduces one finding of the chaos harness (``tests/chaos``) with real workers,
killed, segfaulted or made to raise, and checks what the caller sees.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np
import pytest

from multienv import EnvError, MultiEnv, RestartPolicy
from tests.envs import IncarnationEnv

pytestmark = [pytest.mark.fault, pytest.mark.timeout(90)]

_BUDGET = RestartPolicy(max_restarts=1000, window_s=1)


def kill(pid: int | None) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
    except ProcessLookupError:
        pass


def restarted(infos, env_index: int) -> bool:
    flags = infos.get("multienv", {}).get("_restarted")
    return flags is not None and bool(flags[env_index])


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_a_respawned_worker_killed_before_the_next_step_returns_no_stale_result(mode):
    """A worker killed mid-step, then its respawn killed before the next step.

    The next step is a flagged truncation or the fresh env's reset, never the dead
    instance's old shared memory (its status once matched the round's seq).
    """
    fns = [functools.partial(IncarnationEnv, step_sleep_s=0.15 * i) for i in range(2)]
    with MultiEnv(fns, autoreset_mode=mode, step_timeout=5, restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        actions = np.zeros(2, np.int64)
        for _ in range(6):
            last = envs.step(actions)
            timer = threading.Timer(0.05, kill, (envs.envs[1].pid,))
            timer.start()
            first = envs.step(actions)
            timer.join()
            assert restarted(first[4], 1)
            assert first[3][1]
            assert not first[2][1]
            kill(envs.envs[1].pid)
            obs, rewards, terminated, truncated, infos = envs.step(actions)
            is_fresh = obs[1][0] == 0 and obs[1][1] == 0 and obs[1][2] != last[0][1][2]
            is_flagged = restarted(infos, 1) and truncated[1] and not terminated[1]
            assert is_flagged or (is_fresh and rewards[1] == 0 and not terminated[1]), (
                f"stale result: {obs[1].tolist()} reward {rewards[1]}, terminated "
                f"{terminated[1]}, after {last[0][1].tolist()}"
            )


@pytest.mark.parametrize("after_a_kill", [False, True])
def test_a_death_in_a_masked_reset_returns_the_replayed_reset(tmp_path, after_a_kill):
    """A worker that segfaults in a data-plane reset: the reset returns the fresh env's."""
    marker = str(tmp_path / "segfault-in-reset")
    open(marker, "w").close()  # disarmed
    fns = [
        functools.partial(IncarnationEnv, step_sleep_s=0.15, marker=marker),
        IncarnationEnv,
    ]
    mask = np.array([True, False])
    with MultiEnv(fns, step_timeout=5, reset_timeout=5, restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        actions = np.zeros(2, np.int64)
        for _ in range(4):
            before = envs.step(actions)[0][0].tolist()
            if after_a_kill:
                timer = threading.Timer(0.05, kill, (envs.envs[0].pid,))
                timer.start()
                before = envs.step(actions)[0][0].tolist()
                timer.join()
            os.unlink(marker)  # armed: the next reset of env 0 segfaults
            obs, _ = envs.reset(options={"reset_mask": mask})
            assert os.path.exists(marker)
            got = obs[0].tolist()
            assert got[:2] == [0, 0], f"{before} -> {got}"
            assert got[2] != before[2], f"{before} -> {got}"


@pytest.mark.parametrize("as_list", [False, True])  # data plane, general path
def test_step_wait_that_raises_an_env_error_leaves_nothing_pending(tmp_path, as_list):
    marker = str(tmp_path / "raise")
    open(marker, "w").close()
    fns = [functools.partial(IncarnationEnv, raise_marker=marker)] * 2
    with MultiEnv(fns) as envs:
        envs.reset(seed=0)
        actions = [0, 0] if as_list else np.zeros(2, np.int64)
        envs.step_async(actions)
        envs.step_wait(timeout=10)
        os.unlink(marker)  # one of the two envs raises in the next step
        envs.step_async(actions)
        with pytest.raises(EnvError) as raised:
            envs.step_wait(timeout=10)
        (failed,) = raised.value.failed_env_ids
        assert raised.value.env_index == failed
        with pytest.raises(Exception, match="without any prior call"):
            envs.step_wait(timeout=1)
        obs = envs.step(actions)[0]  # neither refused nor a batch of a step never sent
        assert obs[1 - failed][1] == 3
        assert obs[failed][1] == 2
        envs.reset()


@pytest.mark.parametrize("seed", [None, 0])  # data plane, general path
def test_reset_wait_that_raises_an_env_error_leaves_nothing_pending(tmp_path, seed):
    marker = str(tmp_path / "raise")
    open(marker, "w").close()
    fns = [functools.partial(IncarnationEnv, reset_raise_marker=marker)] * 2
    with MultiEnv(fns) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, np.int64))
        os.unlink(marker)
        envs.reset_async(seed=seed)
        with pytest.raises(EnvError):
            envs.reset_wait(timeout=10)
        with pytest.raises(Exception, match="without any prior call"):
            envs.reset_wait(timeout=1)
        obs, _ = envs.reset()
        assert (obs[:, 0] == 0).all()
        envs.step(np.zeros(2, np.int64))


def _raisers(tmp_path, n, raising):
    """Factories of n envs; those in ``raising`` raise in their next step once armed."""
    markers = {}
    fns = []
    for i in range(n):
        marker = None
        if i in raising:
            marker = markers[i] = str(tmp_path / f"raise-{i}")
            open(marker, "w").close()
        fns.append(functools.partial(IncarnationEnv, raise_marker=marker))
    return fns, markers


def _recv_all(envs, timeout=20):
    """recv() until nothing is in flight: the env ids returned, and those an EnvError named."""
    returned, named = [], []
    while envs._in_flight.is_busy():
        try:
            returned += envs.recv(timeout=timeout)[4]["env_id"].tolist()
        except EnvError as error:
            named.append(error.env_index)
    return sorted(returned), named


@pytest.mark.parametrize("k", [1, 2])
def test_every_env_that_raises_in_one_recv_is_named_by_an_env_error(tmp_path, k):
    """Two envs raise in one send/recv round: each gets its EnvError, none hangs recv()."""
    fns, markers = _raisers(tmp_path, 4, {0, 1})
    with MultiEnv(fns, envs_per_worker=k) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            for marker in markers.values():
                os.unlink(marker)
            envs.send(np.zeros(4, np.int64))
            returned, named = _recv_all(envs)
            assert named == [0, 1]  # one EnvError each, lowest env first
            assert returned == [2, 3]


def test_an_env_that_raised_in_a_partial_send_is_never_returned_later(tmp_path):
    """A send of part of a worker's envs (the general path): the env that raised is named,
    and is neither returned nor kept in flight afterwards."""
    fns, markers = _raisers(tmp_path, 6, {2})
    with MultiEnv(fns, envs_per_worker=3) as envs:
        envs.reset(seed=0)
        os.unlink(markers[2])
        envs.send(np.zeros(2, np.int64), [2, 3])
        with pytest.raises(EnvError) as raised:
            envs.recv(batch_size=2, timeout=20)
        assert raised.value.env_index == 2
        assert envs._in_flight.env_ids() == [3]
        obs, *_, infos = envs.recv(timeout=20)
        assert infos["env_id"].tolist() == [3]
        assert obs[0][1] == 1
        envs.send(np.zeros(1, np.int64), [3])
        assert envs.recv(timeout=20)[4]["env_id"].tolist() == [3]


def test_an_env_error_in_recv_gets_no_healthy_worker_killed(tmp_path):
    """With step_timeout set, the other workers of a recv that raises are collected as they
    answered, not waited on until their deadline and killed as timed out."""
    fns, markers = _raisers(tmp_path, 8, {3})
    with MultiEnv(fns, envs_per_worker=2, step_timeout=2.0, restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        for _ in range(8):
            os.unlink(markers[3])
            envs.send(np.zeros(8, np.int64))
            returned, named = _recv_all(envs)
            assert named == [3]
            assert len(returned) == 7
            envs.step(np.zeros(8, np.int64))
        assert [env["restarts"] for env in envs.stats()] == [0] * 8


@pytest.mark.parametrize("path", ["data plane", "general path", "send/recv"])
def test_a_hung_step_is_killed_after_one_step_timeout_on_every_path(path):
    """The deadline counts from the send: a hand-over gives the hung worker no second one."""
    from tests.envs import CountingEnv, HangOnStep

    fns = [functools.partial(HangOnStep, at_count=3), CountingEnv]
    with MultiEnv(fns, step_timeout=1.0, restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        actions = np.zeros(2, np.int64)
        for _ in range(2):
            envs.step(actions)
        began = time.monotonic()
        if path == "send/recv":
            envs.send(actions)
            _, _, _, truncated, infos = envs.recv(timeout=30)  # env 0 is row 0: ascending
        else:
            _, _, _, truncated, infos = envs.step([0, 0] if path == "general path" else actions)
        took = time.monotonic() - began
        assert truncated[0]
        assert restarted(infos, 0)
        assert 1.0 <= took < 1.8, f"the hung step came back after {took:.2f} s"


@pytest.mark.parametrize("path", ["data plane", "general path", "send/recv"])
def test_an_autoreset_whose_reset_raised_is_tried_again_on_the_next_step(tmp_path, path):
    """Next-step autoreset: the reset raises (EnvError); the next step resets the env
    again, as SyncVectorEnv does, rather than stepping on from the ended episode."""
    marker = str(tmp_path / "reset-raise")
    open(marker, "w").close()
    fns = [functools.partial(IncarnationEnv, episode_length=2, reset_raise_marker=marker)] * 2

    def step(envs, actions):
        if path != "send/recv":
            return envs.step(actions.tolist() if path == "general path" else actions)
        envs.send(actions)
        try:
            return envs.recv(timeout=20)
        finally:
            while envs._in_flight.is_busy():  # the env that did not raise
                envs.recv(timeout=20)

    with MultiEnv(fns, envs_per_worker=1 if path == "send/recv" else 2) as envs:
        envs.reset(seed=0)
        actions = np.zeros(2, np.int64)
        step(envs, actions)
        assert step(envs, actions)[2].all()  # both episodes ended
        os.unlink(marker)  # one of the two autoresets raises
        with pytest.raises(EnvError, match="reset"):
            step(envs, actions)
        obs, rewards, _terminated, *_ = step(envs, actions)
        assert obs[:, 0].tolist() in ([0, 1], [1, 0]), obs  # the env that raised: reset
        assert rewards[obs[:, 0] == 0].tolist() == [0.0]


@pytest.mark.parametrize("k", [1, 2])
def test_a_masked_reset_in_which_envs_raise_names_them_all_and_leaves_no_reply_behind(tmp_path, k):
    """Two envs raise in one data-plane reset: one EnvError names both (``failed_env_ids``)
    and carries the others' reset; no reply is left on a pipe for a later call to read (the
    round once read a worker's stale status as its answer: calls then went one off)."""
    markers = [str(tmp_path / f"reset-raise-{i}") for i in range(4)]
    fns = [
        functools.partial(IncarnationEnv, reset_raise_marker=m, step_sleep_s=0.1 * (i == 1))
        for i, m in enumerate(markers)
    ]
    for marker in markers:
        open(marker, "w").close()
    mask = np.array([True, True, True, False])
    with MultiEnv(fns, envs_per_worker=k, restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        actions = np.zeros(4, np.int64)
        for round_number in range(6):
            envs.step(actions)
            envs.get_attr("t")  # a call: the data plane checks its workers anew
            last = envs.step(actions)[0]
            if round_number % 2:  # a death mid-step leaves its worker's status behind
                timer = threading.Timer(0.03, kill, (envs.envs[1].pid,))
                timer.start()
                truncated = envs.step(actions)[3]
                timer.join()
                assert truncated[1]
                envs.reset()
                envs.get_attr("t")
                last = envs.step(actions)[0]
            os.unlink(markers[0])
            os.unlink(markers[1])
            with pytest.raises(EnvError) as raised:
                envs.reset(options={"reset_mask": mask})
            assert raised.value.failed_env_ids == [0, 1]
            obs, _ = raised.value.results
            assert obs[2][0] == 0
            assert obs[3].tolist() == last[3].tolist()
            # Each env answers its own call: no reply of the reset is left on a pipe.
            assert list(envs.get_attr("incarnation")) == obs[:, 2].tolist()
            assert envs.get_attr("t")[2:] == (0, last[3][0])
            envs.reset()


@pytest.mark.parametrize("call", ["step_wait", "reset_wait"])
def test_a_wait_with_a_timeout_keeps_it_after_a_hand_over(call):
    """A worker dies while another is still slow: the data plane hands the round over, and
    step_wait(timeout)/reset_wait(timeout) still return by the timeout, the round in flight;
    the next wait collects it, the dead worker's env flagged (or its reset replayed)."""
    slow = functools.partial(IncarnationEnv, step_sleep_s=1.5, reset_sleep_s=1.5)
    # Env 1's call lasts long enough for the kill to land in it: an instant one could be
    # done first on a busy machine (seen once beside other runs), and nothing be flagged.
    killed = functools.partial(IncarnationEnv, step_sleep_s=0.5, reset_sleep_s=0.5)
    with MultiEnv([slow, killed], restart_policy=_BUDGET) as envs:
        envs.reset(seed=0)
        if call == "step_wait":
            envs.step_async(np.zeros(2, np.int64))
        else:
            envs.reset_async()
        kill(envs.envs[1].pid)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            getattr(envs, call)(timeout=0.3)
        assert time.monotonic() - began < 0.9
        result = getattr(envs, call)(timeout=10)
        if call == "step_wait":
            assert restarted(result[4], 1)
            assert result[3][1]
            assert result[0][0][0] == 1  # the slow env stepped once
        else:
            assert result[0].shape[0] == 2
        envs.step(np.zeros(2, np.int64))
