"""What a worker process sees of its threads and CPUs, with real workers."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from multienv import MultiEnv, SubprocessEnv
from multienv.wire.worker_settings import SPIN_S, THREAD_VARIABLES, WorkerSettings, parent_spins
from multienv.worker.worker import MALLOC_VARIABLES
from tests.conftest import live_workers
from tests.envs import BigFrameEnv, CountingEnv, ThreadProbe


@pytest.fixture
def no_thread_variables(monkeypatch):
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_workers_run_one_thread_per_pool_by_default(no_thread_variables):
    assert np.__name__  # numpy is loaded here and in the forkserver, pool and all
    with MultiEnv([ThreadProbe] * 2, envs_per_worker=1) as envs:
        for seen in envs.call("thread_variables"):
            assert seen == dict.fromkeys(THREAD_VARIABLES, "1")
        for pools in envs.call("pool_threads"):
            assert pools  # numpy's BLAS, loaded before the env
            assert set(pools.values()) == {1}


def test_the_users_own_thread_variables_win(no_thread_variables, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with MultiEnv([ThreadProbe], context="forkserver") as envs:
        (seen,) = envs.call("thread_variables")
    assert seen == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_blas_threads_none_leaves_the_workers_pools_alone(no_thread_variables, context):
    # The forkserver may have started single-threaded for the vectors before: undone here.
    with MultiEnv([ThreadProbe], blas_threads=None, context=context) as envs:
        (seen,) = envs.call("thread_variables")
        (pools,) = envs.call("pool_threads")
    assert seen == dict.fromkeys(THREAD_VARIABLES)
    if os.cpu_count() and os.cpu_count() > 1 and "blas" in pools:
        assert pools["blas"] > 1


def test_blas_threads_sets_the_count():
    with MultiEnv([ThreadProbe], blas_threads=2, context="spawn") as envs:
        (pools,) = envs.call("pool_threads")
    assert pools  # numpy's BLAS at least
    assert set(pools.values()) <= {1, 2}  # a pool smaller than 2 already stays as it is
    if "blas" in pools:  # born with this process's CPUs, limited to 2
        assert pools["blas"] == min(2, len(os.sched_getaffinity(0)))


def test_pin_cpu_puts_each_worker_on_its_own_cpu_round_robin():
    cpus = sorted(os.sched_getaffinity(0))
    with MultiEnv([ThreadProbe] * 6, envs_per_worker=2, pin_cpu=True) as envs:
        seen = envs.call("cpus")
    assert list(seen) == [[cpus[(env // 2) % len(cpus)]] for env in range(6)]


def test_a_vector_with_a_cpu_for_each_worker_pins_them_by_default():
    cpus = sorted(os.sched_getaffinity(0))
    with MultiEnv([ThreadProbe] * len(cpus)) as envs:
        assert list(envs.call("cpus")) == [[cpu] for cpu in cpus]


def test_a_worker_respawned_after_sigkill_is_pinned_where_its_predecessor_was():
    cpus = sorted(os.sched_getaffinity(0))
    with MultiEnv([ThreadProbe] * len(cpus)) as envs:
        envs.reset(seed=0)
        old_pid = envs.envs[-1].pid
        os.kill(old_pid, signal.SIGKILL)
        envs.step(np.zeros(len(cpus), dtype=np.int64))
        assert envs.envs[-1].pid != old_pid
        assert list(envs.call("cpus")) == [[cpu] for cpu in cpus]


def test_a_vector_with_more_workers_than_cpus_is_not_pinned_by_default():
    cpus = sorted(os.sched_getaffinity(0))
    with MultiEnv([ThreadProbe] * (len(cpus) + 1)) as envs:
        assert all(seen == cpus for seen in envs.call("cpus"))


def test_pin_cpu_false_leaves_every_worker_free():
    cpus = sorted(os.sched_getaffinity(0))
    with MultiEnv([ThreadProbe] * len(cpus), pin_cpu=False) as envs:
        assert all(seen == cpus for seen in envs.call("cpus"))


def test_a_lone_subprocess_env_is_not_pinned_by_default():
    cpus = sorted(os.sched_getaffinity(0))
    env = SubprocessEnv(ThreadProbe)
    try:
        env.start()
        env.initialize()
        assert env.call("cpus") == cpus
    finally:
        env.close()


def test_a_bad_blas_threads_names_the_env_before_anything_starts():
    with pytest.raises(ValueError, match="env 0: blas_threads must be an int >= 1 or None"):
        MultiEnv([ThreadProbe], blas_threads=0)
    with pytest.raises(ValueError, match="blas_threads"):
        WorkerSettings.decide(True, False, 0, 3)  # type: ignore[arg-type]


def test_wait_spin_is_in_the_launch_recipe_of_every_worker():
    with MultiEnv([CountingEnv] * 4, envs_per_worker=2, wait="spin") as envs:
        envs.reset(seed=0)
        for proxy in envs.envs:
            assert proxy.supervisor.handle._recipe.settings.spin_s == SPIN_S
    with MultiEnv([CountingEnv] * 2, envs_per_worker=2) as envs:
        assert envs.envs[0].supervisor.handle._recipe.settings.spin_s == 0.0


def test_a_hot_parent_spins_only_with_a_core_to_spare():
    cores = len(os.sched_getaffinity(0))
    assert parent_spins("spin", cores - 1)
    assert not parent_spins("spin", cores)
    assert not parent_spins("sleep", 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core to spare")
def test_a_hot_vector_makes_its_parent_spin_only_when_its_workers_leave_a_core():
    cores = len(os.sched_getaffinity(0))
    with MultiEnv([CountingEnv] * 2, envs_per_worker=2, wait="spin") as envs:
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        assert envs.envs[0].supervisor.handle._spin_s == SPIN_S
    with MultiEnv([CountingEnv] * cores, wait="spin") as envs:  # a worker per core
        assert {proxy.supervisor.handle._spin_s for proxy in envs.envs} == {0.0}
    with MultiEnv([CountingEnv] * 2, envs_per_worker=2) as envs:
        assert envs.envs[0].supervisor.handle._spin_s == 0.0


def test_hot_mode_refuses_more_spinning_workers_than_cores():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"wait='spin' keeps one core busy per worker") as caught:
        MultiEnv([CountingEnv] * (cores + 1), wait="spin")
    assert f"{cores + 1} workers" in str(caught.value)
    assert not live_workers(wait_s=0.5)
    with MultiEnv([CountingEnv] * (cores + 1), envs_per_worker=cores + 1, wait="spin") as envs:
        envs.reset(seed=0)  # one worker is fine


def test_an_unknown_wait_mode_is_rejected():
    with pytest.raises(ValueError, match="wait must be 'sleep' or 'spin'"):
        MultiEnv([CountingEnv] * 2, wait="busy")


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _faults_per_step(envs: MultiEnv, steps: int = 100) -> float:
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    envs.reset(seed=0)
    for _ in range(20):
        envs.step(actions)
    pid = envs.envs[0].supervisor.handle.pid
    before = _minor_faults(pid)
    for _ in range(steps):
        envs.step(actions)
    return (_minor_faults(pid) - before) / steps


glibc_only = pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="glibc's malloc"
)


@pytest.fixture
def no_malloc_variables(monkeypatch):
    for name in MALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@glibc_only
def test_a_worker_keeps_the_memory_its_frames_free_rather_than_fault_it_in_at_every_step(
    no_malloc_variables,
):
    # 8 frames of 100 KB dropped together at the end of each batch: glibc's default gave
    # them back to the system every time, 165 page faults per step in all.
    with MultiEnv([BigFrameEnv] * 8, envs_per_worker=8, copy=False) as envs:
        assert _faults_per_step(envs) < 5


@glibc_only
@pytest.mark.parametrize("name", ["", *MALLOC_VARIABLES])
def test_the_users_own_malloc_variables_leave_glibcs_thresholds_alone(name):
    # In a fresh interpreter, as a worker runs it: whether a heap's layout makes glibc give
    # frames back depends on what ran before, so a fault count cannot tell this apart.
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES}
    if name:
        env[name] = "131072"
    code = "from multienv.worker.worker import keep_freed_heap; print(keep_freed_heap())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == (["False"] if name else ["True"])
