"""Time the actor loop with a policy between calls: ``step()`` against ``send``/``recv``.

Run:
    python scripts/bench_actor.py                        # pong:16 and halfcheetah:16, a
                                                         # sleeping policy of 0, 1, 2, 5 ms
                                                         # and of half and twice a
                                                         # batch's env time
    python scripts/bench_actor.py --cells cheap:16 --latencies 0,1 --policy busy --rounds 2
    python scripts/bench_actor.py --dispatch             # TorchRL's "dispatch" workload
    python scripts/bench_actor.py --slow-reset           # TorchRL's "fast step, slow reset"
    python scripts/bench_actor.py --torchrl-python ../trl/bin/python \
        --rows "TorchRL sync,TorchRL async,multienv send/recv auto k=8" --rounds 1

A training loop does not call the vector back to back: between two calls its policy runs
(and its learner, now and then). A policy on a GPU leaves the CPU free while it runs, which
``--policy sleep`` (the default) stands for; ``--policy busy`` spins on the parent's CPU
instead, as a policy on the CPU does. Each row's loop, with the policy's latency L per call:

- ``step()``: the policy (L) for the whole batch, then ``step`` of every env;
- ``send/recv``: ``recv(batch_size=N // 2)``, the policy (L) for those envs, then ``send``
  of their actions: the other half steps while the policy runs (EnvPool's loop); at the
  default layout, and at one env per worker (``k=1``), where ``recv`` takes the first envs
  done from any worker, so that no worker's slowest env holds back its others (``step()``
  at k=1 beside it);
- ``send/recv auto``: the same loop with ``recv(batch_size="auto")``, the batch the vector
  picks by timing whole and half batches in this loop ("picked" says which, by round);
- ``send/recv ready``: ``recv(batch_size=N, take="ready")``, every env done as soon as one
  is (a policy server's loop);
- ``ale-py sync`` / ``ale-py async`` (Pong): ale-py's own ``AtariVectorEnv``, as a peer,
  the same two loops (``batch_size=N // 2`` for the second).

Both multienv rows run the default layout (``envs_per_worker`` as many workers as cores),
every sample in a fresh process, the rows interleaved in rounds; figures are medians over
rounds and each ratio ("x step") is the median of the ratios within one round, so a noisy
neighbour slows both sides alike. "half" as a latency is half the time one ``step()`` of
the whole batch takes with no policy, measured before the first round: the policy latency
at which the half in flight has just the time it needs; "twice" is twice that time.

``--dispatch``: 8 envs that return at once (no work), harvested as they come: ``recv`` of
one worker's envs at a time, at k=1 and k=4, against ``step()`` of the same layout; the
parent's CPU per transition beside. ``--slow-reset``: 32 envs whose steps take 1 ms of
sleep and whose resets take 200 ms every 200 steps: the ceiling is 32 envs x 1 step per
2 ms on average (what the envs allow, with nothing waiting on a reset); at k=1, at
k=ceil(N/cores) and with ``envs_per_worker="auto"``, whose workers step their waiting
envs on threads.

EnvPool (``pip install envpool``, Python >= 3.12) runs as a peer when installed: ``EnvPool
sync`` and ``EnvPool async`` (``batch_size=N // 2``, ``async_reset``, then ``recv`` and
``send(actions, env_id)``), its own port of the env with the settings ``bench.py`` matches.
TorchRL's ``AsyncEnvPool`` runs as the other peer when installed (``torchrl``, with a CPU
build of torch; ``--torchrl-python`` runs its rows in another venv's Python, as torch's
wheels and EnvPool's may not share one), on the same Gymnasium envs through its
``GymWrapper``, one env per worker
process, ``backend="multiprocessing"``, ``exchange="shm"``: ``TorchRL sync``
(``step_and_maybe_reset`` of every env) and ``TorchRL async``
(``async_step_and_maybe_reset_recv(min_get=N // 2, max_get=N // 2)``, the policy, then
``async_step_and_maybe_reset_send`` of those envs' actions; in ``--dispatch``, ``min_get=1``
and whatever is done, as they come). Its tensordicts are what its users get, so their cost
counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import ALE_MATCHED, ENVPOOL_TASKS, REAL_WORKLOADS, WORKLOADS, is_installed

ROWS = ("step()", "send/recv", "send/recv auto", "send/recv ready")
ASYNC_ROWS = (*ROWS[1:], "ale-py async", "EnvPool async")
ALE_ROWS = ("ale-py sync", "ale-py async")
ENVPOOL_ROWS = ("EnvPool sync", "EnvPool async")  # its own threads, batch_size=N // 2
TORCHRL_ROWS = ("TorchRL sync", "TorchRL async")  # AsyncEnvPool, shm exchange, 1 env/process


class ZeroEnv(gym.Env[np.ndarray, int]):
    """Returns at once: the dispatch workload's env."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        return np.zeros(4, np.float32), 0.0, False, False, {}


class SlowResetEnv(ZeroEnv):
    """1 ms per step (sleeping); every 200 steps the episode ends, and its reset takes 200 ms."""

    def __init__(self) -> None:
        self.t = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        if self.t:
            time.sleep(0.2)
        self.t = 0
        return super().reset(seed=seed)

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        time.sleep(0.001)
        self.t += 1
        return np.zeros(4, np.float32), 0.0, self.t >= 200, False, {}


def make_fns(workload: str, n: int) -> list[Any]:
    if workload == "dispatch":
        return [ZeroEnv] * n
    if workload == "slowreset":
        return [SlowResetEnv] * n
    return [WORKLOADS[workload][0]] * n


def policy(latency_s: float, busy: bool) -> None:
    """The policy's time between two calls: asleep (a GPU's) or spinning (a CPU's)."""
    if latency_s <= 0:
        return
    if busy:
        end = time.perf_counter() + latency_s
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(latency_s)


def sample(
    row: str,
    workload: str,
    n: int,
    k: int | str | None,
    latency_s: float,
    busy: bool,
    seconds: float,
) -> dict[str, float]:
    """One row's env steps per second (and the parent's CPU per env step), in this process."""
    from multienv import MultiEnv

    is_envpool = row.startswith("EnvPool")
    if row.startswith("TorchRL"):
        return sample_torchrl(row, workload, n, latency_s, busy, seconds)
    if row.startswith("ale-py"):
        from ale_py.vector_env import AtariVectorEnv

        batch = n // 2 if row == "ale-py async" else 0
        envs: Any = AtariVectorEnv("pong", n, batch_size=batch, **ALE_MATCHED)
    elif is_envpool:
        import envpool

        task, matched = ENVPOOL_TASKS[workload]
        batch = n // 2 if row == "EnvPool async" else n
        envs = envpool.make(task, env_type="gymnasium", num_envs=n, batch_size=batch, **matched)
    else:
        envs = MultiEnv(make_fns(workload, n), envs_per_worker=k or 1)
    try:
        if is_envpool:  # its action space is one env's
            space = envs.action_space
            space.seed(0)
            bank = [np.array([space.sample() for _ in range(n)]) for _ in range(16)]
        else:
            bank = [envs.action_space.sample() for _ in range(16)]
        is_async = row in ASYNC_ROWS
        if row == "EnvPool async":
            envs.async_reset()  # the first recv returns the first batch reset
        else:
            envs.reset(seed=0)
        if is_async and row.startswith("ale-py"):  # its reset returned the first batch
            envs.send(bank[0][: n // 2])
        elif is_async and not is_envpool:
            envs.send(bank[0])
        half = n // 2 if workload != "dispatch" else (k or 1)

        def cycle(t: int) -> int:
            if not is_async:
                policy(latency_s, busy)
                envs.step(bank[t % 16])
                return n
            if row.startswith("ale-py"):  # its send steps the envs its last recv returned
                *_, infos = envs.recv()
                policy(latency_s, busy)
                envs.send(bank[t % 16])
                return len(infos["env_id"])
            if is_envpool:  # EnvPool's loop: recv a batch, send its envs' actions back
                *_, infos = envs.recv()
                ids = infos["env_id"]
                policy(latency_s, busy)
                envs.send(bank[t % 16][ids], ids)
                return len(ids)
            if row == "send/recv auto":
                *_, infos = envs.recv(batch_size="auto")
            elif row == "send/recv ready":
                *_, infos = envs.recv(batch_size=n, take="ready")
            else:
                *_, infos = envs.recv(batch_size=half)
            ids = infos["env_id"]
            policy(latency_s, busy)
            envs.send(bank[t % 16][ids], ids)
            return len(ids)

        result = timed(cycle, seconds)
        if row == "send/recv auto":
            result["picked"] = envs.auto_batch.batch_size
        if is_async and not row.startswith(("ale-py", "EnvPool")):
            envs.recv()
        return result
    finally:
        envs.close()


def torchrl_env(workload: str) -> Any:
    """One of the workload's envs as TorchRL's workers build it (a module-level maker)."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_fns(workload, 1)[0]())


def sample_torchrl(
    row: str, workload: str, n: int, latency_s: float, busy: bool, seconds: float
) -> dict[str, float]:
    """``sample`` for TorchRL's ``AsyncEnvPool``: its sync step, or its send/recv loop."""
    import functools

    from torchrl.envs import AsyncEnvPool

    maker = functools.partial(torchrl_env, workload)
    envs = AsyncEnvPool([maker] * n, backend="multiprocessing", exchange="shm")
    try:
        spec = envs.full_action_spec["action"]
        bank = [spec.rand() for _ in range(16)]
        td = envs.reset()
        is_async = row == "TorchRL async"
        if workload == "dispatch":  # as they come: whatever is done, at least one
            least, most = 1, None
        else:
            least = most = n // 2
        if is_async:
            td["action"] = bank[0]
            envs.async_step_and_maybe_reset_send(td)

        def cycle(t: int) -> int:
            nonlocal td
            if not is_async:
                policy(latency_s, busy)
                td["action"] = bank[t % 16]
                _, td = envs.step_and_maybe_reset(td)
                return n
            _, done = envs.async_step_and_maybe_reset_recv(min_get=least, max_get=most)
            ids = torch_ids(done["env_index"])
            policy(latency_s, busy)
            done["action"] = bank[t % 16][ids]
            envs.async_step_and_maybe_reset_send(done)
            return len(ids)

        result = timed(cycle, seconds)
        if is_async:
            envs.async_step_and_maybe_reset_recv(min_get=n)
        return result
    finally:
        envs.close()


def torch_ids(env_index: Any) -> Any:
    import torch

    return torch.as_tensor(list(env_index))


def timed(cycle: Any, seconds: float) -> dict[str, float]:
    """Warm up, then run ``cycle`` for ``seconds``: env steps per second, CPU, time per call."""
    t, began = 0, time.perf_counter()
    while time.perf_counter() - began < min(1.0, seconds / 3):  # warm-up
        cycle(t)
        t += 1
    steps, calls, began, cpu = 0, 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - began < seconds:
        steps += cycle(t + calls)
        calls += 1
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {"steps_per_s": steps / wall, "cpu_us": cpu / steps * 1e6, "call_s": wall / calls}


def run_child(args: argparse.Namespace) -> None:
    spec = json.loads(args.child)
    print(json.dumps(sample(**spec)))


TORCHRL_PYTHON: list[str] = []  # ``--torchrl-python``: the interpreter of TorchRL's rows


def measure(spec: dict[str, Any]) -> dict[str, float]:
    python = sys.executable
    if TORCHRL_PYTHON and spec["row"].startswith("TorchRL"):
        python = TORCHRL_PYTHON[0]
    command = [python, os.path.abspath(__file__), "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{spec}: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table(
    title: str,
    specs: dict[str, dict[str, Any]],
    base: str,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Measure each spec once per round, interleaved; print the medians and ratios."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in specs}
    for _ in range(rounds):
        for name, spec in specs.items():
            samples[name].append(measure(spec))
    print(f"\n{title}")
    print(f"  {'row':<30}{'steps/s':>11}  {'x ' + base:>18}{'CPU us/step':>13}")
    out = {}
    for name in specs:
        rates = [s["steps_per_s"] for s in samples[name]]
        ratios = [
            a["steps_per_s"] / b["steps_per_s"]
            for a, b in zip(samples[name], samples[base], strict=True)
        ]
        out[name] = {
            "picked": [s.get("picked", 0) for s in samples[name]],
            "steps_per_s": statistics.median(rates),
            "x": statistics.median(ratios),
            "cpu_us": statistics.median(s["cpu_us"] for s in samples[name]),
            "call_s": statistics.median(s["call_s"] for s in samples[name]),
        }
        row = out[name]
        print(f"  {name:<30}{row['steps_per_s']:>11,.0f}  {row['x']:>18.2f}{row['cpu_us']:>13.1f}")
    sys.stdout.flush()
    return out


def per_core(n: int) -> int:
    return -(-n // len(os.sched_getaffinity(0)))


def training(args: argparse.Namespace) -> None:
    busy = args.policy == "busy"
    for cell in args.cells.split(","):
        workload, n_text = cell.split(":")
        n = int(n_text)
        module = REAL_WORKLOADS.get(workload)
        if module is not None and not is_installed(module):
            print(f"\n{cell}: skipped, {module} is not installed (pip install -e '.[bench]')")
            continue
        k = args.k or per_core(n)
        batch_s = None
        for latency in args.latencies.split(","):
            if latency in ("half", "twice"):
                if batch_s is None:  # one step() of the whole batch, no policy
                    base = {"row": "step()", "workload": workload, "n": n, "k": k}
                    base |= {"latency_s": 0.0, "busy": busy, "seconds": args.seconds}
                    batch_s = measure(base)["call_s"]
                latency_s = batch_s / 2 if latency == "half" else batch_s * 2
            else:
                latency_s = float(latency) / 1000
            common = {"workload": workload, "n": n, "latency_s": latency_s, "busy": busy}
            common["seconds"] = args.seconds
            specs = {f"multienv {row} k={k}": {"row": row, "k": k, **common} for row in ROWS}
            if k != 1:  # one env per worker: recv takes the first envs done, from any worker
                specs["multienv send/recv k=1"] = {"row": "send/recv", "k": 1, **common}
                specs["multienv step() k=1"] = {"row": "step()", "k": 1, **common}
            if workload == "pong" and is_installed("ale_py.vector_env"):
                specs |= {row: {"row": row, "k": None, **common} for row in ALE_ROWS}
            if workload in ENVPOOL_TASKS and is_installed("envpool"):
                specs |= {row: {"row": row, "k": None, **common} for row in ENVPOOL_ROWS}
            specs |= torchrl_specs(common)
            if args.rows:  # the rows named, with the step() they are read against
                wanted = [*args.rows.split(","), f"multienv step() k={k}"]
                specs = {name: spec for name, spec in specs.items() if name in wanted}
            title = f"{cell}, {args.policy} policy of {latency_s * 1000:.2f} ms per call" + (
                {"half": " (half a batch's env time)", "twice": " (twice a batch's env time)"}
            ).get(latency, "")
            out = table(title, specs, f"multienv step() k={k}", args.rounds)
            gains = [
                f"{sync.split()[0]} {out[asynced]['steps_per_s'] / out[sync]['steps_per_s']:.2f}"
                for sync, asynced in (ALE_ROWS, ENVPOOL_ROWS, TORCHRL_ROWS)
                if sync in out and asynced in out
            ]
            if gains:
                ours = max(row["x"] for name, row in out.items() if "send/recv" in name)
                print(f"  async over sync: multienv {ours:.2f} (its best), " + ", ".join(gains))
            auto = out.get(f"multienv send/recv auto k={k}")
            if auto is None:
                continue
            peers = [
                f"{sync.split()[0]}'s best {auto['steps_per_s'] / best:.2f}"
                for sync, asynced in (ALE_ROWS, ENVPOOL_ROWS, TORCHRL_ROWS)
                if sync in out and asynced in out
                for best in [max(out[sync]["steps_per_s"], out[asynced]["steps_per_s"])]
            ]
            picked = ", ".join(f"{int(size)}" for size in auto["picked"])
            print(
                f"  picked batch (auto): {auto['x']:.2f}x step(), batches {picked} of {n} "
                "by round" + "".join(f"; over {peer}" for peer in peers)
            )
    if not is_installed("envpool"):
        print("\nEnvPool: not installed here (pip install envpool; Python >= 3.12), not measured")
    if not TORCHRL_PYTHON and not is_installed("torchrl"):
        print("TorchRL: not installed here (a CPU torch, then pip install torchrl), not measured")


def torchrl_specs(common: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """TorchRL's rows for these settings, where it is installed."""
    if not TORCHRL_PYTHON and not is_installed("torchrl"):
        return {}
    return {row: {"row": row, "k": None, **common} for row in TORCHRL_ROWS}


def dispatch(args: argparse.Namespace) -> None:
    for k in (1, 4):
        common = {"workload": "dispatch", "n": 8, "k": k, "latency_s": 0.0, "busy": False}
        common["seconds"] = args.seconds
        specs = {f"step() k={k}": {"row": "step()", **common}}
        specs[f"send/recv k={k}, as they come"] = {"row": "send/recv", **common}
        if k == 1:  # one env per process, as TorchRL's own pool runs
            specs |= torchrl_specs(common)
        table(f"dispatch: 8 envs that return at once, k={k}", specs, f"step() k={k}", args.rounds)


def slow_reset(args: argparse.Namespace) -> None:
    n = 32
    k = per_core(n)
    common = {"workload": "slowreset", "n": n, "latency_s": 0.0, "busy": False}
    common["seconds"] = max(args.seconds, 4.0)
    specs = {}
    for kk in [*sorted({1, k}), "auto"]:  # auto: the threads of a worker overlap its waits
        name = "auto" if kk == "auto" else f"k={kk}"
        specs[f"step() {name}"] = {"row": "step()", "k": kk, **common}
        specs[f"send/recv {name}"] = {"row": "send/recv", "k": kk, **common}
    specs |= torchrl_specs(common)
    out = table(
        "fast step, slow reset: 32 envs, 1 ms steps, 200 ms reset / 200 steps",
        specs,
        f"step() k={k}",
        args.rounds,
    )
    ceiling = n / 0.002
    for name, row in out.items():
        print(f"  {name:<30} {row['steps_per_s'] / ceiling:.2f} of the ceiling ({ceiling:,.0f}/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", default="pong:16,halfcheetah:16")
    parser.add_argument(
        "--latencies", default="0,1,2,5,half,twice", help="ms per call, half or twice"
    )
    parser.add_argument(
        "--torchrl-python",
        help="the Python that runs TorchRL's rows (a venv with torchrl and multienv), when "
        "it is not this one: torch's wheels and EnvPool's need not share a version",
    )
    parser.add_argument("--policy", choices=("sleep", "busy"), default="sleep")
    parser.add_argument("--rows", default="", help="only these rows (comma-separated names)")
    parser.add_argument("--k", type=int, default=0, help="envs per worker (default N / cores)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--dispatch", action="store_true")
    parser.add_argument("--slow-reset", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrl_python:
        TORCHRL_PYTHON.append(args.torchrl_python)
    if args.child:
        run_child(args)
    elif args.dispatch:
        dispatch(args)
    elif args.slow_reset:
        slow_reset(args)
    else:
        training(args)


if __name__ == "__main__":
    main()
