"""Benchmark ``MultiEnv.step_batch`` against a local loop over the same (state, action) pairs.

Run:
    python scripts/bench_planning.py             # M in {8, 32, 128}, dt=5, 2 workers, 3 rounds
    python scripts/bench_planning.py --sizes 32  # the issue's cell only

A planner's unit of work is a pair: restore a state, repeat an action ``dt`` times, keep
the state reached. The local loop does that for M pairs in this process; multienv spreads
them over its workers, one request per worker, with its workers sleeping between calls
(the default) and in hot mode (``wait="spin"``). Three envs: CartPole with ``get_state`` /
``set_state`` (the planning convention, a few numbers per state), the same with each state
one numpy array (as plangym passes them: a share's states then travel as one array), and
plain ``gym.make("CartPole-v1")``, whose state is the whole env pickled. Rounds are
interleaved; each ratio is the median of the ratios within one round.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from multienv import MultiEnv


class PlanningCartPole(CartPoleEnv):
    """CartPole with ``get_state()`` / ``set_state()``; truncates itself at 500 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, _, info = super().step(action)
        self.t += 1
        return obs, reward, terminated, self.t >= 500, info

    def get_state(self) -> tuple[np.ndarray, Any, int]:
        return np.array(self.state, dtype=np.float64), self.steps_beyond_terminated, self.t

    def set_state(self, state: tuple[np.ndarray, Any, int]) -> None:
        physics, self.steps_beyond_terminated, self.t = state
        self.state = np.array(physics, dtype=np.float64)


class ArrayStateCartPole(PlanningCartPole):
    """Its state is one float64 array: the physics, ``steps_beyond_terminated`` and ``t``."""

    def get_state(self) -> np.ndarray:  # type: ignore[override]
        beyond = -1 if self.steps_beyond_terminated is None else self.steps_beyond_terminated
        return np.array([*self.state, beyond, self.t], dtype=np.float64)

    def set_state(self, state: np.ndarray) -> None:  # type: ignore[override]
        self.state = state[:4].copy()
        self.steps_beyond_terminated = None if state[4] < 0 else int(state[4])
        self.t = int(state[5])


ENVS: dict[str, Callable[[], gym.Env]] = {
    "CartPole get_state": PlanningCartPole,
    "CartPole array state": ArrayStateCartPole,
    "CartPole pickled": functools.partial(gym.make, "CartPole-v1"),
}


@dataclasses.dataclass
class Args:
    sizes: str = "8,32,128"  # M, the pairs per call
    dt: int = 5  # steps per pair
    workers: int = 2  # worker processes
    rounds: int = 3  # interleaved rounds; medians are reported
    seconds: float = 1.0  # wall time of each measurement


def local_pairs_per_s(factory: Callable[[], gym.Env], m: int, dt: int, seconds: float) -> float:
    env = factory()
    env.reset(seed=0)
    is_pickled = not hasattr(env, "get_state")
    snapshot: Callable[[], Any] = (lambda: pickle.dumps(env)) if is_pickled else env.get_state
    states = [snapshot()] * m
    actions = np.arange(m) % 2  # the actions step_batch gets: numpy integers
    pairs, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        for j in range(m):
            if is_pickled:
                env = pickle.loads(states[j])
            else:
                env.set_state(states[j])
            for _ in range(dt):
                _, _, terminated, truncated, _ = env.step(actions[j])
                if terminated or truncated:
                    break
            snapshot() if not is_pickled else pickle.dumps(env)
        pairs += m
    return pairs / elapsed


def multienv_pairs_per_s(envs: MultiEnv, m: int, dt: int, seconds: float) -> float:
    # The local loop's start: env 0 just reset with seed 0. Not the envs' current state,
    # which earlier calls moved on, into episodes that end within dt steps.
    envs.reset(seed=0)
    states = [envs.get_states()[0]] * m
    actions = np.arange(m) % 2
    envs.step_batch(actions, states, dt=dt)
    pairs, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        envs.step_batch(actions, states, dt=dt)
        pairs += m
    return pairs / elapsed


def main(args: Args) -> int:
    sizes = [int(m) for m in args.sizes.split(",")]
    for name, factory in ENVS.items():
        with (
            MultiEnv([factory] * args.workers) as envs,
            MultiEnv([factory] * args.workers, wait="spin") as hot,
        ):
            envs.reset(seed=0)
            hot.reset(seed=0)
            print(f"\n{name}, dt={args.dt}, {args.workers} workers")
            columns = [("M", 5), ("local pairs/s", 16), ("multienv", 10), ("x local", 9)]
            columns += [("spin", 10), ("x local", 9)]
            print("".join(f"{title:>{width}}" for title, width in columns))
            for m in sizes:
                local, ours, spun = [], [], []
                for _ in range(args.rounds):
                    local.append(local_pairs_per_s(factory, m, args.dt, args.seconds))
                    ours.append(multienv_pairs_per_s(envs, m, args.dt, args.seconds))
                    spun.append(multienv_pairs_per_s(hot, m, args.dt, args.seconds))
                ratio = statistics.median(o / lo for o, lo in zip(ours, local, strict=True))
                hot_ratio = statistics.median(o / lo for o, lo in zip(spun, local, strict=True))
                print(
                    f"{m:>5}{statistics.median(local):>16,.0f}{statistics.median(ours):>10,.0f}"
                    f"{ratio:>9.2f}{statistics.median(spun):>10,.0f}{hot_ratio:>9.2f}",
                    flush=True,
                )
    return 0


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
