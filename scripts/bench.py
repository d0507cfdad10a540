"""Benchmark multienv against Gymnasium, SB3 and Tianshou; time start-up, respawn and memory.

Run:
    python scripts/bench.py              # 4 workloads x N in {2, 8, 16}, 3 rounds (~15 min)
    python scripts/bench.py --quick      # N = 8 only, 1 round (~2 min)
    pip install -e ".[bench]"            # adds SB3 and Tianshou to the comparison

Workloads: cheap (CartPole-v1), heavy (1 ms of CPU per step), bigobs (210x160x3 uint8
observations), straggler (0.2 ms of CPU per step; 5% of steps also sleep 10 ms).
Implementations are interleaved in rounds; each figure is the median over rounds, and each
ratio is the median of the ratios measured within one round, so a noisy neighbour slows
both sides of a ratio alike. "multienv async" keeps every env in flight with
``send``/``recv(batch_size=N // 2)``; the others step the whole batch in lock step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from multienv import MultiEnv, RestartPolicy, SubprocessEnv


@dataclasses.dataclass
class Args:
    num_envs: str = "2,8,16"  # comma-separated values of N
    workloads: str = "cheap,heavy,bigobs,straggler"  # comma-separated
    rounds: int = 3  # interleaved rounds; medians are reported
    seconds: float = 1.0  # rough wall time of one measurement
    kills: int = 50  # SIGKILLs for the respawn measurement
    quick: bool = False  # N = 8 and 1 round only
    json_out: str = "bench-results.json"  # where every sample is written
    child: str = ""  # internal: run one fresh-process measurement and print it as JSON


# ----------------------------------------------------------------- workloads


def spin_cpu(seconds: float) -> None:
    """Burn this much CPU time (not wall time, which other processes would eat)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class HeavyEnv(gym.Env):
    """1 ms of CPU per step; episodes of 200 steps."""

    def __init__(self, cpu_s: float = 1e-3) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.cpu_s, self.t = cpu_s, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        spin_cpu(self.cpu_s)
        self.t += 1
        return np.full(4, self.t / 200, dtype=np.float32), 1.0, self.t >= 200, False, {}


class BigObsEnv(gym.Env):
    """Atari-sized uint8 frames; episodes of 500 steps."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, shape=(210, 160, 3), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.frame = np.zeros((210, 160, 3), dtype=np.uint8)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.frame[:] = 0
        return self.frame.copy(), {}

    def step(self, action):
        self.t += 1
        self.frame[self.t % 210] = self.t % 256  # one row changes, as a cheap game would
        return self.frame.copy(), 0.0, self.t >= 500, False, {}


class StragglerEnv(gym.Env):
    """0.2 ms of CPU per step; 5% of steps also wait 10 ms (I/O, a slow simulator call)."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        spin_cpu(2e-4)
        if self.np_random.random() < 0.05:
            time.sleep(0.01)
        self.t += 1
        return np.zeros(4, dtype=np.float32), 1.0, self.t >= 200, False, {}


WORKLOADS: dict[str, tuple[Callable[[], gym.Env], int]] = {
    # name: (env factory, env steps per second one process does, roughly; sizes each run)
    "cheap": (functools.partial(gym.make, "CartPole-v1"), 60_000),
    "heavy": (HeavyEnv, 1_000),
    "bigobs": (BigObsEnv, 20_000),
    "straggler": (StragglerEnv, 1_500),
}


# ----------------------------------------------------------------- implementations


def run_loop(fns: list[Callable[[], gym.Env]], vector_steps: int) -> float:
    envs = [fn() for fn in fns]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    began = time.perf_counter()
    for _ in range(vector_steps):
        for env in envs:
            _, _, terminated, truncated, _ = env.step(0)
            if terminated or truncated:
                env.reset()
    return vector_steps * len(envs) / (time.perf_counter() - began)


def run_vector(build: Callable[[], Any], n: int, vector_steps: int) -> float:
    """Steps/s of a vector env with Gymnasium's (or SB3's) autoresetting ``step``."""
    envs = build()
    try:
        envs.reset()
        actions = np.zeros(n, dtype=np.int64)
        for _ in range(20):
            envs.step(actions)
        began = time.perf_counter()
        for _ in range(vector_steps):
            envs.step(actions)
        return vector_steps * n / (time.perf_counter() - began)
    finally:
        envs.close()


def run_tianshou(fns: list[Callable[[], gym.Env]], vector_steps: int) -> float:
    from tianshou.env import ShmemVectorEnv

    n = len(fns)
    envs = ShmemVectorEnv(fns)
    try:
        envs.reset()
        actions = np.zeros(n, dtype=np.int64)
        began = time.perf_counter()
        for _ in range(vector_steps):
            _, _, terminated, truncated, _ = envs.step(actions)
            done = np.flatnonzero(np.logical_or(terminated, truncated))
            if done.size:
                envs.reset(done)  # Tianshou leaves resets to the caller
        return vector_steps * n / (time.perf_counter() - began)
    finally:
        envs.close()


def run_multienv_async(fns: list[Callable[[], gym.Env]], vector_steps: int) -> float:
    n = len(fns)
    batch_size = max(1, n // 2)
    with MultiEnv(fns) as envs:
        envs.reset()
        envs.send(np.zeros(n, dtype=np.int64))
        actions = np.zeros(batch_size, dtype=np.int64)
        target = vector_steps * n
        done = 0
        began = time.perf_counter()
        while done < target:
            *_, infos = envs.recv(batch_size=batch_size)
            done += batch_size
            envs.send(actions, infos["env_id"])
        rate = done / (time.perf_counter() - began)
        envs.recv()
    return rate


def implementations(fns: list[Callable[[], gym.Env]]) -> dict[str, Callable[[int], float]]:
    n = len(fns)
    impls: dict[str, Callable[[int], float]] = {
        "sequential loop": lambda steps: run_loop(fns, steps),
        "gymnasium SyncVectorEnv": lambda steps: run_vector(
            lambda: gym.vector.SyncVectorEnv(fns), n, steps
        ),
        "gymnasium AsyncVectorEnv": lambda steps: run_vector(
            lambda: gym.vector.AsyncVectorEnv(fns, shared_memory=True), n, steps
        ),
    }
    try:
        from stable_baselines3.common.vec_env import SubprocVecEnv

        impls["SB3 SubprocVecEnv"] = lambda steps: run_vector(lambda: SubprocVecEnv(fns), n, steps)
    except ImportError:
        pass
    try:
        import tianshou  # noqa: F401

        impls["Tianshou ShmemVectorEnv"] = lambda steps: run_tianshou(fns, steps)
    except ImportError:
        pass
    impls["multienv sync"] = lambda steps: run_vector(lambda: MultiEnv(fns), n, steps)
    impls["multienv async"] = lambda steps: run_multienv_async(fns, steps)
    return impls


# ----------------------------------------------------------------- throughput table


def measure_throughput(args: Args, workload: str, n: int) -> dict[str, Any]:
    factory, single_rate = WORKLOADS[workload]
    fns = [factory] * n
    impls = implementations(fns)
    # Size a run so the sequential loop takes about args.seconds; parallel ones take less.
    vector_steps = max(20, int(single_rate * args.seconds / n))
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for round_index in range(args.rounds):
        for name, run in impls.items():
            samples[name].append(run(vector_steps))
            print(
                f"{workload} N={n} round {round_index + 1}: {name}: "
                f"{samples[name][-1]:,.0f} steps/s",
                file=sys.stderr,
                flush=True,
            )
    rows = {}
    for name, values in samples.items():
        rows[name] = {
            "steps_per_s": statistics.median(values),
            "x_loop": statistics.median(
                v / loop for v, loop in zip(values, samples["sequential loop"], strict=True)
            ),
            "x_async": statistics.median(
                v / ref for v, ref in zip(values, samples["gymnasium AsyncVectorEnv"], strict=True)
            ),
            "samples": values,
        }
    return rows


def print_table(workload: str, n: int, rows: dict[str, Any]) -> None:
    print(f"\n{workload}, N={n}")
    print(f"{'implementation':<26}{'steps/s':>10}{'x loop':>9}{'x Async':>9}")
    for name, row in rows.items():
        print(f"{name:<26}{row['steps_per_s']:>10,.0f}{row['x_loop']:>9.2f}{row['x_async']:>9.2f}")


# ----------------------------------------------------------------- start-up, respawn, memory

_STARTUP_CODE = """
import functools, time, gymnasium as gym
began = time.perf_counter()
from {module} import {name}
envs = {build}
envs.reset(seed=0)
print(time.perf_counter() - began)
envs.close()
"""


def time_startup(n: int, repeats: int = 3) -> dict[str, float]:
    """Seconds from constructing N CartPole envs to the first reset, each in a fresh process."""
    fns = f"[functools.partial(gym.make, 'CartPole-v1')] * {n}"
    builds = {
        "gymnasium AsyncVectorEnv": (
            "gymnasium.vector",
            "AsyncVectorEnv",
            f"AsyncVectorEnv({fns})",
        ),
        "multienv": ("multienv", "MultiEnv", f"MultiEnv({fns})"),
    }
    results = {}
    for label, (module, name, build) in builds.items():
        code = _STARTUP_CODE.format(module=module, name=name, build=build)
        times = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, check=True
                ).stdout.split()[-1]
            )
            for _ in range(repeats)
        ]
        results[label] = statistics.median(times)
    return results


def preload_for(label: str) -> list[str]:
    """CartPole's module for a ``"..., preload"`` label, else nothing."""
    return ["gymnasium.envs.classic_control.cartpole"] if label.endswith("preload") else []


def time_respawns(kills: int, preload: list[str]) -> list[float]:
    """Seconds from a worker's SIGKILL until its env has stepped again after the restart."""
    proxy = SubprocessEnv(
        functools.partial(gym.make, "CartPole-v1"),
        restart_policy=RestartPolicy(max_restarts=10_000),
        preload=preload,
    )
    proxy.start()
    proxy.initialize()
    proxy.reset(seed=0)
    times = []
    try:
        for _ in range(kills):
            os.kill(proxy.pid, signal.SIGKILL)
            began = time.perf_counter()
            proxy.step(0)  # returns the flagged truncation once the new worker is ready
            proxy.reset()
            proxy.step(0)
            times.append(time.perf_counter() - began)
    finally:
        proxy.close()
    return times


def private_mb(pid: int) -> float:
    """Private (unshared) resident memory of a process, in MiB, from smaps_rollup."""
    total_kb = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def measure_memory(label: str, n: int = 8) -> float:
    """Median private memory per worker process after 100 steps of N CartPole envs."""
    fns = [functools.partial(gym.make, "CartPole-v1")] * n
    if label == "gymnasium AsyncVectorEnv":
        envs: Any = gym.vector.AsyncVectorEnv(fns, shared_memory=True)
        pids = [p.pid for p in envs.processes]
    else:
        envs = MultiEnv(fns, preload=preload_for(label))
        pids = [env.pid for env in envs.envs]
    try:
        envs.reset(seed=0)
        for _ in range(100):
            envs.step(np.zeros(n, dtype=np.int64))
        return statistics.median(private_mb(pid) for pid in pids)
    finally:
        envs.close()


MEMORY_LABELS = ["gymnasium AsyncVectorEnv", "multienv", "multienv, preload"]
RESPAWN_LABELS = ["multienv", "multienv, preload"]


def run_child(args: Args) -> int:
    """One measurement in this fresh process (a forkserver starts once per process)."""
    kind, _, label = args.child.partition(":")
    if kind == "memory":
        print(json.dumps(measure_memory(label)))
    else:
        print(json.dumps(time_respawns(args.kills, preload_for(label))))
    return 0


def in_fresh_process(args: Args, child: str) -> Any:
    """Run ``bench.py --child child`` and return what it printed."""
    command = [sys.executable, __file__, "--child", child, "--kills", str(args.kills)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main(args: Args) -> int:
    if args.child:
        return run_child(args)
    sizes = [8] if args.quick else [int(v) for v in args.num_envs.split(",")]
    if args.quick:
        args.rounds = 1
    results: dict[str, Any] = {"args": dataclasses.asdict(args), "throughput": {}}
    for workload in args.workloads.split(","):
        for n in sizes:
            rows = measure_throughput(args, workload, n)
            results["throughput"][f"{workload}/N={n}"] = rows
            print_table(workload, n, rows)
    startup = time_startup(16)
    results["startup_s_n16"] = startup
    print("\nstart-up, N=16 CartPole, construct + first reset, fresh process (median of 3):")
    for label, seconds in startup.items():
        print(f"  {label:<26}{seconds:>8.2f} s")
    # Each in a fresh process, so that preload reaches a forkserver of its own.
    memory = {label: in_fresh_process(args, f"memory:{label}") for label in MEMORY_LABELS}
    results["private_mb_per_worker"] = memory
    print("\nprivate memory per worker, N=8 CartPole (median):")
    for label, mb in memory.items():
        print(f"  {label:<26}{mb:>8.1f} MiB")
    print("\nSIGKILL to next good step of that env, CartPole:")
    for label in RESPAWN_LABELS:
        respawns = in_fresh_process(args, f"respawn:{label}")
        results[f"respawn_s, {label}"] = respawns
        print(
            f"  {label:<26}median {1000 * statistics.median(respawns):.1f} ms, "
            f"max {1000 * max(respawns):.1f} ms over {len(respawns)} kills"
        )
    with open(args.json_out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nall samples: {args.json_out}")
    return 0


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(field.default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
