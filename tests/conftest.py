"""Fixtures, and the session-wide checks: no worker outlives the tests, no collection hangs."""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time

import cloudpickle
import pytest

from multienv.backends.subprocess import cpu_claims
from multienv.backends.subprocess.data_plane import DataPlane
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.done_pipes import DoneNotifier
from multienv.wire.procfs import process_table
from multienv.wire.shared_memory import BatchLayout, SharedBatch, SlotWriter
from multienv.worker.runner import EnvRunner
from multienv.worker.worker import OS_NAME_PREFIX, _Loop


@pytest.fixture
def hand_overs(monkeypatch):
    """How many steps the data plane handed over, and how many the supervisors finished."""
    counts = {"hand_over": 0, "finish": 0}
    hand_over, finish = DataPlane._hand_over, WorkerSupervisor.finish

    def counted_hand_over(self, records):
        counts["hand_over"] += 1
        return hand_over(self, records)

    def counted_finish(self):
        counts["finish"] += 1
        return finish(self)

    monkeypatch.setattr(DataPlane, "_hand_over", counted_hand_over)
    monkeypatch.setattr(WorkerSupervisor, "finish", counted_finish)
    return counts


def descendant_workers(name: str | None = None) -> list[int]:
    """Pids of live multienv workers descended from this process (found through /proc).

    ``name``: only the workers of that process name (``OS_NAME_PREFIX`` and an env index).
    Other processes' workers are never counted, nor killed by a test that looks here.
    """
    me, table = os.getpid(), process_table()
    found = []
    for pid, entry in table.items():
        if not entry.name.startswith(OS_NAME_PREFIX) or name not in (None, entry.name):
            continue
        ancestor = entry.ppid
        while ancestor > 1 and ancestor != me:
            ancestor = table[ancestor].ppid if ancestor in table else 0
        if ancestor == me:
            found.append(pid)
    return found


def live_workers(wait_s: float = 3.0) -> list[int]:
    """Workers still alive after giving exiting ones ``wait_s`` seconds to go."""
    deadline = time.monotonic() + wait_s
    while (found := descendant_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def wait_until_dead(pids, within_s=10.0):
    """Wait until every process in ``pids`` is a zombie or gone."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        table = process_table()
        if all(pid not in table or table[pid].state == "Z" for pid in pids):
            return
        time.sleep(0.01)
    raise AssertionError(f"{pids} still alive {within_s} s after SIGKILL")


# What a test could leave in /dev/shm: multienv's own files, its CPU claims aside (they are
# the machine's, reused by later runs, and test_cpu_claims checks them). multienv makes no
# other: its processes and pipes make no named semaphore, its batch buffer is an anonymous
# memory file, and it uses no multiprocessing.shared_memory. Another program's files are
# never a leak of a test's, so a check beside other runs (their sem.mp-* or psm_*, a chaos
# harness's chaos-ctl-<pid>.bin) counts only these.
_LEAKABLE_SHM_PREFIXES = ("multienv",)
_MACHINE_SHM_PREFIXES = ("multienv-cpu-",)


def leakable_shm_names() -> set[str]:
    """The names in /dev/shm that a test of multienv could have left behind."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {
        name
        for name in os.listdir("/dev/shm")
        if name.startswith(_LEAKABLE_SHM_PREFIXES) and not name.startswith(_MACHINE_SHM_PREFIXES)
    }


# How EnvError names a step that raised ValueError in its worker, as a regex.
STEP_RAISED = r"step\(\) raised ValueError in its worker \(pid \d+\)"

RAY_ACTOR_TITLE = "ray::MultienvWorker"  # what Ray calls the processes of our actors


def live_actors(wait_s: float = 3.0) -> list[int]:
    """Pids of processes on this machine that host a multienv Ray actor."""

    def find() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if cmdline.startswith(RAY_ACTOR_TITLE.encode()):
                found.append(int(entry))
        return found

    deadline = time.monotonic() + wait_s
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


@pytest.fixture
def busy_cores():
    """Every core this process may use kept busy: three spinning processes per core.

    A computing step then gets a third of a core or so, its wall time three times its CPU,
    as a waiting step's would be.
    """
    import subprocess
    import sys

    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(3 * len(os.sched_getaffinity(0)))
    ]
    try:
        time.sleep(0.2)  # started and spinning
        yield len(spinners)
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local two-CPU Ray cluster for the whole session, quiet; skips if Ray is absent."""
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[ray]"')
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # AF_UNIX paths: 107 bytes at most
    ray.init(
        address="local",
        num_cpus=2,
        log_to_driver=False,
        include_dashboard=False,
        _temp_dir=temp_dir,
    )
    try:
        yield ray
        leftovers = live_actors()
        assert leftovers == [], f"multienv Ray actors outlived their tests: {leftovers}"
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A backend, envs per worker and how workers wait, as the contract suite runs them."""

    backend: str
    k: int
    wait: str = "sleep"

    @property
    def options(self) -> dict:
        """MultiEnv's keywords for this layout."""
        options = {"backend": self.backend, "envs_per_worker": self.k}
        if self.wait != "sleep":
            options["wait"] = self.wait
        return options

    def cause(self, signal_name: str) -> str:
        """The cause a worker killed by ``signal_name`` is reported with."""
        return signal_name if self.backend == "subprocess" else "actor process died (SYSTEM_ERROR)"

    def live(self) -> list[int]:
        """This backend's worker processes still alive."""
        return live_workers() if self.backend == "subprocess" else live_actors()


@pytest.fixture
def layout(request) -> Layout:
    """The layout a test is parametrised with (``layout`` indirect); starts Ray if needed."""
    chosen = request.param
    if chosen.backend == "ray":
        request.getfixturevalue("ray_cluster")
    return chosen


COLLECTION_HANG_S = 30.0  # no garbage collection of the suite takes a tenth of this


class CollectionWatchdog:
    """Ends the session, failed, if one garbage collection runs past ``COLLECTION_HANG_S``.

    A ``__del__`` or finalizer that deadlocks (a dropped vector closing through a thread
    pool, issue #45) would otherwise hang the suite for good: pytest-timeout's exception,
    raised inside the finalizer, is swallowed by the collector. The watchdog prints every
    thread's stack, then exits with status 3.
    """

    def __init__(self) -> None:
        self.started: float | None = None  # when the collection in progress began
        # pytest's capture owns fd 2 during a test; the report goes where the session's does.
        self.stderr_fd = os.dup(2)
        gc.callbacks.append(self.note)
        threading.Thread(target=self.watch, name="gc-watchdog", daemon=True).start()

    def note(self, phase: str, info: dict) -> None:
        self.started = time.monotonic() if phase == "start" else None

    def watch(self) -> None:
        while True:
            time.sleep(1.0)
            started = self.started
            if started is not None and time.monotonic() - started > COLLECTION_HANG_S:
                message = (
                    f"\nmultienv tests: a garbage collection has run for {COLLECTION_HANG_S:.0f} s;"
                    " a __del__ or finalizer hangs. Every thread's stack:\n"
                )
                os.write(self.stderr_fd, message.encode())
                faulthandler.dump_traceback(self.stderr_fd, all_threads=True)
                os._exit(3)


def pytest_configure(config: pytest.Config) -> None:
    CollectionWatchdog()
    # CPU claims of this session's vectors only: a training run or another test session on
    # the machine would otherwise leave the pinning tests no free CPU (cpu_claims).
    claims = tempfile.mkdtemp(prefix="multienv-claims-")
    os.environ[cpu_claims.DIR_VARIABLE] = claims
    config.add_cleanup(lambda: shutil.rmtree(claims, ignore_errors=True))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.path.isdir("/proc"):
        return
    leftovers = live_workers()
    if leftovers:
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"multienv: {len(leftovers)} worker process(es) outlived the tests: {leftovers}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def worker():
    """A worker's loop of k envs on a vector's real shared memory, done pipes and socket.

    ``worker(*env_fns)`` builds and resets the envs in this process and returns the shared
    batch, the loop (its envs a run, ``use``d as after ATTACH) and the parent's socket end.
    """
    made = []

    def make(*env_fns):
        probe = env_fns[0]()
        if not BatchLayout.supports(probe.observation_space):
            pytest.skip("shared memory needs Linux memfd_create")
        n = len(env_fns)
        shared = SharedBatch(probe.observation_space, probe.action_space, n, [[0]])
        layout = pickle.loads(pickle.dumps(shared.layout))  # as the worker receives it
        fds = tuple(os.dup(fd) for fd in shared.done.worker_fds(0))
        writer = SlotWriter(layout, os.dup(shared.fd), DoneNotifier(0, fds), range(n))
        runner = EnvRunner([cloudpickle.dumps(fn) for fn in env_fns])
        runner.build()
        for position, env in enumerate(runner.envs):
            env.reset(seed=position)
        worker_end, parent_end = socket.socketpair()
        loop = _Loop(worker_end, runner)
        loop.is_trimmed = True
        loop.use(writer)
        made.append((shared, worker_end, parent_end))
        return shared, loop, parent_end

    yield make
    for shared, worker_end, parent_end in made:
        worker_end.close()
        parent_end.close()
        shared.close()
