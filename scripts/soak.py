"""Soak test: many faults of every kind for M minutes; exit 0 only if every check held.

Run:
    python scripts/soak.py --minutes 30          (the long run; --minutes 1 with -m slow)
    python scripts/soak.py --minutes 3 --max-rss-mb 0 --envs-per-worker 2 --kill-every-s 0.5
                                                 (no recycling: plain steps take the data
                                                 plane, whose hand-overs it then soaks)

Eight envs by default, each with a role:

- leaky: keeps 20 KiB more per step; recycled by ``RecyclePolicy(max_rss_mb=...)``;
- flaky: its worker is SIGKILLed by this script at random, about every ``--kill-every-s``;
- hangs: now and then sleeps past ``step_timeout`` in ``step`` (killed, respawned);
- raises: now and then raises in ``step`` (``EnvError``; the other envs' results ride on it);
- normal: the rest.

Steps alternate between plain ``step`` and ``send``/``recv``. Observations describe
themselves: ``[env index, episode id, step in episode]``, the episode id drawn fresh at each
reset, so a spliced episode (a step that continues another episode, or skips one) is seen.
Once a minute, and at the end, it prints and checks:

- every batch complete: each step answered for every env (or named it in an ``EnvError``);
- no episode spliced; every crash truncation flagged with a cause;
- the parent's open fds, threads and resident memory flat: sampled every 2 s after a
  warm-up (10% of the run, 5 to 60 s), the lowest of the last fifth of the samples against
  the lowest of the first fifth (a replacement worker waiting to take over holds a few fds
  and threads for a while, so single samples go up and down);
- no zombie child and no orphaned worker;
- ``stats()`` restarts equal to the kills and hangs injected, and one ``EnvError`` per raise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np

from multienv import EnvError, MultiEnv, RecyclePolicy, RestartPolicy
from multienv.wire.procfs import process_table, resident_mb
from multienv.worker.worker import OS_NAME_PREFIX

ROLES = ("leaky", "flaky", "hangs", "raises")


class SoakEnv(gym.Env):
    """Self-describing observations; faults by role, each written to ``fault_log`` first."""

    def __init__(self, env_index: int, role: str, fault_log: str, hang_s: float) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.env_index, self.role, self.fault_log, self.hang_s = env_index, role, fault_log, hang_s
        self.episode_id = 0
        self.count = 0
        self.leaked: list[bytes] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.episode_id = int.from_bytes(os.urandom(6), "little")  # unique, never reused
        self.count = 0
        return self._obs(), {}

    def step(self, action):
        draw = self.np_random.random()
        if self.role == "hangs" and draw < 1 / 3000:
            self._log("hang")
            time.sleep(self.hang_s)
        if self.role == "raises" and draw < 1 / 1500:
            self._log("raise")
            raise ValueError("soak: an occasional env error")
        if self.role == "leaky":
            self.leaked.append(b"x" * 20_480)
        self.count += 1
        terminated = draw < 1 / 40  # episodes of 40 steps on average
        return self._obs(), 1.0, terminated, False, {}

    def _log(self, kind: str) -> None:
        with open(self.fault_log, "a") as f:
            f.write(kind + "\n")

    def _obs(self) -> np.ndarray:
        return np.array([self.env_index, self.episode_id, self.count], dtype=np.float64)


@dataclasses.dataclass
class Health:
    """What the parent holds: open fds, threads, resident memory (MiB)."""

    fds: int
    threads: int
    rss_mb: float

    @classmethod
    def now(cls) -> Health:
        return cls(len(os.listdir("/proc/self/fd")), threading.active_count(), resident_mb() or 0.0)


def zombies_and_orphans() -> tuple[list[int], list[int]]:
    """Our zombie children, and multienv workers whose parent died (adopted by init)."""
    me, table = os.getpid(), process_table().values()
    zombies = [p.pid for p in table if p.ppid == me and p.state == "Z"]
    orphans = [p.pid for p in table if p.name.startswith(OS_NAME_PREFIX) and p.ppid == 1]
    return zombies, orphans


class Soak:
    """Drives the envs, injects the kills, and keeps every check's state."""

    def __init__(self, args: argparse.Namespace, fault_dir: pathlib.Path) -> None:
        self.args = args
        self.n = args.num_envs
        self.roles = [ROLES[i] if i < len(ROLES) else "normal" for i in range(self.n)]
        self.fault_logs = [str(fault_dir / f"env{i}.log") for i in range(self.n)]
        self.rng = np.random.default_rng(args.seed)
        self.steps = 0
        self.kills = 0
        self.env_errors = 0
        self.failures: list[str] = []
        self.last_obs: np.ndarray | None = None
        self.episode_ids: list[set[int]] = [set() for _ in range(self.n)]  # recent, per env
        self.samples: list[Health] = []  # every 2 s after the warm-up
        self.next_kill = time.monotonic() + self._kill_gap()

    def make_envs(self) -> MultiEnv:
        hang_s = self.args.step_timeout * 3
        fns = [
            functools.partial(SoakEnv, i, self.roles[i], self.fault_logs[i], hang_s)
            for i in range(self.n)
        ]
        recycle = None  # --max-rss-mb 0: no recycling, so plain steps take the data plane
        if self.args.max_rss_mb > 0:
            recycle = RecyclePolicy(max_rss_mb=self.args.max_rss_mb, check_every_s=0.5)
        return MultiEnv(
            fns,
            envs_per_worker=self.args.envs_per_worker,
            step_timeout=self.args.step_timeout,
            reset_timeout=self.args.step_timeout,
            restart_policy=RestartPolicy(max_restarts=1000, window_s=60.0),
            recycle=recycle,
        )

    def run(self) -> int:
        envs = self.make_envs()
        began = last_report = time.monotonic()
        ends = began + 60 * self.args.minutes
        warm = began + min(60.0, max(5.0, 6 * self.args.minutes))  # the health baseline
        try:
            obs, _ = envs.reset(seed=self.args.seed)
            self.last_obs = obs.copy()
            for row in obs:
                self.episode_ids[int(row[0])].add(int(row[1]))
            while time.monotonic() < ends:
                if time.monotonic() < ends - 2.0:  # the last kill is noticed before the end
                    self.maybe_kill(envs)
                self.one_step(envs, use_send=self.steps % 2 == 1)
                if time.monotonic() >= warm + 2 * len(self.samples):
                    self.samples.append(Health.now())
                if time.monotonic() - last_report >= 60:
                    last_report = time.monotonic()
                    self.report(envs, time.monotonic() - began)
            for _ in range(3):  # let the last faults be noticed and counted
                self.one_step(envs, use_send=False)
            return self.report(envs, time.monotonic() - began, final=True)
        finally:
            envs.close()

    def _kill_gap(self) -> float:
        return float(self.rng.exponential(self.args.kill_every_s))

    def maybe_kill(self, envs: MultiEnv) -> None:
        if time.monotonic() < self.next_kill:
            return
        self.next_kill = time.monotonic() + self._kill_gap()
        pid = envs.envs[self.roles.index("flaky")].pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self.kills += 1

    def one_step(self, envs: MultiEnv, use_send: bool) -> None:
        actions = self.rng.integers(0, 2, self.n)
        failed: list[int] = []
        if use_send:
            envs.send(actions)
            rows: dict[int, tuple[Any, ...]] = {}
            remaining = set(range(self.n))
            while remaining - set(rows):
                try:
                    obs, rewards, terminated, truncated, infos = envs.recv()
                except EnvError as error:
                    self.env_errors += 1
                    failed.append(int(error.env_index))
                    remaining.discard(int(error.env_index))
                    continue
                for j, env_index in enumerate(infos["env_id"].tolist()):
                    rows[env_index] = (obs[j], rewards[j], terminated[j], truncated[j], infos, j)
            self.check_rows(rows, failed)
        else:
            try:
                obs, rewards, terminated, truncated, infos = envs.step(actions)
            except EnvError as error:
                self.env_errors += len(error.failed_env_ids or [error.env_index])
                failed = list(error.failed_env_ids or [error.env_index])
                if error.results is None:  # a step error always carries them
                    raise
                obs, rewards, terminated, truncated, infos = error.results
            rows = {
                i: (obs[i], rewards[i], terminated[i], truncated[i], infos, i)
                for i in range(self.n)
                if i not in failed
            }
            self.check_rows(rows, failed)
        self.steps += 1

    def check_rows(self, rows: dict[int, tuple[Any, ...]], failed: list[int]) -> None:
        """Every env answered or raised; no episode spliced; every crash flagged."""
        assert self.last_obs is not None
        missing = set(range(self.n)) - set(rows) - set(failed)
        if missing:
            self.fail(f"step {self.steps}: no result for envs {sorted(missing)}")
        for i, (obs, _reward, terminated, truncated, infos, j) in rows.items():
            before = self.last_obs[i]
            crash = infos.get("multienv", {})
            is_crash = bool(crash.get("_restarted", np.zeros(j + 1, bool))[j])
            if int(obs[0]) != i:
                self.fail(f"step {self.steps}: env {i} returned env {int(obs[0])}'s observation")
            if is_crash:
                if not truncated or not crash["cause"][j]:
                    self.fail(f"step {self.steps}: env {i} crash not flagged as a truncation")
                if not np.array_equal(obs, before):  # next-step: the final obs is the last seen
                    self.fail(f"step {self.steps}: env {i} crash obs is not the last one seen")
            elif before[2] == -1:  # the previous step ended the episode: this is the reset
                recent = self.episode_ids[i]
                if obs[2] != 0 or int(obs[1]) in recent:
                    self.fail(f"step {self.steps}: env {i} reset into a used episode {obs}")
                if len(recent) >= 1000:  # bounded, so that this script's memory stays flat
                    recent.clear()
                recent.add(int(obs[1]))
            elif obs[1] != before[1] or obs[2] != before[2] + 1:
                self.fail(f"step {self.steps}: env {i} spliced: {before} then {obs}")
            self.last_obs[i] = obs
            if terminated or truncated:
                self.last_obs[i, 2] = -1  # marks "the next result is a reset"

    def growth(self) -> Health:
        """How much the parent's holdings grew: the last fifth's lows over the first fifth's."""
        samples = self.samples or [Health.now()]
        fifth = max(1, len(samples) // 5)
        first, last = samples[:fifth], samples[-fifth:]
        return Health(
            min(h.fds for h in last) - min(h.fds for h in first),
            min(h.threads for h in last) - min(h.threads for h in first),
            min(h.rss_mb for h in last) - min(h.rss_mb for h in first),
        )

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            print(f"FAIL {message}", file=sys.stderr, flush=True)
        self.failures.append(message)

    def shares_flaky_worker(self) -> bool:
        """Whether the leaky env's worker is the flaky one's, killed every few seconds."""
        k = self.args.envs_per_worker
        return self.roles.index("leaky") // k == self.roles.index("flaky") // k

    def injected(self) -> dict[str, int]:
        counts = {"kill": self.kills, "hang": 0, "raise": 0}
        for path in self.fault_logs:
            if os.path.exists(path):
                for line in pathlib.Path(path).read_text().split():
                    counts[line] += 1
        return counts

    def report(self, envs: MultiEnv, elapsed: float, final: bool = False) -> int:
        stats = envs.stats()
        first_envs = stats[:: self.args.envs_per_worker]  # a worker counts for each env
        restarts = sum(row["restarts"] for row in first_envs)
        recycles = sum(row["recycles"] for row in first_envs)
        injected = self.injected()
        health = Health.now()
        growth = self.growth()
        zombies, orphans = zombies_and_orphans()
        checks = {
            "batches complete, no splice": not self.failures,
            "restarts == kills + hangs": restarts == injected["kill"] + injected["hang"],
            "EnvErrors == raises": self.env_errors == injected["raise"],
            # With several envs per worker the leaky env shares the flaky one's worker,
            # which the kills respawn long before it holds max_rss_mb: nothing to recycle.
            "recycled the leaky env": recycles > 0
            or elapsed < 30
            or not self.args.max_rss_mb
            or self.shares_flaky_worker(),
            "no zombie or orphan": not zombies and not orphans,
            "fds flat": growth.fds <= 1,
            "threads flat": growth.threads <= 1,
            "RSS flat": growth.rss_mb <= 20,
        }
        print(
            f"{'FINAL ' if final else ''}{elapsed / 60:5.1f} min  steps {self.steps:,} "
            f"({self.steps * self.n:,} env steps)  injected kill {injected['kill']} hang "
            f"{injected['hang']} raise {injected['raise']}  restarts {restarts}  recycles "
            f"{recycles}  EnvErrors {self.env_errors}  parent fds {health.fds} threads "
            f"{health.threads} RSS {health.rss_mb:.0f} MiB  zombies {len(zombies)} orphans "
            f"{len(orphans)}",
            flush=True,
        )
        bad = [name for name, held in checks.items() if not held]
        if bad or final:
            print(
                f"  checks: {'all held' if not bad else 'FAILED: ' + ', '.join(bad)}; parent "
                f"growth (lows of the last fifth over the first of {len(self.samples)} "
                f"samples): fds {growth.fds:+d}, threads {growth.threads:+d}, RSS "
                f"{growth.rss_mb:+.1f} MiB",
                flush=True,
            )
        return 0 if not bad else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run")
    parser.add_argument("--num-envs", type=int, default=8, help="envs (the first 4 have roles)")
    parser.add_argument("--kill-every-s", type=float, default=2.0, help="mean gap between kills")
    parser.add_argument("--step-timeout", type=float, default=0.5, help="seconds per step")
    parser.add_argument(
        "--max-rss-mb", type=float, default=150.0, help="recycle above this; 0: no recycling"
    )
    parser.add_argument("--envs-per-worker", type=int, default=1, help="envs each worker hosts")
    parser.add_argument("--seed", type=int, default=0, help="seeds the envs and the faults")
    args = parser.parse_args(argv)
    if args.num_envs < len(ROLES):
        parser.error(f"--num-envs must be at least {len(ROLES)} (one env per role)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="multienv-soak-") as fault_dir:
        return Soak(args, pathlib.Path(fault_dir)).run()


if __name__ == "__main__":
    sys.exit(main())
