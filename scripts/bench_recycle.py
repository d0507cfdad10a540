"""What a worker recycle costs the step that makes it, against a step with a plain autoreset.

Run:
    python scripts/bench_recycle.py [--num-envs 8] [--steps 20000] [--max-episodes 10]

Times every ``MultiEnv.step`` on CartPole (next-step autoreset, one env per worker) with
``RecyclePolicy(max_episodes=...)``, and sorts the steps in three kinds: a step in which
some env's worker was swapped for its pre-started replacement, a step in which some env was
reset by the autoreset (no swap), a step right after a swap (the new worker's first step),
and a step of stepping only. Prints the median and p90 of each, in milliseconds, and the
same for a vector without recycling.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

from multienv import MultiEnv, RecyclePolicy


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def time_steps(num_envs: int, steps: int, recycle: RecyclePolicy | None) -> dict[str, list[float]]:
    """Step times in ms by kind: "recycle", "autoreset", "after swap", "step"."""
    kinds: dict[str, list[float]] = {"recycle": [], "autoreset": [], "after swap": [], "step": []}
    rng = np.random.default_rng(0)
    with MultiEnv([make_env] * num_envs, recycle=recycle) as envs:
        envs.reset(seed=0)
        done = np.zeros(num_envs, dtype=bool)
        swapped = False
        for _ in range(steps):
            actions = rng.integers(0, 2, num_envs)
            began = time.perf_counter()
            _obs, _rewards, terminated, truncated, infos = envs.step(actions)
            elapsed = 1e3 * (time.perf_counter() - began)
            recycled = infos.get("multienv", {}).get("_recycled")
            if recycled is not None and recycled.any():
                kinds["recycle"].append(elapsed)
            elif done.any():
                kinds["autoreset"].append(elapsed)
            elif swapped:
                kinds["after swap"].append(elapsed)
            else:
                kinds["step"].append(elapsed)
            done = terminated | truncated
            swapped = recycled is not None and bool(recycled.any())
        recycles = sum(row["recycles"] for row in envs.stats())
    print(f"  {recycles} recycles in {steps} steps")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--max-episodes", type=int, default=10)
    args = parser.parse_args()
    for label, recycle in (
        ("without recycling", None),
        (f"RecyclePolicy(max_episodes={args.max_episodes})", RecyclePolicy(args.max_episodes)),
    ):
        print(f"{label}, {args.num_envs} CartPole envs, one per worker:")
        for kind, times in time_steps(args.num_envs, args.steps, recycle).items():
            if times:
                p50, p90 = np.percentile(times, [50, 90])
                print(f"  {kind:<10} {len(times):>6} steps  median {p50:6.3f} ms  p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()
