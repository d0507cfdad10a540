"""Does ``envs_per_worker="auto"`` pick a layout near the best, for envs that compute or wait?

Run:
    python scripts/bench_auto.py                       # N=8 and 16, about a minute
    python scripts/bench_auto.py --num-envs 16 --rounds 5
    python scripts/bench_auto.py --many 64,256         # many waiting envs: speed and memory
    python scripts/bench_auto.py --spinners 2          # with the cores shared

For each kind of env and each N it times the vector's env steps per second with one env per
worker (k=1), with as many workers as cores (k=ceil(N/cores)) and with ``"auto"``, in
interleaved rounds (best of the rounds), and prints auto's ratio to the faster of the two:

- computes: each step burns 0.5 ms of CPU;
- waits: each step sleeps 5 ms (I/O, a remote simulator);
- mixed: CartPole, but one env in four sleeps 5 ms per step (env 0 among them, so auto's
  probe of env 0 sees it wait);
- mixed, env 0 computes: the same with the waiting envs elsewhere.

Each row ends with the threads the workers started for waiting envs (the most of any
layout and round): none for envs that compute, however busy the machine (``--spinners 2``
runs two spinning processes meanwhile; a computing step then takes twice its CPU in wall
time, but never blocks, so it is not taken for one that waits).

A worker of several envs steps those that mostly wait at once, each on a thread of its own
(``multienv.worker.waiting``), so k=ceil(N/cores) waits about as long as k=1. ``--many``
times N envs that wait 5 ms each, with one env per worker (N processes) and with as many
workers as cores (their envs on threads), and adds the memory of each: the proportional
set size (PSS: shared pages split among the processes that share them) of all the
workers, and the processes' count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import gymnasium as gym
import numpy as np

from multienv import MultiEnv


@dataclasses.dataclass
class Args:
    num_envs: str = "8,16"  # the N to time, comma-separated
    rounds: int = 3  # interleaved rounds; the best of them counts
    seconds: float = 2.0  # per cell and round
    many: str = ""  # N of waiting envs to time for speed and memory instead (comma-separated)
    spinners: int = 0  # processes that spin on the cores meanwhile (a busy machine)


class Computes(gym.Wrapper):
    """CartPole whose step burns ``cpu_s`` of CPU first."""

    def __init__(self, cpu_s: float) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.cpu_s = cpu_s

    def step(self, action):
        until = time.process_time() + self.cpu_s
        while time.process_time() < until:
            pass
        return self.env.step(action)


class Waits(gym.Wrapper):
    """CartPole whose step sleeps ``wait_s`` first."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.wait_s = wait_s

    def step(self, action):
        time.sleep(self.wait_s)
        return self.env.step(action)


def computes(index: int) -> gym.Env:
    return Computes(0.5e-3)


def waits(index: int) -> gym.Env:
    return Waits(5e-3)


def mixed(index: int) -> gym.Env:
    return Waits(5e-3) if index % 4 == 0 else gym.make("CartPole-v1")


def mixed_env_0_computes(index: int) -> gym.Env:
    return Waits(5e-3) if index % 4 == 3 else gym.make("CartPole-v1")


KINDS = {
    "computes": computes,
    "waits": waits,
    "mixed": mixed,
    "mixed, env 0 computes": mixed_env_0_computes,
}


def steps_per_s(
    make, num_envs: int, layout, seconds: float
) -> tuple[float, int, tuple[float, int], int]:
    """Env steps/s of a vector of ``make(index)``, and what it ran as.

    Also its envs per worker, ``workers_pss_mb`` and the threads its workers started for
    waiting envs.
    """
    fns = [lambda index=index: make(index) for index in range(num_envs)]
    with MultiEnv(fns, envs_per_worker=layout) as envs:
        envs.reset(seed=0)
        before = threads(envs)
        actions = np.zeros(num_envs, dtype=np.int64)
        for _ in range(5):
            envs.step(actions)
        began, steps = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            envs.step(actions)
            steps += 1
        rate = steps * num_envs / (time.perf_counter() - began)
        started = threads(envs) - before
        return rate, envs.layout.envs_per_worker, workers_pss_mb(envs), started


def threads(envs: MultiEnv) -> int:
    """The threads of all the vector's workers (a waiting env's steps run on one more)."""
    total = 0
    for pid in {env.pid for env in envs.envs}:
        with open(f"/proc/{pid}/status") as status:
            total += next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return total


def workers_pss_mb(envs: MultiEnv) -> tuple[float, int]:
    """The workers' proportional set size in all, MB, and how many there are."""
    pids = {env.pid for env in envs.envs}
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024, len(pids)


def many(args: Args) -> None:
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; envs that wait 5 ms a step: env steps/s (best of {args.rounds})")
    for num_envs in [int(n) for n in args.many.split(",")]:
        for layout in (1, -(-num_envs // cores), "auto"):
            best, memory = 0.0, (0.0, 0)
            for _ in range(args.rounds):
                rate, chosen, memory, _ = steps_per_s(waits, num_envs, layout, args.seconds)
                best = max(best, rate)
            ceiling = num_envs / 5e-3
            print(
                f"N={num_envs:<4} k={chosen:<4}{' (auto)' if layout == 'auto' else '       '} "
                f"{best:8,.0f} env steps/s ({best / ceiling:.2f} of {ceiling:,.0f})  "
                f"{memory[1]:4} workers, PSS {memory[0]:8,.0f} MB"
            )


def main(args: Args) -> None:
    if args.many:
        many(args)
        return
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; env steps/s, best of {args.rounds} interleaved rounds")
    for num_envs in [int(n) for n in args.num_envs.split(",")]:
        batched = -(-num_envs // cores)
        for kind, make in KINDS.items():
            best = {"k=1": 0.0, f"k={batched}": 0.0, "auto": 0.0}
            chosen, on_threads = "", 0
            for _ in range(args.rounds):
                for name, layout in (("k=1", 1), (f"k={batched}", batched), ("auto", "auto")):
                    rate, picked, _, started = steps_per_s(make, num_envs, layout, args.seconds)
                    best[name] = max(best[name], rate)
                    on_threads = max(on_threads, started)
                    if name == "auto":
                        chosen = f"k={picked}"
            faster = max(best["k=1"], best[f"k={batched}"])
            cells = "  ".join(f"{name} {rate:8,.0f}" for name, rate in best.items())
            print(
                f"N={num_envs:<3} {kind:<22} {cells}  auto chose {chosen}: "
                f"{best['auto'] / faster:.2f}x the faster; envs on threads {on_threads}"
            )


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", default=Args.num_envs)
    parser.add_argument("--rounds", type=int, default=Args.rounds)
    parser.add_argument("--seconds", type=float, default=Args.seconds)
    parser.add_argument("--many", default=Args.many)
    parser.add_argument("--spinners", type=int, default=Args.spinners)
    return Args(**vars(parser.parse_args()))


def with_spinners(args: Args) -> None:
    """``main``, with ``args.spinners`` processes spinning on the cores meanwhile."""
    import subprocess
    import sys

    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(args.spinners)]
    if spinners:
        print(f"{len(spinners)} processes spin on the cores meanwhile")
    try:
        main(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


if __name__ == "__main__":
    with_spinners(parse_args())
