"""Workers after a process's first one fork from a module server that has the env's modules.

Each test runs a fresh interpreter: a process has one module server, started by the first
worker that reports its modules, so the test session's own server cannot be started again.
"""

import json
import os

import pytest

import multienv
from tests.conftest import wait_until_dead
from tests.test_fork_source import needs_immortal_objects
from tests.test_forkserver import run_python

_MEMORY_SCRIPT = """
import json, os
import gymnasium as gym
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server

def private_mib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_")) / 1024

class Collecting(gym.Wrapper):  # a full collection at every reset, as long runs do
    def reset(self, **kwargs):
        import gc

        gc.collect()
        return super().reset(**kwargs)

def make_env():
    env = gym.make("CartPole-v1")
    return Collecting(env) if os.environ.get("COLLECT") else env

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: a probe goes first
    with MultiEnv([make_env] * n) as envs:
        envs.reset(seed=0)
        for _ in range(100):
            envs.step(np.zeros(n, dtype=np.int64))
        server = module_server.running()
        parents = [int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1])
                   for p in envs.envs]
        print(json.dumps({
            "server": server and server._process.pid,
            "parents": parents,
            "mib": [private_mib(proxy.pid) for proxy in envs.envs],
        }))
"""

# Measured on the 2-core development machine (CPython 3.11, numpy 2.4, gymnasium 1.4):
# 5.6 MiB for the workers forked from the module server (7.3 for one that imported
# CartPole's module itself). The bound leaves room for other versions.
CARTPOLE_WORKER_BOUND_MIB = 8.0
# On CPython 3.12 and 3.13 the server's objects are immortal: 2.6 MiB measured (3.12).
CARTPOLE_IMMORTAL_BOUND_MIB = 4.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collect", [False, True], ids=["plain", "full-gc-every-reset"])
def test_a_cartpole_worker_forked_from_the_module_server_stays_small(collect):
    # With a full collection in the worker, the bound holds only because the processes
    # workers fork from freeze their objects (gc.freeze): without it, the collection writes
    # to every inherited object and the worker copies their pages (12.5 MiB here).
    done = run_python(["-c", _MEMORY_SCRIPT], env={"COLLECT": "1"} if collect else {})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["server"] is not None
    assert set(report["parents"]) == {report["server"]}  # every worker forked from it
    for mib in report["mib"]:
        assert mib < CARTPOLE_WORKER_BOUND_MIB, report


_SERVER_DEATH_SCRIPT = """
import os, signal
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.conftest import wait_until_dead
from tests.envs import CountingEnv

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0)) + 1
    with MultiEnv([lambda: CountingEnv(episode_length=1000)] * n) as envs:
        envs.reset(seed=0)
        server = module_server.running()
        assert server is not None, "no module server"
        served = [proxy.pid for proxy in envs.envs]  # a probe started it: all forked from it
        os.kill(server._process.pid, signal.SIGKILL)
        wait_until_dead(served)  # its workers die with it (PR_SET_PDEATHSIG)
        obs, rewards, terminations, truncations, infos = envs.step(np.ones(n, dtype=np.int64))
        assert truncations.all(), truncations
        assert infos["multienv"]["_restarted"].all()
        assert module_server.running() is None
        for _ in range(5):  # respawned from the forkserver, and stepping
            obs, *_ = envs.step(np.ones(n, dtype=np.int64))
        assert [proxy.restarts for proxy in envs.envs] == [1] * n
        assert all(proxy.pid not in served for proxy in envs.envs)
        print("ok")
"""


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_when_the_module_server_dies_its_workers_are_respawned_from_the_forkserver():
    done = run_python(
        ["-c", _SERVER_DEATH_SCRIPT.replace('if __name__ == "__main__":', "if True:")]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"


_GONE_READER_SCRIPT = """
import os, signal, time
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.conftest import wait_until_dead
from tests.envs import CountingEnv

if True:  # run with -c: no script file for workers to import
    with MultiEnv([lambda: CountingEnv(episode_length=1000)] * 3) as envs:
        envs.reset(seed=0)
        server = module_server.running()
        assert server is not None, "no module server"
        # Worker 0's status pipe loses its only reader, as when the parent dies: its sentinel
        # fd now reads another pipe, which the test keeps.
        process = envs.envs[0].supervisor.handle._process
        spare_read, spare_write = os.pipe()
        os.dup2(spare_read, process.sentinel)
        os.kill(process.pid, signal.SIGKILL)
        wait_until_dead([process.pid])
        time.sleep(0.5)  # the server reaps it and finds no one to tell
        assert module_server.running() is server, "the module server died"
        os.kill(envs.envs[1].pid, 0)  # its other workers live on (no PR_SET_PDEATHSIG)
        os.write(spare_write, bytes(4))  # the status worker 0's handle waits for
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        assert [proxy.restarts for proxy in envs.envs] == [1, 0, 0]
        print("ok")
"""


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_a_worker_whose_status_has_no_reader_left_does_not_take_the_server_down():
    # The parent killed with SIGKILL closes every status pipe while its workers exit: the
    # server printed a BrokenPipeError traceback and died, taking the live workers along.
    done = run_python(["-c", _GONE_READER_SCRIPT])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


_LARGE_FACTORY_SCRIPT = """
import functools, os
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.envs import CountingEnv

def make_env(payload):
    return CountingEnv(episode_length=int(payload[0]) + 5)

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0)) + 1
    payload = np.zeros(300_000, dtype=np.uint8)  # 300 KB: more than a datagram holds
    with MultiEnv([functools.partial(make_env, payload)] * n) as envs:
        envs.reset(seed=0)
        assert module_server.running() is not None
        obs, *_ = envs.step(np.ones(n, dtype=np.int64))
        assert obs.ravel().tolist() == [1.0] * n
        print("ok")
"""


@pytest.mark.timeout(60)
def test_factories_too_large_for_one_request_start_from_the_forkserver():
    done = run_python(["-c", _LARGE_FACTORY_SCRIPT])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert "module server failed" not in done.stderr


_PROBE_FAILS_SCRIPT = """
import os, threading
from multienv import EnvError, MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.conftest import live_workers
from tests.envs import CountingEnv, RaiseInInit

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: a probe builds env 0
    lock = threading.Lock()
    try:  # bad input is found before anything starts, the probe included
        MultiEnv([CountingEnv] * (n - 1) + [lambda: lock and CountingEnv()])
    except TypeError as exc:
        print(str(exc).split(":")[0].replace(" ", "_"))
    assert not module_server.has_tried()
    try:
        MultiEnv([RaiseInInit] + [CountingEnv] * (n - 1))
    except EnvError as exc:
        print(exc.env_index, type(exc).__name__, "cannot build this env" in str(exc))
    assert live_workers() == [], live_workers()
    assert not module_server.has_tried()  # the probe reported no modules to import
    with MultiEnv([CountingEnv] * n) as envs:  # the next vector probes again, and shares
        assert module_server.running() is not None
        envs.reset(seed=0)
    print("ok")
"""


@pytest.mark.timeout(60)
def test_bad_input_stops_before_the_probe_and_a_failing_env_0_leaves_no_worker():
    done = run_python(["-c", _PROBE_FAILS_SCRIPT])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        f"env_{len(os.sched_getaffinity(0))}",  # the last env, n - 1
        "0",
        "EnvError[RuntimeError]",
        "True",
        "ok",
    ]


_PROBE_SEGFAULTS_SCRIPT = """
import os
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.conftest import live_workers
from tests.envs import CountingEnv, _crash_once, segfault

def make_env():
    if _crash_once(os.environ["MARKER"]):  # the probe, the first to build env 0, crashes
        segfault()
    return CountingEnv()

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: a probe builds env 0
    with MultiEnv([make_env] * n) as envs:
        server = module_server.running()
        assert server is not None  # the respawned probe reported the modules
        parents = {int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1])
                   for p in envs.envs}
        assert parents == {server._process.pid}, parents
        assert [proxy.restarts for proxy in envs.envs] == [0] * n  # the probe's is its own
        envs.reset(seed=0)
        envs.step(np.zeros(n, dtype=np.int64))
    assert live_workers() == [], live_workers()
    print("ok")
"""


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_a_probe_that_segfaults_is_respawned_and_the_vector_still_shares(tmp_path):
    done = run_python(["-c", _PROBE_SEGFAULTS_SCRIPT], env={"MARKER": str(tmp_path / "m")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert (tmp_path / "m").exists()  # it did crash once


_NO_FORKSERVER_SCRIPT = """
import json, os
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.wire.procfs import process_table
from tests.envs import CountingEnv

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0))  # no probe: the first workers fork at once
    with MultiEnv([CountingEnv] * n) as envs:
        envs.reset(seed=0)
        os.chdir(os.environ["ELSEWHERE"])
        with MultiEnv([CountingEnv]) as later:  # forked after the parent moved
            later.reset(seed=0)
            table = process_table()
            cmdlines = {}
            for pid, entry in table.items():
                if entry.ppid == os.getpid():
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdlines[pid] = f.read().decode(errors="replace")
            print(json.dumps({
                "server": module_server.running()._process.pid,
                "children": cmdlines,
                "worker_parents": [table[p.pid].ppid for p in envs.envs + later.envs],
                "cwd_of_later": os.readlink(f"/proc/{later.envs[0].pid}/cwd"),
            }))
"""


@pytest.mark.timeout(60)
def test_workers_fork_from_the_module_server_alone_in_the_parents_current_directory(tmp_path):
    # No multiprocessing forkserver and no resource tracker: two Python processes less.
    done = run_python(["-c", _NO_FORKSERVER_SCRIPT], env={"ELSEWHERE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    children = report["children"]
    assert [int(pid) for pid in children] == [report["server"]], children
    assert not any("forkserver" in cmd or "resource_tracker" in cmd for cmd in children.values())
    assert set(report["worker_parents"]) == {report["server"]}
    assert report["cwd_of_later"] == str(tmp_path)


def run_with_threaded_package(directory, script):
    """Run ``script`` beside a package that starts a thread when imported, as some do.

    The package's ``make()`` returns a CountingEnv. Returns the finished run, which exited 0.
    """
    (directory / "threaded_package.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
        "def make():\n"
        "    from tests.envs import CountingEnv\n"
        "    return CountingEnv()\n"
    )
    done = run_python(["-c", script], path=[directory])
    assert done.returncode == 0, done.stderr[-3000:]
    return done


_THREAD_AT_IMPORT_SCRIPT = """
import json, os, signal
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.wire.procfs import process_table
from tests.conftest import wait_until_dead

def make_env():
    import threaded_package  # starts a thread when imported, as some packages do
    return threaded_package.make()

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0))  # no probe: the first workers fork at once
    with MultiEnv([make_env] * n) as first:
        first.reset(seed=0)
        server = module_server.running()._process.pid
        with MultiEnv([make_env]) as later:  # the server refuses the modules: forkserver
            later.reset(seed=0)
            table = process_table()
            first_pids = [p.pid for p in first.envs]
            before = list(first_pids)
            first.step(np.ones(n, dtype=np.int64))
            print(json.dumps({
                "server": server,
                "server_alive": module_server.running() is not None,
                "first_parents": [table[p].ppid for p in first_pids],
                "first_kept": [p.pid for p in first.envs] == before,
                "later_parent": table[later.envs[0].pid].ppid,
                "later_restarts": later.envs[0].restarts,
            }))
"""


@pytest.mark.timeout(60)
def test_env_modules_that_start_a_thread_leave_the_servers_workers_and_use_the_forkserver(
    tmp_path,
):
    done = run_with_threaded_package(tmp_path, _THREAD_AT_IMPORT_SCRIPT)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # The server forked the first workers, then refused the modules; they keep running.
    assert set(report["first_parents"]) == {report["server"]}
    assert report["first_kept"]
    assert report["server_alive"]
    assert report["later_parent"] != report["server"]  # from multiprocessing's forkserver
    assert report["later_restarts"] == 0
    assert "refused the env's modules; workers start from the forkserver" in done.stderr


@needs_immortal_objects
@pytest.mark.timeout(120)
def test_workers_of_an_immortal_server_copy_2_mib_fewer_pages():
    # Measured on CPython 3.12 (2-core machine): 2.6 MiB per CartPole worker, against 4.6
    # with MULTIENV_IMMORTALIZE=0, which leaves the server's objects mortal.
    reports = {}
    for variable in ("1", "0"):
        done = run_python(["-c", _MEMORY_SCRIPT], env={"MULTIENV_IMMORTALIZE": variable})
        assert done.returncode == 0, done.stderr[-2000:]
        reports[variable] = json.loads(done.stdout.strip().splitlines()[-1])
        assert set(reports[variable]["parents"]) == {reports[variable]["server"]}
    immortal, mortal = (max(reports[v]["mib"]) for v in ("1", "0"))
    assert immortal < CARTPOLE_IMMORTAL_BOUND_MIB < mortal, reports
    assert mortal - immortal > 1.0, reports


_THREADED_SCRIPT = """
import json, os, threading, time
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.wire.procfs import process_table
from tests.envs import CountingEnv

# At the top level: it runs in every process that imports the script, fork sources too.
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()

if __name__ == "__main__":
    with MultiEnv([CountingEnv] * 3) as envs:
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        table = process_table()
        parents = {table[proxy.pid].ppid for proxy in envs.envs}
        commands = [open(f"/proc/{pid}/cmdline").read() for pid in parents]
        print(json.dumps({
            "server": module_server.running() is not None,
            "commands": commands,
            "obs": obs.ravel().tolist(),
        }))
"""


@pytest.mark.timeout(60)
def test_a_script_that_starts_a_thread_at_import_gets_its_workers_from_the_forkserver(tmp_path):
    script = tmp_path / "threaded.py"
    script.write_text(_THREADED_SCRIPT)
    done = run_python([str(script)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["server"]  # it refused to fork with a thread running
    assert report["commands"]
    assert all("multiprocessing.forkserver" in command for command in report["commands"])
    assert report["obs"] == [1.0, 1.0, 1.0]
    assert "module server did not start; workers start from the forkserver" in done.stderr


_LAUNCH_AFTER_REFUSAL_SCRIPT = """
import multiprocessing, os
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.backends.subprocess.forking.module_server_process import WorkerArgs
from multienv.wire.worker_settings import WorkerSettings

def make_env():
    import threaded_package  # starts a thread when imported
    return threaded_package.make()

if True:  # run with -c: no script file for workers to import
    n = len(os.sched_getaffinity(0))
    with MultiEnv([make_env] * n) as first:
        server = module_server.running()
        with MultiEnv([make_env]):  # the server imports the modules, and refuses
            pass
        # A launch that raced the refusal (another thread had the server already):
        mine, theirs = multiprocessing.Pipe()
        err_read, err_write = multiprocessing.Pipe(duplex=False)
        args = WorkerArgs([], 0, os.getpid(), WorkerSettings(), os.getcwd())
        try:
            server.launch(theirs, err_write, args, "late")
        except OSError as exc:
            print("OSError", "forked no worker" in str(exc))
        else:
            print("launched")
"""


@pytest.mark.timeout(60)
def test_a_launch_that_reaches_a_refusing_server_raises_instead_of_returning_a_process(
    tmp_path,
):
    done = run_with_threaded_package(tmp_path, _LAUNCH_AFTER_REFUSAL_SCRIPT)
    assert done.stdout.split()[-2:] == ["OSError", "True"]


_KILLED_BEFORE_READY_SCRIPT = """
import json, os, signal
import numpy as np
import multienv
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.wire.procfs import process_table
from tests.envs import CountingEnv

if True:  # run with -c: no script file for workers to import
    multienv.start_forkserver()
    os.kill(module_server.running()._process.pid, signal.SIGKILL)  # still importing
    with MultiEnv([CountingEnv] * 3) as envs:
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        table = process_table()
        parents = {table[proxy.pid].ppid for proxy in envs.envs}
        print(json.dumps({
            "server": module_server.running() is not None,
            "commands": [open(f"/proc/{pid}/cmdline").read() for pid in parents],
            "obs": obs.ravel().tolist(),
        }))
"""


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_a_module_server_killed_before_it_serves_leaves_the_first_vector_to_the_forkserver():
    done = run_python(["-c", _KILLED_BEFORE_READY_SCRIPT])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["server"]
    assert report["commands"]
    assert all("multiprocessing.forkserver" in command for command in report["commands"])
    assert report["obs"] == [1.0, 1.0, 1.0]
    assert "module server did not start; workers start from the forkserver" in done.stderr


_SPARES_SCRIPT = """
import json, os, signal, sys, time
import numpy as np
import multienv
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from multienv.wire.procfs import process_table
from tests.conftest import wait_until_dead
from tests.envs import CountingEnv

def spares(server, count, within_s=10.0):
    deadline = time.monotonic() + within_s
    while True:
        table = process_table()
        found = sorted(pid for pid, entry in table.items()
                       if entry.ppid == server and entry.name == "multienv-spare")
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)

if True:  # run with -c: no script file for workers to import
    multienv.start_forkserver(spares=int(sys.argv[1]))
    n = 3
    report = {}
    with MultiEnv([lambda: CountingEnv(episode_length=1000)] * n) as first:
        first.reset(seed=0)
        server = module_server.running()._process.pid
        wait_s = 3.0 if sys.argv[1] == "0" else 10.0  # none come: 15 times SPARE_IDLE_S
        report["after_first"] = ahead = spares(server, n, within_s=wait_s)
        if ahead:
            os.kill(ahead[0], signal.SIGKILL)  # dead before its request: never handed one
            wait_until_dead(ahead[:1])
        with MultiEnv([lambda: CountingEnv(episode_length=1000)] * n) as later:
            later.reset(seed=0)
            report["later"] = [proxy.pid for proxy in later.envs]
            table = process_table()
            report["later_parents"] = [table[pid].ppid for pid in report["later"]]
            refilled = spares(server, n)
            os.kill(later.envs[1].pid, signal.SIGKILL)
            wait_until_dead(report["later"][1:2])
            obs, rewards, terminations, truncations, infos = later.step(np.ones(n, dtype=np.int64))
            assert truncations.tolist() == [False, True, False], truncations
            obs, *_ = later.step(np.ones(n, dtype=np.int64))
            report["obs"] = obs.ravel().tolist()
            report["respawned"] = later.envs[1].pid
            report["refilled"] = refilled
        report["server"] = server
    print(json.dumps(report))
"""


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_later_vectors_and_respawns_take_the_spares_the_server_forked_ahead():
    done = run_python(["-c", _SPARES_SCRIPT, "64"])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # As many spares as the first vector had workers; one was killed before its turn.
    assert len(report["after_first"]) == 3
    assert report["later"][0] not in report["after_first"][:1]
    taken = set(report["later"]) & set(report["after_first"][1:])
    assert len(taken) == 2, report  # the two live spares, and one fork
    assert set(report["later_parents"]) == {report["server"]}
    assert report["respawned"] in report["refilled"]  # a respawn takes a spare too
    assert report["obs"] == [2.0, 0.0, 2.0]  # env 1 reset after its truncation
    # Spares die with the server, which exits with its parent (the script).
    wait_until_dead(report["refilled"], within_s=10.0)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(60)
def test_no_spare_is_forked_with_spares_0():
    done = run_python(["-c", _SPARES_SCRIPT, "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_first"] == []
    assert report["refilled"] == []
    assert report["obs"] == [2.0, 0.0, 2.0]  # env 1 reset after its truncation


@pytest.mark.timeout(30)
def test_start_forkserver_refuses_a_negative_number_of_spares():
    with pytest.raises(ValueError, match="spares must be an int >= 0, got -1"):
        multienv.start_forkserver(spares=-1)


_HIGH_FDS_SCRIPT = """
import json, logging, os
import numpy as np
from multienv import MultiEnv
from multienv.backends.subprocess.forking import module_server
from tests.envs import CountingEnv

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("multienv").addHandler(Keep(logging.WARNING))

if True:  # run with -c: no script file for workers to import
    # Hundreds of workers' pipes: every fd from here on is past select()'s 1023.
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: the module server's
    kinds = []
    for _ in range(2):  # the server starts with the first vector; the second finds it
        envs = MultiEnv([CountingEnv] * n)
        kinds.append(sorted({type(g.supervisor.handle._process).__name__
                             for g in envs._fan_out.groups}))
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(n, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0] * n
        envs.close()
    print(json.dumps({"kinds": kinds, "warnings": warnings,
                      "server": module_server.running() is not None}))
"""


def test_a_vector_whose_fds_are_past_1023_is_served_steps_and_closes():
    # select() refuses fds past 1023, which a vector of hundreds of workers opens: the
    # module server died in its loop (its workers forked by forkserver instead, with a
    # warning), and close() raised ValueError polling a served worker's exit status.
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1300:
        pytest.skip("this process may not open 1300 fds")
    run = run_python(["-c", _HIGH_FDS_SCRIPT])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["warnings"] == []
    assert result["server"]
    assert result["kinds"] == [["ServedProcess"]] * 2
