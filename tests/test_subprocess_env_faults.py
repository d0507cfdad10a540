"""Faults injected into real worker processes: kills, exits, segfaults, hangs, bad replies."""

import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import multienv
from multienv import (
    EnvCrashedError,
    EnvCrashLoopError,
    EnvError,
    MultiEnv,
    RestartPolicy,
    SubprocessEnv,
)
from tests.conftest import STEP_RAISED, leakable_shm_names, live_workers
from tests.envs import (
    AllocateOnStep,
    Chaotic,
    CountingEnv,
    CrashInInitAlways,
    CrashInInitOnce,
    ExitOnStep,
    FixedLengthEnv,
    HangInInitOnce,
    HangOnResetOnce,
    HangOnStep,
    RaiseOnStep,
    SegfaultEveryStep,
    SlowMethod,
    UnpicklableInfo,
    WrongObsDtype,
    WrongObsShape,
)

pytestmark = pytest.mark.fault
REPO = pathlib.Path(__file__).resolve().parent.parent


def ready(env_fn, **options):
    proxy = SubprocessEnv(env_fn, **options)
    proxy.start()
    proxy.initialize()
    return proxy


def is_gone(pid):
    """True once the process is a zombie or reaped; /proc/<pid>/stat can vanish mid-read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_gone(pids, within_s):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(is_gone(pid) for pid in pids):
            return True
        time.sleep(0.02)
    return False


def assert_truncation(result, cause):
    obs, reward, terminated, truncated, info = result
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["multienv"]["restarted"] is True
    assert info["multienv"]["cause"] == cause
    return obs


# ---------------------------------------------------------------- deaths during step


def test_step_after_os_exit_returns_truncation(tmp_path):
    proxy = ready(lambda: ExitOnStep(str(tmp_path / "m"), at_count=2, code=7))
    try:
        proxy.reset()
        seen = proxy.step(1)[0]
        obs = assert_truncation(proxy.step(1), "exit code 7")
        np.testing.assert_array_equal(obs, seen)
        assert proxy.reset()[0].tolist() == [0.0]
        assert proxy.step(1)[0].tolist() == [1.0]
    finally:
        proxy.close()


def test_step_killed_while_allocating_returns_truncation_and_other_envs_unaffected():
    with MultiEnv([CountingEnv, AllocateOnStep, CountingEnv]) as envs:
        envs.reset()
        victim = envs.envs[1].pid
        timer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
        timer.start()
        obs, rewards, _terminations, truncations, infos = envs.step(np.array([1, 1, 1]))
        timer.join()
        assert truncations.tolist() == [False, True, False]
        assert infos["multienv"]["cause"][1] == "SIGKILL"
        assert obs[:, 0].tolist() == [1.0, 0.0, 1.0]
        assert rewards.tolist() == [1.0, 0.0, 1.0]


@pytest.mark.timeout(60)
def test_a_step_that_also_resets_a_mate_has_a_deadline_only_with_reset_timeout(caplog):
    # A worker answers for its batch as a whole: the step after env 0's episode ended resets
    # it along with env 1's step, which hangs. Without reset_timeout that batch has no
    # deadline, which a vector says when it is built; with it, the hang is killed. Same-step
    # autoreset resets inside a step, under its deadline: nothing to say.
    fns = [lambda: FixedLengthEnv(1), lambda: HangOnStep(at_count=2, hang_s=30.0)]
    with caplog.at_level(logging.WARNING, logger="multienv"):
        MultiEnv(fns, envs_per_worker=2, step_timeout=0.5).close()
    assert sum("no reset_timeout" in r.message for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="multienv"):
        MultiEnv(fns, envs_per_worker=1, step_timeout=0.5).close()
        MultiEnv(fns, envs_per_worker=2, step_timeout=0.5, autoreset_mode="SameStep").close()
        envs = MultiEnv(fns, envs_per_worker=2, step_timeout=0.5, reset_timeout=1.0)
    assert not any("no reset_timeout" in r.message for r in caplog.records)
    with envs:
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
        began = time.monotonic()
        _, _, _, truncations, infos = envs.step(np.ones(2, dtype=np.int64))
        assert time.monotonic() - began < 5
        assert truncations.tolist() == [False, True]  # env 0's reset is replayed
        assert infos["multienv"]["cause"][1] == "timeout"


def test_step_timeout_kills_the_hung_worker_and_returns_truncation(caplog):
    proxy = ready(lambda: HangOnStep(at_count=2), step_timeout=0.5)
    try:
        proxy.reset()
        proxy.step(0)
        hung = proxy.pid
        with caplog.at_level(logging.WARNING, logger="multienv"):
            began = time.monotonic()
            assert_truncation(proxy.step(0), "timeout")
            assert time.monotonic() - began < 5
        assert is_gone(hung)
        assert any("timed out" in r.message for r in caplog.records)
        assert any("respawning" in r.message for r in caplog.records)
        assert proxy.restarts == 1
    finally:
        proxy.close()


def test_repeated_respawns_are_logged_three_times_then_summarized(caplog):
    with caplog.at_level(logging.WARNING, logger="multienv"):
        with MultiEnv([CountingEnv, CountingEnv], restart_policy=RestartPolicy(20)) as envs:
            envs.reset(seed=0)
            for _ in range(7):
                os.kill(envs.envs[1].pid, signal.SIGKILL)
                _obs, _rewards, _terminations, truncations, _infos = envs.step(np.array([1, 1]))
                assert truncations.tolist() == [False, True]
                envs.step(np.array([1, 1]))  # env 1's autoreset
            one_by_one = [r.message for r in caplog.records if "died (SIGKILL)" in r.message]
            assert len(one_by_one) == 3
            assert all(m.startswith("env 1:") for m in one_by_one)
            assert "later failures are counted" in one_by_one[2]
            assert not any("more worker failures" in r.message for r in caplog.records)
        summaries = [r.message for r in caplog.records if "more worker failures" in r.message]
    assert summaries
    assert summaries[0].startswith("4 more worker failures")
    assert "SIGKILL 4; envs 1" in summaries[0]


def test_reset_timeout_kills_and_replays(tmp_path):
    proxy = ready(lambda: HangOnResetOnce(str(tmp_path / "m")), reset_timeout=0.5)
    try:
        obs, info = proxy.reset(seed=5)
        assert obs.tolist() == [0.0]
        assert info == {"seed_used": 5}
        assert (proxy.restarts, proxy.last_failure) == (1, "timeout")
    finally:
        proxy.close()


def test_step_wait_timeout_raises_and_env_stays_usable():
    with MultiEnv([CountingEnv, lambda: HangOnStep(at_count=1, hang_s=1.5)]) as envs:
        envs.reset()
        envs.step_async(np.array([1, 1]))
        with pytest.raises(TimeoutError, match="call step_wait"):
            envs.step_wait(timeout=0.2)
        obs, *_ = envs.step_wait(timeout=10)
        assert obs[:, 0].tolist() == [1.0, 1.0]
        assert envs.step(np.array([1, 1]))[0][:, 0].tolist() == [2.0, 2.0]


def test_worker_killed_during_call_is_respawned_and_the_call_replayed():
    proxy = ready(SlowMethod)
    try:
        victim = proxy.pid
        timer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))
        timer.start()
        assert proxy.call("slow_value", 0.5) == 42
        timer.join()
        assert proxy.pid != victim
        assert (proxy.restarts, proxy.last_failure) == (1, "SIGKILL")
        assert proxy.get_attr("episode_length") == 5
    finally:
        proxy.close()


def test_reply_left_in_flight_is_discarded_before_the_next_call():
    # What a KeyboardInterrupt between send and receive leaves behind: the next call must
    # not read the stale reply as its own.
    proxy = ready(CountingEnv)
    try:
        proxy.reset()
        proxy.send_step(1)
        obs, *_ = proxy.step(1)
        assert obs.tolist() == [2.0]
        assert proxy.get_attr("count") == 2
    finally:
        proxy.close()


# ---------------------------------------------------------------- construction


def test_hang_in_constructor_hits_init_timeout_then_respawn_succeeds(tmp_path):
    proxy = ready(lambda: HangInInitOnce(str(tmp_path / "m")), init_timeout=1.0)
    try:
        assert (proxy.restarts, proxy.last_failure) == (1, "timeout")
        assert proxy.reset()[0].tolist() == [0.0]
    finally:
        proxy.close()


def test_crash_in_constructor_once_then_respawn_succeeds(tmp_path):
    proxy = ready(lambda: CrashInInitOnce(str(tmp_path / "m")))
    try:
        assert (proxy.restarts, proxy.last_failure) == (1, "exit code 3")
        assert proxy.reset()[0].tolist() == [0.0]
    finally:
        proxy.close()


def test_crash_in_constructor_every_time_raises_crash_loop_error():
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff=0.01)
    with pytest.raises(EnvCrashLoopError, match="env 0: worker died 3 times") as caught:
        ready(CrashInInitAlways, restart_policy=policy)
    assert caught.value.cause == "exit code 4"
    assert live_workers() == []


# ---------------------------------------------------------------- crash loops


def test_crash_loop_raises_env_crash_loop_error_with_cause_and_stderr():
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff=0.01)
    proxy = ready(lambda: SegfaultEveryStep(), restart_policy=policy, env_index=6)
    try:
        proxy.reset()
        for _ in range(3):
            assert_truncation(proxy.step(0), "SIGSEGV")
            proxy.reset()
        with pytest.raises(EnvCrashLoopError) as caught:
            proxy.step(0)
        error = caught.value
        assert error.env_index == 6
        assert error.restarts == 4
        assert error.cause == "SIGSEGV"
        # The env's own last words first, then the dump cut to the frames that crashed:
        # on every CPython, though 3.14's whole dump is 60 lines and more.
        tail = error.stderr_tail
        assert tail[:2] == ("about to dereference NULL", "Fatal Python error: Segmentation fault")
        assert any(line.startswith('  File "') and "tests/envs.py" in line for line in tail)
        package = os.path.dirname(multienv.__file__)
        assert not any(package in line or "Extension modules" in line for line in tail)
        assert len(tail) <= 8, tail
        message = str(error)
        assert message.startswith("env 6: worker died 4 times in 60 s")
        assert "last cause SIGSEGV" in message
        with pytest.raises(EnvCrashLoopError):  # and on every later call
            proxy.reset()
    finally:
        proxy.close()
    assert live_workers() == []


def test_restart_policy_never_raises_env_crashed_error(tmp_path):
    proxy = ready(
        lambda: ExitOnStep(str(tmp_path / "m"), at_count=1), restart_policy=RestartPolicy.never()
    )
    try:
        proxy.reset()
        with pytest.raises(EnvCrashedError, match=r"env 0: worker .* died \(exit code 1\)"):
            proxy.step(0)
    finally:
        proxy.close()


# ---------------------------------------------------------------- env errors and bad replies


def test_env_error_leaves_worker_alive_and_env_steps_afterwards():
    with MultiEnv([CountingEnv, lambda: RaiseOnStep(at_count=2)]) as envs:
        envs.reset()
        envs.step(np.array([1, 1]))
        pid = envs.envs[1].pid
        with pytest.raises(EnvError, match=rf"env 1: {STEP_RAISED}: boom"):
            envs.step(np.array([1, 1]))
        assert envs.envs[1].pid == pid
        envs.reset()
        obs, *_ = envs.step(np.array([1, 1]))
        assert obs[0, 0] == 1.0


def test_restart_on_error_treats_an_exception_as_a_death():
    proxy = ready(lambda: RaiseOnStep(at_count=2), restart_on_error=True)
    try:
        proxy.reset()
        proxy.step(0)
        pid = proxy.pid
        assert_truncation(proxy.step(0), "error: ValueError")
        assert proxy.pid != pid
    finally:
        proxy.close()


def test_observation_of_wrong_shape_names_env_expected_and_actual():
    proxy = ready(WrongObsShape, env_index=2)
    try:
        proxy.reset()
        with pytest.raises(EnvError, match=r"env 2: .*has shape \(3,\).*expected shape \(1,\)"):
            proxy.step(0)
    finally:
        proxy.close()


def test_observation_of_wrong_dtype_names_expected_and_actual():
    proxy = ready(WrongObsDtype)
    try:
        proxy.reset()
        with pytest.raises(
            EnvError, match=r"dtype float64; expected shape \(2, 2\) and dtype uint8"
        ):
            proxy.step(0)
    finally:
        proxy.close()


def test_unpicklable_info_names_the_key_and_worker_survives():
    proxy = ready(UnpicklableInfo)
    try:
        proxy.reset()
        proxy.step(0)
        pid = proxy.pid
        with pytest.raises(EnvError, match=r"info\['handle'\] of type lock") as raised:
            proxy.step(0)
        remote = raised.value.__cause__.__cause__  # no env frame: it says so, not a bare header
        assert "outside the env's code" in str(remote)
        assert proxy.pid == pid
        assert proxy.step(0)[4] == {"count": 3}
    finally:
        proxy.close()


# ---------------------------------------------------------------- the parent's side


def run_script(body, **popen):
    script = textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.parametrize(
    ("envs_per_worker", "daemon"),
    [(1, True), (3, True), (1, False)],
    ids=["k1", "k3", "k1-forkserver"],
)
def test_workers_exit_within_2_s_when_parent_is_sigkilled_and_leave_no_temp_dir(
    tmp_path, envs_per_worker, daemon
):
    # Daemon workers fork from the module server, which makes no temporary files. Other
    # workers start from multiprocessing's forkserver, whose socket lives in a pymp-* dir
    # that must not outlive the parent either.
    child = run_script(
        f"""
        import time
        from multienv import MultiEnv
        from tests.envs import CountingEnv
        if __name__ == "__main__":
            envs = MultiEnv([CountingEnv] * 3, envs_per_worker={envs_per_worker}, daemon={daemon})
            print(" ".join(str(e.pid) for e in envs.envs), flush=True)
            time.sleep(60)
        """,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        pids = sorted({int(p) for p in child.stdout.readline().split()})
        assert len(pids) == 3 // envs_per_worker
        assert bool(list(tmp_path.glob("pymp-*"))) == (not daemon)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        assert wait_gone(pids, within_s=2.0), [p for p in pids if not is_gone(p)]
        deadline = time.monotonic() + 2.0
        while list(tmp_path.glob("pymp-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list(tmp_path.iterdir()) == []
    finally:
        child.kill()
        child.communicate(timeout=5)


def test_served_workers_exit_within_2_s_when_parent_is_sigkilled_while_its_fork_lives():
    # A child the parent forked holds copies of the parent's sockets, so the module server
    # never sees its socket close: it watches the parent's pid itself, and its workers
    # (which run no watcher thread of their own) die with it.
    child = run_script(
        """
        import os, time
        from multienv import MultiEnv
        from multienv.backends.subprocess.forking import module_server
        from tests.envs import CountingEnv
        if __name__ == "__main__":
            n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: a module server
            envs = MultiEnv([CountingEnv] * n)
            assert module_server.running() is not None
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            print(" ".join(str(e.pid) for e in envs.envs[1:]), flush=True)
            time.sleep(60)
        """,
        start_new_session=True,  # the forked child is killed with the group afterwards
    )
    try:
        served = [int(p) for p in child.stdout.readline().split()]
        assert served, child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        assert wait_gone(served, within_s=2.0), [p for p in served if not is_gone(p)]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate(timeout=5)


def test_ctrl_c_reaches_only_the_parent_and_close_cleans_up():
    child = run_script(
        """
        import logging
        import numpy as np
        from multienv import MultiEnv
        from tests.envs import CountingEnv
        if __name__ == "__main__":
            logging.basicConfig(level=logging.WARNING)
            with MultiEnv([CountingEnv] * 4) as envs:
                envs.reset()
                print(" ".join(str(e.pid) for e in envs.envs), flush=True)
                try:
                    while True:
                        envs.step(np.ones(4, dtype=np.int64))
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
                    raise
        """,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C would hit
    )
    try:
        pids = [int(p) for p in child.stdout.readline().split()]
        time.sleep(0.5)
        os.killpg(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=15)
    finally:
        child.kill()
    assert "interrupted" in out
    assert err.count("Traceback") == 1, err
    assert "KeyboardInterrupt" in err
    assert "respawning" not in err
    assert wait_gone(pids, within_s=2.0)


def test_close_returns_in_bounded_time_while_a_worker_hangs():
    envs = MultiEnv([CountingEnv, lambda: HangOnStep(at_count=1)])
    envs.reset()
    pids = [e.pid for e in envs.envs]
    envs.step_async(np.array([1, 1]))
    with pytest.raises(TimeoutError):
        envs.step_wait(timeout=0.2)
    began = time.monotonic()
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call"):
        envs.close(timeout=0.5)
    assert time.monotonic() - began < 5
    assert wait_gone(pids, within_s=2.0)


def test_close_after_the_worker_already_died():
    proxy = ready(CountingEnv)
    os.kill(proxy.pid, signal.SIGKILL)
    wait_gone([proxy.pid], within_s=2.0)
    began = time.monotonic()
    proxy.close(timeout=0.5)
    assert time.monotonic() - began < 3


# ---------------------------------------------------------------- soak and hygiene


def test_chaos_every_step_returns_a_full_batch_and_episodes_never_splice():
    num_envs, steps = 8, 3000
    rng = np.random.default_rng(0)
    policy = RestartPolicy(max_restarts=10_000, window_s=60, backoff=0.0)
    kills = 0
    with MultiEnv([Chaotic] * num_envs, restart_policy=policy) as envs:
        obs, _ = envs.reset(seed=0)
        previous = obs[:, 0].copy()
        was_done = np.zeros(num_envs, dtype=bool)
        flagged = 0
        for t in range(steps):
            if t % 20 == 10:
                os.kill(envs.envs[int(rng.integers(num_envs))].pid, signal.SIGKILL)
                kills += 1
            obs, _rewards, terminations, truncations, infos = envs.step(np.ones(num_envs, int))
            assert obs.shape == (num_envs, 1)
            count = obs[:, 0]
            # Next-step autoreset: an env whose last step ended shows a fresh episode (count 0)
            # now; any other env either counts on by one or repeats its last observation
            # because a crash truncated it. A new episode never starts without an end.
            crashed = infos["_multienv"] if "multienv" in infos else np.zeros(num_envs, bool)
            for i in range(num_envs):
                if was_done[i]:
                    assert count[i] == 0, (t, i)
                elif crashed[i]:
                    assert count[i] == previous[i], (t, i)
                    assert truncations[i], (t, i)
                else:
                    assert count[i] == previous[i] + 1, (t, i, count[i], previous[i])
            flagged += int(crashed.sum())
            was_done = terminations | truncations
            previous = count.copy()
        restarts = sum(row["restarts"] for row in envs.stats())
    assert restarts == kills == flagged


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_hygiene_after_500_respawns():
    shm_before = leakable_shm_names()
    policy = RestartPolicy(max_restarts=100_000, window_s=60, backoff=0.0)
    proxy = ready(CountingEnv, restart_policy=policy)
    try:
        proxy.reset()
        for _ in range(20):  # warm-up so lazily opened fds and caches exist
            os.kill(proxy.pid, signal.SIGKILL)
            proxy.step(0)
            proxy.reset()
        fds_before, rss_before = _open_fds(), _rss_kib()
        for _ in range(500):
            os.kill(proxy.pid, signal.SIGKILL)
            proxy.step(0)
            proxy.reset()
        assert proxy.restarts == 520
        assert _open_fds() - fds_before <= 4
        assert _rss_kib() - rss_before < 20_000
    finally:
        proxy.close()
    assert live_workers() == []
    assert leakable_shm_names() - shm_before == set()
