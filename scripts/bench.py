"""Benchmark multienv against Gymnasium on CartPole, and time a respawn after SIGKILL.

Run: python scripts/bench.py [--num-envs 8] [--steps 2000] [--rounds 3] [--kills 50]

Implementations are interleaved in rounds and the median per implementation is reported,
with ratios to the sequential loop and to AsyncVectorEnv measured in the same run. This is
the first part of the benchmark that issue 5 asks for (cheap workload only, no SB3 or
Tianshou yet); it writes its results as JSON next to the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from multienv import MultiEnv, RestartPolicy, SubprocessEnv


@dataclasses.dataclass
class Args:
    num_envs: int = 8  # envs per vector
    steps: int = 2000  # vector steps timed per implementation per round
    rounds: int = 3  # interleaved rounds; the median is reported
    kills: int = 50  # SIGKILLs for the respawn measurement
    json_out: str = "bench-results.json"  # where the figures are written


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def time_sequential(args: Args) -> float:
    envs = [make_env() for _ in range(args.num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    began = time.perf_counter()
    for _ in range(args.steps):
        for env in envs:
            _, _, terminated, truncated, _ = env.step(0)
            if terminated or truncated:
                env.reset()
    return args.steps * args.num_envs / (time.perf_counter() - began)


def time_vector(build: Callable[[], Any], args: Args) -> float:
    envs = build()
    try:
        envs.reset(seed=0)
        actions = np.zeros(args.num_envs, dtype=np.int64)
        for _ in range(100):
            envs.step(actions)
        began = time.perf_counter()
        for _ in range(args.steps):
            envs.step(actions)
        return args.steps * args.num_envs / (time.perf_counter() - began)
    finally:
        envs.close()


def time_respawns(args: Args) -> list[float]:
    """Seconds from a worker's SIGKILL until its env has stepped again after the restart."""
    proxy = SubprocessEnv(make_env, restart_policy=RestartPolicy(max_restarts=10_000))
    proxy.start()
    proxy.initialize()
    proxy.reset(seed=0)
    times = []
    try:
        for _ in range(args.kills):
            os.kill(proxy.pid, signal.SIGKILL)
            began = time.perf_counter()
            proxy.step(0)  # returns the flagged truncation once the new worker is ready
            proxy.reset()
            proxy.step(0)
            times.append(time.perf_counter() - began)
    finally:
        proxy.close()
    return times


def main(args: Args) -> int:
    fns = [make_env] * args.num_envs
    implementations: dict[str, Callable[[], float]] = {
        "sequential loop": lambda: time_sequential(args),
        "gymnasium SyncVectorEnv": lambda: time_vector(lambda: gym.vector.SyncVectorEnv(fns), args),
        "gymnasium AsyncVectorEnv": lambda: time_vector(
            lambda: gym.vector.AsyncVectorEnv(fns, shared_memory=True), args
        ),
        "multienv MultiEnv": lambda: time_vector(lambda: MultiEnv(fns), args),
    }
    samples: dict[str, list[float]] = {name: [] for name in implementations}
    for round_index in range(args.rounds):
        for name, measure in implementations.items():
            samples[name].append(measure())
            print(
                f"round {round_index + 1}: {name}: {samples[name][-1]:,.0f} steps/s",
                file=sys.stderr,
            )
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"\nCartPole-v1, {args.num_envs} envs, median of {args.rounds} rounds")
    print(f"{'implementation':<28}{'steps/s':>10}{'x loop':>9}{'x Async':>9}")
    for name, value in medians.items():
        print(
            f"{name:<28}{value:>10,.0f}{value / medians['sequential loop']:>9.2f}"
            f"{value / medians['gymnasium AsyncVectorEnv']:>9.2f}"
        )
    respawns = time_respawns(args)
    median_ms = 1000 * statistics.median(respawns)
    print(
        f"\nSIGKILL to next good step of that env: median {median_ms:.1f} ms, "
        f"max {1000 * max(respawns):.1f} ms over {len(respawns)} kills"
    )
    with open(args.json_out, "w") as f:
        json.dump(
            {"args": dataclasses.asdict(args), "steps_per_s": samples, "respawn_s": respawns},
            f,
            indent=1,
        )
    return 0


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default
        )
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
