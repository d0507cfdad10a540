"""Pinning never stacks separate runs: CPU claims seen by every process, with real workers."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from multienv import MultiEnv
from multienv.backends.subprocess import cpu_claims
from multienv.backends.subprocess.cpu_claims import try_claim
from tests.conftest import wait_until_dead
from tests.envs import ThreadProbe

CPUS = sorted(os.sched_getaffinity(0))

# A run of a user's script: one vector with one worker (pinned by default), its worker's
# CPUs printed, open until its stdin closes.
ONE_RUN = textwrap.dedent(
    """
    import sys
    from multienv import MultiEnv
    from tests.envs import ThreadProbe

    if __name__ == "__main__":
        with MultiEnv([ThreadProbe]) as envs:
            print(*envs.call("cpus")[0], flush=True)
            sys.stdin.read()
    """
)


def start_run() -> tuple[subprocess.Popen, list[int]]:
    """A run in a fresh interpreter, its vector open; the CPUs its worker may use."""
    run = subprocess.Popen(
        [sys.executable, "-c", ONE_RUN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert run.stdout is not None
    line = run.stdout.readline()
    assert line, "the run printed nothing"
    return run, [int(cpu) for cpu in line.split()]


def end(run: subprocess.Popen) -> None:
    run.communicate(timeout=30)
    assert run.returncode == 0


@pytest.mark.timeout(90)
def test_two_runs_side_by_side_never_pin_their_workers_to_the_same_cpu():
    first, first_cpus = start_run()
    try:
        second, second_cpus = start_run()
        end(second)
    finally:
        end(first)
    assert first_cpus == [CPUS[0]]  # pinned: the first free CPU
    if len(CPUS) > 1:
        assert second_cpus == [CPUS[1]]  # pinned too, to the next free one
    else:
        assert second_cpus == CPUS  # nothing free: not pinned, so not stacked


@pytest.mark.timeout(60)
def test_a_run_killed_by_sigkill_frees_its_cpu():
    run, cpus = start_run()
    os.kill(run.pid, signal.SIGKILL)
    run.communicate(timeout=30)
    wait_until_dead([run.pid])
    claim = try_claim(cpus[0])
    assert claim is not None, "the killed run's claim outlived it"
    claim.release()


@contextlib.contextmanager
def every_cpu_claimed() -> Iterator[None]:
    """Every CPU claimed, as another run's vectors would claim them."""
    claims = [try_claim(cpu) for cpu in CPUS]
    try:
        assert None not in claims
        yield
    finally:
        for claim in claims:
            if claim is not None:
                claim.release()


def test_a_vector_with_every_cpu_claimed_elsewhere_is_not_pinned_and_says_why(caplog):
    with every_cpu_claimed(), caplog.at_level(logging.INFO, logger="multienv"):
        with MultiEnv([ThreadProbe] * len(CPUS)) as envs:
            assert all(seen == CPUS for seen in envs.call("cpus"))
    assert f"not pinning {len(CPUS)} worker(s) to CPUs: 0 of the {len(CPUS)} CPUs" in caplog.text


def test_pin_cpu_true_pins_every_worker_even_when_the_cpus_are_claimed():
    with every_cpu_claimed(), MultiEnv([ThreadProbe] * 2, pin_cpu=True) as envs:
        assert list(envs.call("cpus")) == [[CPUS[0]], [CPUS[1 % len(CPUS)]]]


def test_close_releases_the_claims_and_a_respawn_keeps_them():
    with MultiEnv([ThreadProbe] * len(CPUS)) as envs:
        assert all(try_claim(cpu) is None for cpu in CPUS)
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        envs.reset(seed=0)  # respawns worker 0
        assert all(try_claim(cpu) is None for cpu in CPUS)
    claims = [try_claim(cpu) for cpu in CPUS]
    assert all(claim is not None for claim in claims)
    for claim in claims:
        assert claim is not None
        claim.release()


def test_a_vector_that_fails_to_build_frees_its_cpus_at_once():
    unpicklable = threading.Lock()

    def make_env():
        return ThreadProbe() if unpicklable else None

    with pytest.raises(TypeError):
        MultiEnv([ThreadProbe] * (len(CPUS) - 1) + [make_env])
    claims = [try_claim(cpu) for cpu in CPUS]
    assert None not in claims
    for claim in claims:
        assert claim is not None
        claim.release()


def test_claims_live_in_dev_shm_unless_the_variable_names_a_folder(monkeypatch):
    monkeypatch.delenv(cpu_claims.DIR_VARIABLE)
    assert cpu_claims.claims_dir() == ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    monkeypatch.setenv(cpu_claims.DIR_VARIABLE, "/nonexistent/multienv")
    assert try_claim(0) is None  # no file, no claim: the vector then pins nothing


def test_a_bad_pin_cpu_is_refused_before_anything_starts():
    with pytest.raises(TypeError, match="pin_cpu must be True, False or None, got 'yes'"):
        MultiEnv([ThreadProbe], pin_cpu="yes")
