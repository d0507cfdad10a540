"""placement: each worker's own environment variables and CPUs, kept across respawns."""

import os
import signal

import numpy as np
import pytest

from multienv import MultiEnv, SubprocessEnv, WorkerPlacement, create_subprocess_envs
from multienv.placement import placements_for
from tests.envs import EnvironEcho

pytestmark = pytest.mark.timeout(60)

VARIABLE = "MULTIENV_TEST_WORKER"
CPUS = sorted(os.sched_getaffinity(0))


def worker_tag(worker_index):
    return WorkerPlacement(env={VARIABLE: f"w{worker_index}"})


def test_each_worker_gets_its_own_variables_and_keeps_them_after_a_sigkill():
    with MultiEnv([EnvironEcho] * 3, placement=worker_tag) as envs:
        assert envs.call("getenv", VARIABLE) == ("w0", "w1", "w2")
        envs.reset(seed=0)
        killed = envs.envs[1].pid
        os.kill(killed, signal.SIGKILL)
        *_, truncations, _ = envs.step(np.ones(3, dtype=np.int64))
        assert truncations.tolist() == [False, True, False]
        assert envs.envs[1].pid != killed  # respawned, with its own variables again
        assert envs.call("getenv", VARIABLE) == ("w0", "w1", "w2")
    assert os.environ.get(VARIABLE) is None  # the parent's environment is left alone


def test_a_list_gives_one_placement_per_worker_of_several_envs():
    placements = [WorkerPlacement(env={VARIABLE: tag}) for tag in ("a", "b")]
    with MultiEnv([EnvironEcho] * 4, envs_per_worker=2, placement=placements) as envs:
        assert envs.call("getenv", VARIABLE) == ("a", "a", "b", "b")


def test_a_placements_thread_variable_wins_over_blas_threads():
    placement = WorkerPlacement(env={"OMP_NUM_THREADS": "3"})
    with MultiEnv([EnvironEcho] * 2, placement=[placement, WorkerPlacement()]) as envs:
        assert envs.call("getenv", "OMP_NUM_THREADS") == ("3", "1")


def test_a_worker_placed_on_cpus_runs_there_after_a_respawn_too():
    placements = [WorkerPlacement(cpus=CPUS[:1]), WorkerPlacement(cpus=CPUS)]
    with MultiEnv([EnvironEcho] * 2, placement=placements) as envs:
        assert envs.call("affinity") == (CPUS[:1], CPUS)
        envs.reset(seed=0)
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        envs.step(np.ones(2, dtype=np.int64))
        assert envs.call("affinity") == (CPUS[:1], CPUS)


def test_a_lone_env_takes_one_placement():
    with SubprocessEnv(EnvironEcho, placement=worker_tag(7)) as env:
        env.start()
        env.initialize()
        assert env.call("getenv", VARIABLE) == "w7"


def test_bad_placements_are_refused_before_anything_starts_naming_the_worker():
    with pytest.raises(TypeError, match=r"worker 1 \(env 1\): placement must give a Worker"):
        create_subprocess_envs(
            [EnvironEcho] * 2, placement=lambda w: {VARIABLE: "x"} if w else worker_tag(w)
        )
    with pytest.raises(ValueError, match="placement has 1 entries for 2 workers"):
        create_subprocess_envs([EnvironEcho] * 2, placement=[worker_tag(0)])
    with pytest.raises(ValueError, match=r"worker 0 \(envs 0-1\): WorkerPlacement.cpus=\[9999\]"):
        create_subprocess_envs(
            [EnvironEcho] * 2, envs_per_worker=2, placement=WorkerPlacement(cpus=[9999])
        )
    with pytest.raises(TypeError, match=r"worker 0 .*WorkerPlacement\.env must map"):
        create_subprocess_envs([EnvironEcho], placement=WorkerPlacement(env={"A": 1}))
    with pytest.raises(ValueError, match=r"pin_cpu=True and WorkerPlacement\.cpus"):
        create_subprocess_envs(
            [EnvironEcho], pin_cpu=True, placement=WorkerPlacement(cpus=CPUS[:1])
        )
    with pytest.raises(ValueError, match=r"worker 0 \(env 0\): placement\(0\) raised Zero"):
        create_subprocess_envs([EnvironEcho], placement=lambda w: 1 / 0)


def test_placements_for_resolves_each_worker_once():
    assert placements_for(None, 2) == [None, None]
    calls = []

    def placement(worker_index):
        calls.append(worker_index)
        return WorkerPlacement(cpus={CPUS[0], CPUS[0]})

    resolved = placements_for(placement, 3)
    assert calls == [0, 1, 2]
    assert resolved[0].cpus == (CPUS[0],)
    with pytest.raises(TypeError, match="placement must be a WorkerPlacement"):
        placements_for("gpu0", 1)
