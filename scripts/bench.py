"""Benchmark multienv against Gymnasium, SB3 and PufferLib; time start-up, respawn and memory.

Run:
    python scripts/bench.py              # 6 cells (workload:N), 3 rounds (~20 min on 2 cores)
    python scripts/bench.py --quick      # cheap N=16 only, 1 round (~2 min)
    python scripts/bench.py --plot docs/bench.png   # chart the last run's bench-results.json
    python scripts/bench.py --memory --cells halfcheetah:64,pong:64   # MiB per env
    python scripts/bench.py --only-multienv --pinned   # k=1 and k=N/cores with pin_cpu=True
                                         # and False too (default: pinned when a CPU each)
    python scripts/bench.py --baseline /tmp/old --only-multienv   # A/B against another
                                         # checkout (e.g. git worktree add /tmp/old HEAD~1)
    python scripts/bench.py --rows "multienv async,multienv k=8" --cells cheap:16
                                         # only rows named so (and their probes, the loop
                                         # and AsyncVectorEnv, which every ratio needs)
    pip install -e ".[bench]"            # adds SB3 to the comparison (install torch's CPU
                                         # build first on a machine without a GPU)
    python scripts/bench_actor.py        # the actor loop: a policy's latency between calls,
                                         # step() against send/recv, in its own script

PufferLib (``pufferlib.vector.Multiprocessing``, 1 and 2 workers, all envs in one batch) is
measured when it is installed; it is not a dependency of multienv (README.rst says how it was
installed here). Workloads: cheap (CartPole-v1), heavy (1 ms of CPU per step), bigobs
(210x160x3 uint8 observations), straggler (0.2 ms of CPU per step; 5% of steps also sleep
10 ms), and two real ones from ``pip install -e ".[bench]"``: pong (ale-py's ALE/Pong-v5,
210x160 RGB, frameskip 4, sticky actions 0.25) and halfcheetah (Gymnasium's HalfCheetah-v5
on MuJoCo); each is skipped, saying why, when its package is missing. On those, EnvPool
(its own C++ port of the env, matched settings; skipped when not installed) and, for Pong,
ale-py's own AtariVectorEnv join as peers, and "x EnvPool" is the ratio to EnvPool within
each round. Every implementation steps the same pre-sampled random actions. multienv runs
with ``envs_per_worker`` k in {1, ceil(N/cores), N}, the layouts follow the cores this
process may use, and "multienv auto" with ``envs_per_worker="auto"`` (the table says which
k it chose; its x probe is against the k=N/cores probe); "multienv async" keeps every env
in flight with ``send``/``recv(batch_size=N // 2)``, at k=1 and k=ceil(N/cores); the
others step the whole batch in lock step. "multienv k=N/cores same-step" runs with
``autoreset_mode="SameStep"`` (as SB3's adapter and ``scripts/a2c.py`` do): an episode's
end resets the env in the same step, as the probe and the loop do, and its final
observation and info come in the infos. "multienv k=N/cores disabled" runs with
``autoreset_mode="Disabled"``, the loop resetting the envs that ended after each step
(``reset(options={"reset_mask": ended})``, as Tianshou's callers do): a second round
trip whenever an episode ends, which the probe does not make.
Gymnasium and multienv return copies of the observations (their default, ``copy=True``);
PufferLib returns views, and so do the rows "multienv k=N/cores views" (``copy=False``) and
"multienv k=... views spin" (the same in hot mode, ``wait="spin"``). Hot mode runs with as
many workers as cores, and with one worker, which leaves a core to the parent: it then
polls for the worker's answers too.

"bare probe k=1", "bare probe k=N/cores" and "bare probe k=... spin" are the floor of multienv's
sleeping layouts and of its best hot one on this machine: the same forked workers, shared
memory and wake-ups with nothing else (``scripts/bare_probe.py``). "x probe" is each row's
ratio to the probe of its way of waiting (spin rows to the spinning one; k=1 rows to k=1),
within each round.

Every sample runs in a fresh process; implementations are interleaved in rounds; each
figure is the median over rounds, and each ratio is the median of the ratios measured
within one round, so a noisy neighbour slows both sides of a ratio alike. "cores" is how
many of the machine's cores were busy during the timed section (from /proc/stat), and
"CPU us/step" that busy time per env step: a spin-waiting design shows up there.
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
from gymnasium.vector.utils import batch_space

from multienv import MultiEnv, RestartPolicy, SubprocessEnv


@dataclasses.dataclass
class Args:
    cells: str = (  # workload:N, ...
        "cheap:8,cheap:16,cheap:64,bigobs:16,heavy:16,straggler:8,halfcheetah:64,pong:64"
    )
    rounds: int = 3  # interleaved rounds; medians are reported
    seconds: float = 1.0  # rough wall time of the sequential loop's measurement
    kills: int = 50  # SIGKILLs for the respawn measurement
    quick: bool = False  # cheap N=16 only, 1 round
    json_out: str = "bench-results.json"  # where every sample is written
    child: str = ""  # internal: run one fresh-process measurement and print it as JSON
    plot: str = ""  # draw the throughput of json_out as a PNG at this path, and exit
    baseline: str = ""  # a checkout of multienv: its multienv rows are measured too, interleaved
    only_multienv: bool = False  # only multienv at k=1 and k=N/cores, loop and AsyncVectorEnv
    memory: bool = False  # only memory: PSS of every implementation, for --cells
    pinned: bool = False  # also multienv at k=1 and k=N/cores with pin_cpu True and False
    rows: str = ""  # only rows whose names start so (comma-separated): throughput only


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


def make_pong() -> gym.Env:
    """ALE/Pong-v5 as a new user makes it: 210x160 RGB, frameskip 4, sticky actions 0.25."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make("ALE/Pong-v5")


def make_halfcheetah() -> gym.Env:
    """Gymnasium's HalfCheetah-v5 on MuJoCo."""
    return gym.make("HalfCheetah-v5")


WORKLOADS: dict[str, tuple[Callable[[], gym.Env], int]] = {
    # name: (env factory, env steps per second one process does, roughly; sizes each run)
    "cheap": (functools.partial(gym.make, "CartPole-v1"), 60_000),
    "heavy": (HeavyEnv, 1_000),
    "bigobs": (BigObsEnv, 20_000),
    "straggler": (StragglerEnv, 1_500),
    "pong": (make_pong, 4_000),  # pip install -e ".[bench]"
    "halfcheetah": (make_halfcheetah, 25_000),
}
ALE_MATCHED = {  # ale-py's own vector env, set up as ALE/Pong-v5 is
    "img_height": 210,
    "img_width": 160,
    "grayscale": False,
    "stack_num": 1,
    "frameskip": 4,
    "maxpool": False,
    "noop_max": 0,
    "repeat_action_probability": 0.25,
    "reward_clipping": False,
    "use_fire_reset": False,
    "episodic_life": False,
}
REAL_WORKLOADS = {"pong": "ale_py", "halfcheetah": "mujoco"}  # and the module each needs
ENVPOOL_TASKS = {  # EnvPool's own port of the env, with matched settings
    "pong": (
        "Pong-v5",
        {
            "img_height": 210,
            "img_width": 160,
            "gray_scale": False,
            "stack_num": 1,
            "frame_skip": 4,
            "repeat_action_probability": 0.25,
            "noop_max": 1,
            "episodic_life": False,
            "reward_clip": False,
        },
    ),
    "halfcheetah": ("HalfCheetah-v5", {}),
}


def action_bank(fns: list[Callable[[], gym.Env]], size: int = 64) -> list[Any]:
    """Pre-sampled random batches of actions for N envs, the same in every implementation."""
    probe = fns[0]()
    space = batch_space(probe.action_space, len(fns))
    probe.close()
    space.seed(0)
    return [space.sample() for _ in range(size)]


# ----------------------------------------------------------------- implementations


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


class Timer:
    """Wall time and cores busy (machine-wide, from /proc/stat) over a timed section.

    With ``measure_memory`` set (a memory sample), it also takes the PSS of this process and
    all its descendants as the section ends, while the implementation is still running.
    """

    measure_memory = False

    def __enter__(self) -> Timer:
        self.busy0, self.total0 = busy_jiffies()
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.began
        busy, total = busy_jiffies()
        cores = os.cpu_count() or 1
        self.cores_busy = cores * (busy - self.busy0) / max(1, total - self.total0)
        self.pss_mib = tree_pss_mib() if self.measure_memory else 0.0


def run_loop(fns: list[Callable[[], gym.Env]], vector_steps: int, bank: list[Any]) -> Timer:
    envs = [fn() for fn in fns]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    with Timer() as timer:
        for t in range(vector_steps):
            actions = bank[t % len(bank)]
            for i, env in enumerate(envs):
                _, _, terminated, truncated, _ = env.step(actions[i])
                if terminated or truncated:
                    env.reset()
    return timer


def run_vector(build: Callable[[], Any], vector_steps: int, bank: list[Any]) -> Timer:
    """A vector env with Gymnasium's (or SB3's, or EnvPool's) autoresetting ``step``."""
    envs = build()
    try:
        envs.reset()
        for t in range(20):
            envs.step(bank[t % len(bank)])
        with Timer() as timer:
            for t in range(vector_steps):
                envs.step(bank[t % len(bank)])
        return timer
    finally:
        envs.close()


def run_disabled(build: Callable[[], Any], vector_steps: int, bank: list[Any]) -> Timer:
    """A vector env with autoreset disabled: the caller resets the envs that ended, by mask."""
    envs = build()
    try:
        envs.reset()
        with Timer() as timer:
            for t in range(vector_steps):
                _, _, terminated, truncated, _ = envs.step(bank[t % len(bank)])
                ended = terminated | truncated
                if ended.any():
                    envs.reset(options={"reset_mask": ended})
        return timer
    finally:
        envs.close()


def run_tianshou(fns: list[Callable[[], gym.Env]], vector_steps: int, bank: np.ndarray) -> Timer:
    from tianshou.env import ShmemVectorEnv

    envs = ShmemVectorEnv(fns)
    try:
        envs.reset()
        with Timer() as timer:
            for t in range(vector_steps):
                _, _, terminated, truncated, _ = envs.step(bank[t % len(bank)])
                done = np.flatnonzero(np.logical_or(terminated, truncated))
                if done.size:
                    envs.reset(done)  # Tianshou leaves resets to the caller
        return timer
    finally:
        envs.close()


def run_pufferlib(
    fns: list[Callable[[], gym.Env]], workers: int, vector_steps: int, bank: list[Any]
) -> Timer:
    """PufferLib's Multiprocessing backend, all envs in one batch (it resets envs itself)."""
    import pufferlib.emulation
    import pufferlib.vector

    n = len(fns)
    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=fns[0])
    envs = pufferlib.vector.make(
        creator,
        backend=pufferlib.vector.Multiprocessing,
        num_envs=n,
        num_workers=workers,
        batch_size=n,
        overwork=True,
    )
    try:
        envs.async_reset(0)
        envs.recv()
        space = envs.action_space  # the batch of its flattened spaces: MultiDiscrete, Box
        actions = [np.asarray(a, dtype=space.dtype).reshape(space.shape) for a in bank]
        for t in range(20):
            envs.send(actions[t % len(actions)])
            envs.recv()
        with Timer() as timer:
            for t in range(vector_steps):
                envs.send(actions[t % len(actions)])
                envs.recv()
        return timer
    finally:
        envs.close()


def run_multienv_async(
    fns: list[Callable[[], gym.Env]], k: int, vector_steps: int, bank: list[Any]
) -> Timer:
    n = len(fns)
    batch_size = max(1, n // 2)
    with MultiEnv(fns, envs_per_worker=k) as envs:
        envs.reset()
        envs.send(bank[0])
        with Timer() as timer:
            for t in range(2 * vector_steps):
                *_, infos = envs.recv(batch_size=batch_size)
                envs.send(bank[t % len(bank)][infos["env_id"]], infos["env_id"])
        envs.recv()
    timer.wall_s *= n / (2 * batch_size)  # the same env steps as vector_steps full batches
    return timer


def is_installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def implementations(n: int, workload: str = "cheap") -> list[str]:
    """The names of the implementations measured at N envs (optional ones when installed)."""
    names = ["sequential loop", "gymnasium AsyncVectorEnv"]
    if workload in ENVPOOL_TASKS and is_installed("envpool"):
        names.append("EnvPool")
    if workload == "pong" and is_installed("ale_py.vector_env"):
        names.append("ale-py AtariVectorEnv")
    if is_installed("stable_baselines3"):
        names.append("SB3 SubprocVecEnv")
    if is_installed("tianshou"):
        names.append("Tianshou ShmemVectorEnv")
    if is_installed("pufferlib.vector"):
        names += [f"PufferLib workers={w}" for w in (1, 2) if n % w == 0]
    names += [f"multienv k={k}" for k in sorted({1, per_core(n), n})]
    names.append("multienv auto")
    names.append(f"multienv k={per_core(n)} views")
    names.append(f"multienv k={per_core(n)} same-step")
    names.append(f"multienv k={per_core(n)} disabled")
    names += [f"multienv k={k} spin" for k in spin_layouts(n)]
    # hot mode at its fastest, returning views as PufferLib does
    names += [f"multienv k={k} views spin" for k in spin_layouts(n)]
    names += [f"multienv async k={k}" for k in sorted({1, per_core(n)})]
    names += probe_layouts(n)
    return names


def per_core(n: int) -> int:
    """Envs per worker for as many workers as the cores this process may use."""
    return -(-n // len(os.sched_getaffinity(0)))


def probe_layouts(n: int) -> list[str]:
    """The bare probe's rows: multienv's sleeping layouts k=1 and k=N/cores, its best hot one."""
    sleeping = [f"bare probe k={k}" for k in sorted({1, per_core(n)})]
    return [*sleeping, f"bare probe k={spin_layouts(n)[0]} spin"]


def probe_of(name: str, n: int) -> str:
    """The probe row a row is read against: its way of waiting, and k=1 for k=1 rows.

    PufferLib's workers and parent spin: its rows are read against the spinning probe.
    """
    words = name.split()
    *sleeping, hot = probe_layouts(n)
    if words[-1] == "spin" or name.startswith("PufferLib"):
        return hot
    return sleeping[0] if "k=1" in words else sleeping[-1]


def spin_layouts(n: int) -> list[int]:
    """The envs per worker of hot-mode rows: as many workers as cores, and one worker."""
    cores = len(os.sched_getaffinity(0))
    return sorted({k for k in (-(-n // cores), n) if -(-n // k) <= cores})


def run_implementation(
    name: str, workload: str, fns: list[Callable[[], gym.Env]], steps: int
) -> Timer:
    n = len(fns)
    bank = action_bank(fns)
    if name == "sequential loop":
        return run_loop(fns, steps, bank)
    if name == "gymnasium AsyncVectorEnv":
        return run_vector(lambda: gym.vector.AsyncVectorEnv(fns, shared_memory=True), steps, bank)
    if name == "SB3 SubprocVecEnv":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        return run_vector(lambda: SubprocVecEnv(fns), steps, bank)
    if name == "EnvPool":
        import envpool

        task, matched = ENVPOOL_TASKS[workload]
        return run_vector(
            lambda: envpool.make(task, env_type="gymnasium", num_envs=n, **matched), steps, bank
        )
    if name == "ale-py AtariVectorEnv":
        from ale_py.vector_env import AtariVectorEnv

        return run_vector(lambda: AtariVectorEnv("pong", n, **ALE_MATCHED), steps, bank)
    if name == "Tianshou ShmemVectorEnv":
        return run_tianshou(fns, steps, bank)
    if name.startswith("PufferLib workers="):
        return run_pufferlib(fns, int(name.rpartition("=")[2]), steps, bank)
    if name == "multienv auto":

        def build_auto() -> MultiEnv:
            envs = MultiEnv(fns, envs_per_worker="auto")
            CHOSEN.append(envs.layout.envs_per_worker)
            return envs

        return run_vector(build_auto, steps, bank)
    k, _, variant = name.rpartition("=")[2].partition(" ")  # "... k=8 views spin"
    if name.startswith("multienv async k="):
        return run_multienv_async(fns, int(k), steps, bank)
    words = variant.split()
    if name.startswith("bare probe k="):
        from bare_probe import BareProbe  # scripts/, beside this file

        return run_vector(lambda: BareProbe(fns, int(k), "spin" in words, bank[0]), steps, bank)
    options: dict[str, Any] = {"copy": "views" not in words}
    if variant in ("pinned", "unpinned"):  # else multienv decides (pinned: a CPU each)
        options["pin_cpu"] = variant == "pinned"
    if "spin" in words:
        options["wait"] = "spin"
    if "same-step" in words:
        options["autoreset_mode"] = "SameStep"
    if "disabled" in words:
        options["autoreset_mode"] = "Disabled"
        return run_disabled(lambda: MultiEnv(fns, envs_per_worker=int(k), **options), steps, bank)
    return run_vector(lambda: MultiEnv(fns, envs_per_worker=int(k), **options), steps, bank)


# ----------------------------------------------------------------- throughput table


REFERENCES = ("sequential loop", "gymnasium AsyncVectorEnv")  # every ratio needs them


def measure_throughput(args: Args, workload: str, n: int) -> dict[str, Any]:
    """Every implementation, each sample in a fresh process, interleaved over rounds.

    A peer whose sample fails is left out of the rest of the run, with its last error line.
    """
    _, single_rate = WORKLOADS[workload]
    names = implementations(n, workload)
    if args.only_multienv:  # the references, and multienv at k=1 and k=N/cores
        kept = {"sequential loop", "gymnasium AsyncVectorEnv", "multienv k=1", "EnvPool"}
        kept.add("multienv auto")
        if -(-n // per_core(n)) <= 2:  # few cores: one worker is a layout to weigh too
            kept.add(f"multienv k={n}")
        kept.update((f"multienv k={per_core(n)}", "ale-py AtariVectorEnv"))
        kept.update(f"multienv k={per_core(n)} {mode}" for mode in ("same-step", "disabled"))
        kept.update(f"multienv async k={k}" for k in sorted({1, per_core(n)}))
        for k in spin_layouts(n):
            kept.update((f"multienv k={k} spin", f"multienv k={k} views spin"))
        kept.update(probe_layouts(n))
        names = [name for name in names if name in kept]
    if args.rows:  # with the probes they are read against, and the references every ratio needs
        starts = tuple(start.strip() for start in args.rows.split(","))
        kept = {name for name in names if name.startswith(starts)}
        kept.update((*REFERENCES, *(probe_of(name, n) for name in kept)))
        names = [name for name in names if name in kept]
    if args.pinned:
        names += [
            f"multienv k={k} {variant}"
            for k in sorted({1, per_core(n)})
            for variant in ("pinned", "unpinned")
        ]
    if args.baseline:
        names += [  # an older checkout may have no "auto"
            f"{name} @baseline"
            for name in names
            if name.startswith("multienv") and name != "multienv auto"
        ]
    # Size a run so the sequential loop takes about args.seconds; parallel ones take less.
    vector_steps = max(20, int(single_rate * args.seconds / n))
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in list(names):
            try:
                sample = in_fresh_process(args, f"throughput:{workload}:{n}:{vector_steps}:{name}")
            except RuntimeError as exc:
                if name.startswith("multienv") or name in REFERENCES:
                    raise
                last_line = str(exc).strip().splitlines()[-1]
                print(f"{workload} N={n}: {name} failed, left out: {last_line}", file=sys.stderr)
                names.remove(name)
                del samples[name]
                continue
            samples[name].append(sample)
            print(
                f"{workload} N={n} round {round_index + 1}: {name}: "
                f"{sample['steps_per_s']:,.0f} steps/s, {sample['cores_busy']:.2f} cores busy",
                file=sys.stderr,
                flush=True,
            )
    puffer = [name for name in names if name.startswith("PufferLib")]
    rows: dict[str, Any] = {}
    for name, values in samples.items():
        rates = [v["steps_per_s"] for v in values]

        def ratio(reference: list[float], rates: list[float] = rates) -> float:
            return statistics.median(v / ref for v, ref in zip(rates, reference, strict=True))

        row = {
            "steps_per_s": statistics.median(rates),
            "x_loop": ratio([v["steps_per_s"] for v in samples["sequential loop"]]),
            "x_async": ratio([v["steps_per_s"] for v in samples["gymnasium AsyncVectorEnv"]]),
            "cores_busy": statistics.median(v["cores_busy"] for v in values),
            "cpu_us_per_step": statistics.median(
                1e6 * v["cores_busy"] / v["steps_per_s"] for v in values
            ),
            "samples": values,
        }
        if name.endswith(" @baseline"):
            row["x_this_vs_baseline"] = 1 / ratio(
                [v["steps_per_s"] for v in samples[name.removesuffix(" @baseline")]]
            )
        if puffer:  # PufferLib's best layout within each round
            best = [max(samples[p][r]["steps_per_s"] for p in puffer) for r in range(args.rounds)]
            row["x_puffer_best"] = ratio(best)
        if "EnvPool" in samples:
            row["x_envpool"] = ratio([v["steps_per_s"] for v in samples["EnvPool"]])
        probe = probe_of(name.removesuffix(" @baseline"), n)
        if probe in samples:  # the same layout's floor on this machine, this round
            row["x_probe"] = ratio([v["steps_per_s"] for v in samples[probe]])
        rows[name] = row
    return rows


def print_table(workload: str, n: int, rows: dict[str, Any]) -> None:
    has_puffer = any("x_puffer_best" in row for row in rows.values())
    has_envpool = any("x_envpool" in row for row in rows.values())
    has_probe = any("x_probe" in row for row in rows.values())
    print(f"\n{workload}, N={n}")
    header = f"{'implementation':<26}{'steps/s':>10}{'x loop':>8}{'x Async':>9}"
    header += f"{'x Puffer':>10}" if has_puffer else ""
    header += f"{'x EnvPool':>10}" if has_envpool else ""
    header += f"{'x probe':>9}" if has_probe else ""
    print(header + f"{'cores':>7}{'CPU us/step':>13}")
    for name, row in rows.items():
        line = f"{name:<26}{row['steps_per_s']:>10,.0f}{row['x_loop']:>8.2f}{row['x_async']:>9.2f}"
        if has_puffer:
            line += f"{row['x_puffer_best']:>10.2f}"
        if has_envpool:
            line += f"{row['x_envpool']:>10.2f}"
        if has_probe:
            line += f"{row['x_probe']:>9.2f}" if "x_probe" in row else f"{'':>9}"
        line += f"{row['cores_busy']:>7.2f}{row['cpu_us_per_step']:>13.1f}"
        if "x_this_vs_baseline" in row:
            line += f"  this/baseline {row['x_this_vs_baseline']:.3f}"
        chosen = sorted({v["envs_per_worker"] for v in row["samples"] if "envs_per_worker" in v})
        if chosen:
            line += f"  chose k={'/'.join(map(str, chosen))}"
        print(line)


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


# A later vector of the same process, as a training script makes one (start_forkserver() at
# its top, then some work between vectors): its workers are the module server's spares,
# which it forks after 0.2 s without a request.
_LATER_CODE = """
import functools, statistics, time, gymnasium as gym
import multienv
from multienv import MultiEnv
multienv.start_forkserver()
envs = {build}
envs.reset(seed=0)
time.sleep(0.5)
envs.close()
times = []
for _ in range(3):
    began = time.perf_counter()
    envs = {build}
    envs.reset(seed=0)
    times.append(time.perf_counter() - began)
    time.sleep(0.5)
    envs.close()
print(statistics.median(times))
"""


def time_startup(n: int, repeats: int = 3) -> dict[str, float]:
    """Seconds from constructing N CartPole envs to the first reset.

    The first vector of a fresh process, and (rows ending in "later vector") the median of
    3 vectors built after it in one process, each in ``repeats`` fresh processes.
    """
    fns = f"[functools.partial(gym.make, 'CartPole-v1')] * {n}"
    codes = {
        "gymnasium AsyncVectorEnv": _STARTUP_CODE.format(
            module="gymnasium.vector", name="AsyncVectorEnv", build=f"AsyncVectorEnv({fns})"
        ),
    }
    for k in sorted({1, n // 2, n}):
        build = f"MultiEnv({fns}, envs_per_worker={k})"
        codes[f"multienv k={k}"] = _STARTUP_CODE.format(
            module="multienv", name="MultiEnv", build=build
        )
        codes[f"multienv k={k}, later vector"] = _LATER_CODE.format(build=build)
    results = {}
    for label, code in codes.items():
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


def measure_memory(label: str, n: int = 16) -> dict[str, float]:
    """Private memory of the worker processes after 100 steps of N CartPole envs, in MiB."""
    fns = [functools.partial(gym.make, "CartPole-v1")] * n
    if label == "gymnasium AsyncVectorEnv":
        envs: Any = gym.vector.AsyncVectorEnv(fns, shared_memory=True)
        pids = [p.pid for p in envs.processes]
    else:
        k = int(label.split("k=")[1].split(",")[0])
        envs = MultiEnv(fns, envs_per_worker=k, preload=preload_for(label))
        pids = sorted({env.pid for env in envs.envs})
    try:
        envs.reset(seed=0)
        for _ in range(100):
            envs.step(np.zeros(n, dtype=np.int64))
        per_worker = [private_mb(pid) for pid in pids]
        return {"total": sum(per_worker), "per_worker": statistics.median(per_worker)}
    finally:
        envs.close()


def tree_pss_mib(root: int | None = None) -> float:
    """PSS of a process and all its descendants, in MiB: shared pages count once in all."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    total_kb, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kb += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            continue
    return total_kb / 1024


def bare_pss_mib(workload: str) -> float:
    """PSS of a process that imported what a contender imports, with no env running."""
    env = WORKLOADS[workload][0]()
    env.close()
    del env
    return tree_pss_mib()


def measure_tree_memory(args: Args, workload: str, n: int) -> dict[str, Any]:
    """Every implementation's PSS after construct, reset and 200 steps, fresh processes."""
    bare = in_fresh_process(args, f"bare:{workload}")["pss_mib"]
    # Hot mode uses the memory of its layout. SB3's workers each import torch (180 MiB per
    # env for the cheap cell at N=8), too much to start 64 of on a small machine.
    names = [
        name
        for name in implementations(n, workload)
        if not name.endswith(" spin") and not (name.startswith("SB3") and n > 16)
    ]
    if n > 8 and "multienv k=8" not in names:  # the layout of the memory issue
        names.insert(names.index("multienv k=1") + 1, "multienv k=8")
    rows: dict[str, Any] = {}
    print(f"\n{workload}, N={n}: PSS of the process and its children after 200 steps")
    print(f"{'implementation':<28}{'total MiB':>10}{'MiB per env':>13}")
    for name in names:
        sample = in_fresh_process(args, f"memory-tree:{workload}:{n}:{name}")
        per_env = (sample["pss_mib"] - bare) / n
        rows[name] = {"total_mib": sample["pss_mib"], "per_env_mib": per_env}
        print(f"{name:<28}{sample['pss_mib']:>10.1f}{per_env:>13.1f}", flush=True)
    rows["bare parent"] = {"total_mib": bare}
    return rows


MEMORY_LABELS = [
    "gymnasium AsyncVectorEnv",
    "multienv k=1",
    "multienv k=1, preload",
    "multienv k=8",
    "multienv k=16",
]
RESPAWN_LABELS = ["multienv", "multienv, preload"]


CHOSEN: list[int] = []  # the envs_per_worker "multienv auto" chose, in this child


def run_child(args: Args) -> int:
    """One measurement in this fresh process (a forkserver starts once per process)."""
    kind, _, rest = args.child.partition(":")
    if kind == "throughput":
        workload, n, steps, name = rest.split(":", 3)
        fns = [WORKLOADS[workload][0]] * int(n)
        timer = run_implementation(name, workload, fns, int(steps))
        rate = int(steps) * int(n) / timer.wall_s
        sample = {"steps_per_s": rate, "cores_busy": timer.cores_busy}
        if CHOSEN:
            sample["envs_per_worker"] = CHOSEN[-1]
        print(json.dumps(sample))
    elif kind == "memory":
        print(json.dumps(measure_memory(rest)))
    elif kind == "memory-tree":
        workload, n, name = rest.split(":", 2)
        Timer.measure_memory = True
        fns = [WORKLOADS[workload][0]] * int(n)
        timer = run_implementation(name, workload, fns, 200)
        print(json.dumps({"pss_mib": timer.pss_mib}))
    elif kind == "bare":
        print(json.dumps({"pss_mib": bare_pss_mib(rest)}))

    else:
        print(json.dumps(time_respawns(args.kills, preload_for(rest))))
    return 0


def in_fresh_process(args: Args, child: str) -> Any:
    """Run ``bench.py --child child`` and return what it printed last.

    A child named ``... @baseline`` imports ``multienv`` from ``args.baseline`` instead.
    """
    env, cwd = None, None
    if child.endswith(" @baseline"):
        child = child.removesuffix(" @baseline")
        # Run from there too: a forkserver's workers find modules in its working directory.
        cwd = os.path.abspath(args.baseline)
        paths = (cwd, os.environ.get("PYTHONPATH", ""))  # the others after it (the wheels')
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in paths if path))
    script = os.path.abspath(__file__)
    command = [sys.executable, script, "--child", child, "--kills", str(args.kills)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results_path: str, png_path: str) -> None:
    """A bar chart of env steps/s per implementation, one group per cell (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results_path) as f:
        cells = json.load(f)["throughput"]
    names = list(next(iter(cells.values())))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cells) * len(names) / 4), 4.5))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        rates = [cells[cell].get(name, {}).get("steps_per_s", 0.0) for cell in cells]
        ax.bar([i + k * width for i in range(len(cells))], rates, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], list(cells))
    ax.set_yscale("log")
    ax.set_ylabel("env steps per second (log)")
    ax.set_title("python scripts/bench.py: median of rounds, 2 cores")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main(args: Args) -> int:
    if args.child:
        return run_child(args)
    if args.plot:
        plot(args.json_out, args.plot)
        print(f"wrote {args.plot} from {args.json_out}")
        return 0
    cells = args.cells.split(",")
    if args.memory:
        memory_rows = {}
        for cell in cells:
            workload, _, n = cell.partition(":")
            memory_rows[cell] = measure_tree_memory(args, workload, int(n))
        with open(args.json_out, "w") as f:
            json.dump({"args": dataclasses.asdict(args), "memory": memory_rows}, f, indent=1)
        return 0
    if args.quick:
        cells, args.rounds = ["cheap:16"], 1
    results: dict[str, Any] = {"args": dataclasses.asdict(args), "throughput": {}}
    for cell in cells:
        workload, _, n = cell.partition(":")
        needs = REAL_WORKLOADS.get(workload)
        if needs is not None and not is_installed(needs):
            print(
                f'\n{workload}, N={n}: skipped, {needs} is not installed: pip install -e ".[bench]"'
            )
            continue
        rows = measure_throughput(args, workload, int(n))
        results["throughput"][f"{workload}/N={n}"] = rows
        print_table(workload, int(n), rows)
    if args.only_multienv or args.rows:  # throughput only
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
        return 0
    startup = time_startup(16)
    results["startup_s_n16"] = startup
    print("\nstart-up, N=16 CartPole, construct + first reset, fresh process (median of 3):")
    for label, seconds in startup.items():
        print(f"  {label:<34}{seconds:>8.3f} s")
    # Each in a fresh process, so that preload reaches a forkserver of its own.
    memory = {label: in_fresh_process(args, f"memory:{label}") for label in MEMORY_LABELS}
    results["private_mb_n16"] = memory
    print("\nprivate memory of the worker processes, N=16 CartPole:")
    for label, mb in memory.items():
        print(f"  {label:<26}{mb['total']:>8.1f} MiB in all, {mb['per_worker']:.1f} MiB per worker")
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
