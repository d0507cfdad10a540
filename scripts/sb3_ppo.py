"""Stable-Baselines3 PPO on CartPole with 8 multienv envs, optionally under chaos.

Run (after ``pip install -e ".[sb3]"``; on a machine without a GPU install the CPU build of
torch first, see README.rst):
    python scripts/sb3_ppo.py                           # 100k steps, then 20 test episodes
    python scripts/sb3_ppo.py --chaos-kill-every 200    # SIGKILL a random worker every 200 steps

PPO's hyperparameters are those of the RL Zoo for CartPole-v1. The envs run in
``multienv.sb3.MultiEnvVecEnv``; a killed worker reaches PPO as a time-limit truncation,
which it bootstraps. After training, ``multienv.evaluate`` runs 20 episodes with the
deterministic policy; exit 0 if their mean return is at least ``--target``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import time

import gymnasium as gym
import numpy as np
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecMonitor

from multienv import MultiEnv, RestartPolicy, evaluate
from multienv.sb3 import MultiEnvVecEnv


class Chaos(BaseCallback):
    """SIGKILLs a random worker every ``every`` env steps; prints progress every second."""

    def __init__(self, every: int, seed: int) -> None:
        super().__init__()
        self.every, self.next_kill, self.kills = every, every, 0
        self.rng = np.random.default_rng(seed)
        self.last_print = time.monotonic()

    def _on_step(self) -> bool:
        if self.every and self.num_timesteps >= self.next_kill:
            self.next_kill += self.every
            envs = self.training_env.unwrapped.envs
            victim = envs[int(self.rng.integers(len(envs)))]
            if victim.pid is not None:
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass
        if time.monotonic() - self.last_print >= 1.0:
            self.last_print = time.monotonic()
            returns = [info["r"] for info in self.model.ep_info_buffer]
            mean = f"{np.mean(returns):7.1f}" if returns else "      -"
            print(
                f"steps {self.num_timesteps:>8,}  mean return {mean}  kills {self.kills}",
                file=sys.stderr,
                flush=True,
            )
        return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-timesteps", type=int, default=100_000)
    parser.add_argument("--chaos-kill-every", type=int, default=0, help="0 turns it off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=475.0, help="mean test return")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # a chaos run logs a warning per kill

    make = functools.partial(gym.make, "CartPole-v1")
    policy = RestartPolicy(max_restarts=100_000 if args.chaos_kill_every else 5, window_s=60.0)
    env = VecMonitor(MultiEnvVecEnv([make] * 8, restart_policy=policy))
    env.seed(args.seed)
    began = time.monotonic()
    try:
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=lambda progress: 1e-3 * progress,
            clip_range=lambda progress: 0.2 * progress,
            seed=args.seed,
            device="cpu",
        )
        chaos = Chaos(args.chaos_kill_every, args.seed + 1)
        model.learn(total_timesteps=args.total_timesteps, callback=chaos)
        restarts = sum(row["restarts"] for row in env.unwrapped.stats())
    finally:
        env.close()
    with MultiEnv([make] * 4) as test_envs:
        result = evaluate(
            test_envs, lambda obs: model.predict(obs, deterministic=True)[0], 20, seed=1000
        )
    print(
        f"{args.total_timesteps:,} steps in {time.monotonic() - began:.0f} s; workers killed "
        f"{chaos.kills}, env restarts {restarts}; test mean return {result.mean_return:.1f} "
        f"over {len(result.returns)} episodes"
    )
    return 0 if result.mean_return >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
