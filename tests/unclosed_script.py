"""Vectors and proxies dropped without close(): run by tests/test_unclosed.py in its own process.

``python -m tests.unclosed_script collect {lock,thread}`` drops one vector (or proxy) per
state of ``STATES`` and has the garbage collector free it while the collecting thread holds
``concurrent.futures``' module-wide ``_global_shutdown_lock`` (``lock``: the main thread;
``thread``: another thread, the vector being freed only by the cyclic collector). For each
it prints one JSON line: how long the collection took, whether the object is gone, how long
its workers took to die, whether a ResourceWarning named it, and the fds left over. A
collection that hangs never prints its line: the test's timeout names the state.

``python -m tests.unclosed_script train N`` steps N envs in a vector it never closes, after
printing READY, until it is interrupted (the Ctrl-C test).
"""

import concurrent.futures.thread
import gc
import json
import os
import signal
import sys
import threading
import time
import warnings
import weakref

import gymnasium as gym
import numpy as np

from multienv import MultiEnv, SubprocessEnv
from multienv.wire.procfs import process_table
from tests.envs import CountingEnv, HangOnStep, SlowReset


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def idle(k: int):
    envs = MultiEnv([CountingEnv] * 2, envs_per_worker=k)
    envs.reset(seed=0)
    return envs


def hanging(send: str):
    """Steps sent to workers that hang in them: ``step_async`` (a pool thread waits) or ``send``."""
    envs = MultiEnv([HangOnStep] * 2, autoreset_mode="Disabled")
    envs.reset(seed=0)
    getattr(envs, send)(np.zeros(2, dtype=np.int64))
    return envs


def mid_reset():
    """A pool thread waits on workers resetting for a minute (reset_async)."""
    envs = MultiEnv([lambda: SlowReset(60.0)] * 2)
    envs.reset_async(seed=0)
    return envs


def after_crash():
    """A worker was SIGKILLed and the vector has not noticed yet."""
    envs = idle(1)
    pid = envs.envs[0].pid
    os.kill(pid, signal.SIGKILL)
    wait_dead([pid], 5.0)
    return envs


def lone_proxy():
    env = SubprocessEnv(CountingEnv)
    env.start()
    env.initialize()
    env.reset(seed=0)
    return env


STATES = {
    "idle": lambda: idle(1),
    "idle k=2": lambda: idle(2),
    "mid-step": lambda: hanging("step_async"),
    "mid-reset": mid_reset,
    "after a crash": after_crash,
    "in send": lambda: hanging("send"),
    "lone proxy": lone_proxy,
}


def pids_of(dropped) -> list[int]:
    proxies = dropped.envs if isinstance(dropped, MultiEnv) else [dropped]
    return sorted({proxy.pid for proxy in proxies})


def wait_dead(pids: list[int], within_s: float) -> float | None:
    """Seconds until every pid is a zombie or gone; None if some still run after ``within_s``."""
    began = time.monotonic()
    while time.monotonic() - began < within_s:
        table = process_table()
        if all(pid not in table or table[pid].state == "Z" for pid in pids):
            return time.monotonic() - began
        time.sleep(0.005)
    return None


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_left(baseline: int, within_s: float = 2.0) -> int:
    """Fds open beyond ``baseline`` once the pool threads and the stderr relay let go."""
    deadline = time.monotonic() + within_s
    while (extra := open_fds() - baseline) > 0 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return extra


def drop_and_collect(state: str, how: str) -> dict:
    dropped = STATES[state]()
    pids = pids_of(dropped)
    gone = weakref.ref(dropped)
    lock = concurrent.futures.thread._global_shutdown_lock
    elapsed: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.disable()  # only the collection below frees it
        began = time.monotonic()
        if how == "lock":
            with lock:  # as a thread inside another executor's submit() holds it
                del dropped
                gc.collect()
                elapsed.append(time.monotonic() - began)
        else:
            del dropped

            def collect() -> None:
                with lock:
                    gc.collect()
                    elapsed.append(time.monotonic() - began)

            collector = threading.Thread(target=collect)
            collector.start()
            collector.join()
        gc.enable()
    return {
        "state": state,
        "collect_s": elapsed[0],
        "is_gone": gone() is None,
        "dead_after_s": wait_dead(pids, 1.0),
        "warnings": [str(w.message) for w in caught if w.category is ResourceWarning],
    }


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def collect(how: str) -> None:
    idle(1).close()  # the module server, the stderr relay: opened once per process
    baseline = open_fds()
    for state in STATES:
        row = drop_and_collect(state, how)
        row["fds_left"] = fds_left(baseline)
        say(json.dumps(row))
    say(json.dumps({"threads_left": [t.name for t in threading.enumerate()]}))


def train(num_envs: int) -> None:
    envs = MultiEnv([cartpole] * num_envs)  # never closed, as in a CleanRL-style loop
    envs.reset(seed=0)
    say("READY")
    while True:
        envs.step(envs.action_space.sample())


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(sys.argv[2])
    else:
        train(int(sys.argv[2]))
