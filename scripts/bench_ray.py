"""Benchmark the Ray backend against the subprocess backend on this machine.

Run:
    pip install -e ".[ray]"
    python scripts/bench_ray.py              # 4 cells x 4 layouts, 3 rounds (~5 min on 2 cores)
    python scripts/bench_ray.py --rounds 1   # one round (~2 min)

Starts a local Ray cluster with as many CPUs as the machine has, then measures, in this one
process, steps/s of cheap (CartPole-v1) and heavy (1 ms of CPU per step) envs, N=8 and 16,
with ``envs_per_worker`` k in {1, 8} on each backend, interleaved over rounds; each ratio
is the median of the ratios measured within one round. Then: construction to first reset
of N=8 CartPoles per layout (actor start-up), the time from an actor's SIGKILL to that
env's next good step, and node loss on a two-node cluster (``tests/ray_node_loss.py``, in
a child process).
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
import tempfile
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py beside us

import bench

from multienv import MultiEnv, RayEnv, RestartPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [("subprocess", 1), ("subprocess", 8), ("ray", 1), ("ray", 8)]


@dataclasses.dataclass
class Args:
    cells: str = "cheap:8,cheap:16,heavy:8,heavy:16"  # workload:N, ...
    rounds: int = 3  # interleaved rounds; medians are reported
    seconds: float = 2.0  # wall time of each measurement
    kills: int = 10  # SIGKILLs of an actor for the respawn figure
    json_out: str = "bench-ray-results.json"  # where every sample is written


def throughput(fns: list[Any], backend: str, k: int, seconds: float) -> float:
    """Env steps per second of whole-batch steps over about ``seconds`` of wall time."""
    n = len(fns)
    with MultiEnv(fns, backend=backend, envs_per_worker=k) as envs:
        envs.reset(seed=0)
        actions = np.zeros(n, dtype=np.int64)
        for _ in range(20):
            envs.step(actions)
        steps, began = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - began) < seconds:
            for _ in range(10):
                envs.step(actions)
            steps += 10
        return steps * n / elapsed


def startup_s(backend: str, k: int, n: int = 8) -> float:
    began = time.perf_counter()
    with MultiEnv(
        [functools.partial(gym.make, "CartPole-v1")] * n, backend=backend, envs_per_worker=k
    ) as envs:
        envs.reset(seed=0)
        return time.perf_counter() - began


def actor_respawns(kills: int) -> list[float]:
    """Seconds from an actor's SIGKILL until its env has stepped again on a new actor."""
    proxy = RayEnv(
        functools.partial(gym.make, "CartPole-v1"),
        restart_policy=RestartPolicy(max_restarts=10_000),
    )
    proxy.start()
    proxy.initialize()
    proxy.reset(seed=0)
    times = []
    try:
        for _ in range(kills):
            assert proxy.pid is not None
            os.kill(proxy.pid, signal.SIGKILL)
            began = time.perf_counter()
            proxy.step(0)  # the flagged truncation, once a new actor is ready
            proxy.reset()
            proxy.step(0)
            times.append(time.perf_counter() - began)
    finally:
        proxy.close()
    return times


def node_loss() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.ray_node_loss"], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(args: Args) -> int:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cloudpickle.register_pickle_by_value(bench)  # actors need not import bench.py
    temp_dir = tempfile.mkdtemp(prefix="mrb", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        log_to_driver=False,
        include_dashboard=False,
        _temp_dir=temp_dir,
    )
    results: dict[str, Any] = {"args": dataclasses.asdict(args), "throughput": {}}
    try:
        for cell in args.cells.split(","):
            workload, _, n_text = cell.partition(":")
            n = int(n_text)
            factory = bench.WORKLOADS[workload][0]
            samples: dict[str, list[float]] = {f"{b} k={k}": [] for b, k in LAYOUTS}
            for round_index in range(args.rounds):
                for backend, k in LAYOUTS:
                    rate = throughput([factory] * n, backend, k, args.seconds)
                    samples[f"{backend} k={k}"].append(rate)
                    print(
                        f"{workload} N={n} round {round_index + 1}: {backend} k={k}: "
                        f"{rate:,.0f} steps/s",
                        file=sys.stderr,
                        flush=True,
                    )
            best_subprocess = [
                max(samples["subprocess k=1"][r], samples["subprocess k=8"][r])
                for r in range(args.rounds)
            ]
            print(f"\n{workload}, N={n}")
            print(f"{'layout':<16}{'steps/s':>10}{'x best subprocess':>20}")
            rows = {}
            for name, rates in samples.items():
                ratio = statistics.median(
                    rate / best for rate, best in zip(rates, best_subprocess, strict=True)
                )
                rows[name] = {"steps_per_s": statistics.median(rates), "x_subprocess": ratio}
                print(f"{name:<16}{statistics.median(rates):>10,.0f}{ratio:>20.2f}")
            results["throughput"][cell] = {"rows": rows, "samples": samples}
        print("\nconstruction + first reset, N=8 CartPole (median of 3):")
        results["startup_s_n8"] = {}
        for backend, k in LAYOUTS:
            seconds = statistics.median(startup_s(backend, k) for _ in range(3))
            results["startup_s_n8"][f"{backend} k={k}"] = seconds
            print(f"  {backend} k={k:<10}{seconds:>8.2f} s")
        respawns = actor_respawns(args.kills)
        results["actor_respawn_s"] = respawns
        print(
            f"\nactor SIGKILL to next good step: median {1000 * statistics.median(respawns):.0f}"
            f" ms, max {1000 * max(respawns):.0f} ms over {len(respawns)} kills"
        )
    finally:
        ray.shutdown()
    loss = node_loss()
    results["node_loss"] = loss
    print(f"\nnode loss (2 nodes, 3 actors x 2 envs, SPREAD): {loss}")
    with open(args.json_out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nall samples: {args.json_out}")
    return 0


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
