"""Recording for the example training scripts: progress lines, returns.csv and curve.png.

``Recorder`` counts env steps and episode returns (thread-safe, for a3c.py's learners),
prints a progress line on stderr every ``progress_every_s``, and at the end writes the
returns and the learning curve (with matplotlib, when it is installed) to the run's folder.
"""

from __future__ import annotations

import csv
import datetime
import pathlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np


class Recorder:
    """Counts env steps and episode returns (thread-safe), prints progress, writes outputs."""

    def __init__(self, args: Any, out_dir: pathlib.Path, algorithm: str) -> None:
        self.args, self.out_dir, self.algorithm = args, out_dir, algorithm
        self.env_steps = 0
        self.rows: list[dict[str, Any]] = []
        self.recent: deque[float] = deque(maxlen=args.window)
        self.kill_steps: list[int] = []
        self.began = time.perf_counter()
        self.last_print = 0.0
        self.lock = threading.Lock()  # a3c.py's learner threads share one recorder
        self.is_stopped = False  # set by stop(), e.g. when one learner thread failed

    def add_steps(self, count: int) -> int:
        with self.lock:
            self.env_steps += count
            return self.env_steps

    def episode(self, episode_return: float, was_crashed: bool) -> None:
        with self.lock:
            self.rows.append(
                {
                    "episode": len(self.rows),
                    "env_steps": self.env_steps,
                    "return": episode_return,
                    "ended_by_crash": was_crashed,
                }
            )
            if not was_crashed:  # a crash cuts an episode short; it says nothing of the policy
                self.recent.append(episode_return)

    def stop(self) -> None:
        self.is_stopped = True

    @property
    def is_done(self) -> bool:
        return self.is_stopped or self.is_solved or self.env_steps >= self.args.total_steps

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.recent)) if self.recent else float("nan")

    @property
    def is_solved(self) -> bool:
        return len(self.recent) == self.args.window and self.mean_return >= self.args.target_return

    def progress(
        self,
        restarts: int,
        force: bool = False,
        timing: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Print a progress line when one is due.

        ``timing``: the vector's ``timing``; its split since the last line shows how
        env-bound the run is.
        """
        env_steps = self.env_steps
        now = time.perf_counter()
        if not force and now - self.last_print < self.args.progress_every_s:
            return
        self.last_print = now
        rate = env_steps / max(now - self.began, 1e-9)
        bound = f"  env-bound {timing()['env_bound']:4.0%}" if timing is not None else ""
        is_tty = sys.stderr.isatty()  # redraw one line on a terminal, else one line each
        print(
            "\r" if is_tty else "",
            f"steps {env_steps:>9,}  {rate:>7,.0f} steps/s  "
            f"episodes {len(self.rows):>5}  mean return {self.mean_return:7.1f}  "
            f"restarts {restarts}{bound}",
            sep="",
            end="" if is_tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def summary(self, restarts: int, losses: dict[str, float]) -> int:
        """Print the final line; return the exit code (0 when solved)."""
        self.progress(restarts, force=True)
        self.write()
        elapsed = time.perf_counter() - self.began
        status = "solved" if self.is_solved else "budget ran out"
        print(
            f"\n{status}: {self.env_steps:,} env steps in {elapsed:.1f} s "
            f"({self.env_steps / elapsed:,.0f} steps/s); {len(self.rows)} episodes, mean of "
            f"last {self.args.window} complete episodes {self.mean_return:.1f}; workers "
            f"killed {len(self.kill_steps)}, env restarts {restarts} (each kill restarts every "
            "env of that worker); final losses "
            f"{', '.join(f'{k} {v:.3g}' for k, v in losses.items())}; outputs in {self.out_dir}",
            file=sys.stderr,
        )
        return 0 if self.is_solved else 1

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "returns.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["episode", "env_steps", "return", "ended_by_crash"])
            writer.writeheader()
            writer.writerows(self.rows)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(
                "matplotlib is not installed (pip install -e '.[examples]'); skipping curve.png",
                file=sys.stderr,
            )
            return
        self.plot(plt)

    def plot(self, plt: Any) -> None:
        """Draw curve.png: the metric the run stops on, crash-cut episodes apart, kills below.

        The line is the stopping metric itself, the mean of the last ``window`` complete
        episodes. Episodes a crash cut short are grey crosses, outside that mean; kills are
        counted per bin on a small second panel, so thousands of them hide nothing.
        """
        window = self.args.window
        complete = [r for r in self.rows if not r["ended_by_crash"]]
        cut = [r for r in self.rows if r["ended_by_crash"]]
        has_kills = bool(self.kill_steps)
        fig, axes = plt.subplots(
            2 if has_kills else 1,
            1,
            figsize=(8, 5.5 if has_kills else 4.5),
            sharex=True,
            squeeze=False,
            gridspec_kw={"height_ratios": [4, 1]} if has_kills else None,
        )
        ax = axes[0][0]
        ax.plot(
            [r["env_steps"] for r in complete],
            [r["return"] for r in complete],
            ".",
            ms=3,
            alpha=0.35,
            label="complete episode",
        )
        if cut:
            ax.plot(
                [r["env_steps"] for r in cut],
                [r["return"] for r in cut],
                "x",
                ms=2.5,
                color="gray",
                alpha=0.3,
                label=f"cut short by a kill ({len(cut):,})",
            )
        if len(complete) >= window:
            returns = [r["return"] for r in complete]
            ax.plot(
                [r["env_steps"] for r in complete[window - 1 :]],
                np.convolve(returns, np.ones(window) / window, "valid"),
                color="C1",
                label=f"mean of last {window} complete (the stopping metric)",
            )
        ax.axhline(self.args.target_return, color="gray", ls="--", lw=0.8, label="target")
        ax.set_ylabel("return")
        args = self.args
        ax.set_title(f"{self.algorithm} on {args.env_id}, {args.num_envs} envs ({args.backend})")
        ax.legend(loc="best", fontsize="small")
        if has_kills:
            kills_ax = axes[1][0]
            width = float(f"{max(self.env_steps, 60) / 60:.0e}")  # about 60 bins, round width
            bins = np.arange(0, self.env_steps + width, width)
            kills_ax.hist(self.kill_steps, bins=bins, color="C3", alpha=0.7)
            kills_ax.set_ylabel(f"workers killed\nper {width:,.0f} steps", fontsize="small")
        axes[-1][0].set_xlabel("env steps")
        fig.tight_layout()
        fig.savefig(self.out_dir / "curve.png", dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------- rollout


def total_restarts(envs: Any) -> int:
    """Restarts of all envs of a MultiEnv."""
    return sum(row["restarts"] for row in envs.stats())


def make_out_dir(args: Any, name: str) -> pathlib.Path:
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{name}-seed{args.seed}"
    return pathlib.Path(args.out_dir or f"runs/{stamp}")
