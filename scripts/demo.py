"""Run 8 CartPole envs in worker processes, kill one on purpose, and keep stepping.

Run: python scripts/demo.py
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time

import gymnasium as gym
import numpy as np

from multienv import MultiEnv


@dataclasses.dataclass
class Args:
    num_envs: int = 8  # envs, one worker process each
    steps: int = 3000  # vector steps to run
    kill_at: int = 1500  # vector step at which one worker is SIGKILLed
    seed: int = 0  # seeds the envs and the random actions


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def main(args: Args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rng = np.random.default_rng(args.seed)
    with MultiEnv([make_env] * args.num_envs) as envs:
        envs.reset(seed=args.seed)
        truncated_by_crash = 0
        began = time.perf_counter()
        for t in range(args.steps):
            if t == args.kill_at:
                os.kill(envs.envs[0].pid, signal.SIGKILL)
            actions = rng.integers(0, 2, size=args.num_envs)
            _, _, _, _, infos = envs.step(actions)
            truncated_by_crash += int(infos.get("_multienv", np.zeros(1, bool)).sum())
        elapsed = time.perf_counter() - began
        restarts = sum(row["restarts"] for row in envs.stats())
    steps = args.steps * args.num_envs
    print(
        f"{steps} env steps in {elapsed:.2f} s ({steps / elapsed:,.0f} steps/s); "
        f"restarts {restarts}; steps returned as crash truncations {truncated_by_crash}",
        file=sys.stderr,
    )
    return 0 if restarts == 1 else 1


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__)
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
