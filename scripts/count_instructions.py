"""Count the CPU instructions multienv spends per step, with valgrind: repeatable on a noisy VM.

Run:
    python scripts/count_instructions.py                    # parent, zero-cost env, k=1 and k=8
    python scripts/count_instructions.py --env cartpole --num-envs 64 --workers 2,4,8,16
                                         # the parent per step by worker count, beside the
                                         # bare probe's parent (scripts/bare_probe.py)
    python scripts/count_instructions.py --side worker      # one worker's batch, k=1 and 8
    python scripts/count_instructions.py --side async --env cartpole --num-envs 64 --workers 2,16
                                         # the parent per recv(N/2) + send, beside half the
                                         # probe's step
    python scripts/count_instructions.py --baseline /tmp/old   # the same for another checkout
                                         # (e.g. git worktree add /tmp/old HEAD~1)
    apt-get install valgrind             # needed; the script says so when it is missing

Throughput on a shared 2-core VM moves by 10% or more between runs, which hides the cuts of
a per-step path that are worth making one by one. Instructions do not move with the
neighbours: callgrind counts those the process runs in user space (``PYTHONHASHSEED=0``),
the same count each run for a worker's loop, within a few percent for the parent, whose
path depends on when the workers answer. Kernel time, cache misses and wake-ups are not
counted, so a change that trades one for instructions still needs ``scripts/bench.py``.

``--side parent``: a ``MultiEnv`` of N envs (``--num-envs``, 16 by default), default mode
(``--autoreset SameStep`` for same-step autoreset; the probe resets
as same-step does, without reporting the final observation; ``--autoreset Disabled``
counts each step with the caller's reset of the envs it ended, by mask, which the probe
does not make); only the parent process is
counted (the workers fork from a server it starts, outside
valgrind). The counters are zeroed after a warm-up and dumped after ``--steps`` vector
steps, so start-up is not counted. Each layout is also counted for the bare probe of the
same layout (its parent only: its forked workers run under valgrind too, slowly, uncounted),
and the last line gives each one's instructions per added worker.

``--side async``: the same vector's EnvPool-style loop, ``recv(batch_size=N // 2)`` then
``send`` of those envs (the parts plane), counted per cycle of N/2 env steps; the probe's
line is half its synchronous step, the same env steps. "probe-async" is the bare probe's
own send/recv loop on the same layout (``BareProbe.send``/``recv``: whole workers, each
saying it is done, copies of the results and the env ids, nothing else): that loop's floor.
"probe-ring" is the same loop on EnvPool's layout (``BareProbe``'s ``RingProbe``: workers
write each finished env into the next free row, so that a batch is one slice of each array);
"probe-ring-views" the same returning views of those slices, not copies.

``--side worker``: one worker's planned steps (``worker.planned_step.PlannedStep``)
stepping k envs (``--layouts``, 1 and 8 by default), run in this process on the vector's
real shared memory and done pipes, counted the same way; each batch also counts the few
lines that stand in for the parent (writing the actions and flags, draining the pipes), so
the k=1 line is the cost per wake-up and the slope to k=8 the cost per env. Envs: ``zero``
(no work; HalfCheetah's spaces and its info of four floats), ``cartpole`` and
``halfcheetah`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any

import gymnasium as gym
import numpy as np


@dataclasses.dataclass
class Args:
    side: str = "parent"  # "parent" (per vector step), "async" (per recv(N/2) + send) or
    # "worker" (per batch of 8)
    env: str = "zero"  # zero, cartpole or halfcheetah
    layouts: str = "1,8"  # the envs_per_worker values to count (--side worker: k per batch)
    workers: str = ""  # --side parent: worker counts to count instead (k = ceil(N / W))
    num_envs: int = 16  # --side parent: envs in the vector
    autoreset: str = "NextStep"  # --side parent and async: the vector's autoreset mode
    steps: int = 400  # vector steps (parent) or batches (worker) counted
    repeats: int = 1  # counts per checkout and layout
    baseline: str = ""  # another checkout of multienv, counted the same way
    child: str = ""  # internal: run one counted process ("parent" or "worker")


class ZeroEnv(gym.Env):
    """No work: HalfCheetah's observation and action spaces, and its info of four floats."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (17,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)

    def __init__(self) -> None:
        self._obs = np.zeros(17)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs.copy(), {}

    def step(self, action):
        self.t += 1
        info = {"x_position": 0.1, "x_velocity": 0.2, "reward_forward": 0.3, "reward_ctrl": -0.1}
        return self._obs.copy(), 0.5, False, self.t >= 1000, info


def make_env(name: str) -> gym.Env:
    if name == "zero":
        return ZeroEnv()
    return gym.make({"cartpole": "CartPole-v1", "halfcheetah": "HalfCheetah-v5"}[name])


# ----------------------------------------------------------------- the counted processes


def wait_for_mark(label: str) -> None:
    """Tell the counting process where we are, and wait until it has zeroed or dumped."""
    print(label, flush=True)
    sys.stdin.readline()


def count_steps(step, actions: list, steps: int) -> None:
    """Warm up, then the counted steps between the two marks."""
    for t in range(50):
        step(actions[t % 64])
    wait_for_mark("READY")
    for t in range(steps):
        step(actions[t % 64])
    wait_for_mark("DONE")


def run_parent(
    env_name: str, k: int, steps: int, num_envs: int = 16, autoreset: str = "NextStep"
) -> None:
    from multienv import MultiEnv

    fns = [lambda: make_env(env_name)] * num_envs
    with MultiEnv(fns, envs_per_worker=k, autoreset_mode=autoreset) as envs:
        envs.reset(seed=0)

        def step_and_reset(actions: np.ndarray) -> None:  # Disabled: the caller resets
            _, _, terminated, truncated, _ = envs.step(actions)
            ended = terminated | truncated
            if ended.any():
                envs.reset(options={"reset_mask": ended})

        step = step_and_reset if autoreset == "Disabled" else envs.step
        count_steps(step, [envs.action_space.sample() for _ in range(64)], steps)


def run_async(
    env_name: str, k: int, steps: int, num_envs: int = 16, autoreset: str = "NextStep"
) -> None:
    from multienv import MultiEnv

    fns = [lambda: make_env(env_name)] * num_envs
    with MultiEnv(fns, envs_per_worker=k, autoreset_mode=autoreset) as envs:
        envs.reset(seed=0)
        envs.send(envs.action_space.sample())

        def cycle(actions: np.ndarray) -> None:
            *_, infos = envs.recv(batch_size=num_envs // 2)
            ids = infos["env_id"]
            envs.send(actions[ids], ids)

        count_steps(cycle, [envs.action_space.sample() for _ in range(64)], steps)
        envs.recv()


def run_probe(env_name: str, k: int, steps: int, num_envs: int, loop: str = "step") -> None:
    """The bare probe of the layout: its step, or a send/recv loop of recv(N/2), send back.

    ``loop``: "step"; "async" (``BareProbe.send``/``recv``); "ring" or "ring-views"
    (``RingProbe``, EnvPool's layout, returning copies or views of its rows).
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bare_probe import BareProbe, RingProbe

    fns = [lambda: make_env(env_name)] * num_envs
    space = gym.vector.utils.batch_space(make_env(env_name).action_space, num_envs)
    actions = [space.sample() for _ in range(64)]
    if loop.startswith("ring"):
        probe: Any = RingProbe(fns, k, actions[0], loop == "ring-views")
        probe.returned = list(range(len(probe.wakes)))  # the first resets: every worker
    else:
        probe = BareProbe(fns, k, False, actions[0])
        probe.reset()
    try:
        if loop == "step":
            count_steps(probe.step, actions, steps)
            return
        probe.send(actions[0], np.arange(num_envs))

        def cycle(batch: np.ndarray) -> None:
            *_, ids = probe.recv(num_envs // 2)
            probe.send(batch[ids], ids)

        count_steps(cycle, actions, steps)
        probe.recv(num_envs - num_envs // 2)
    finally:
        probe.close()


def run_worker(env_name: str, steps: int, num_envs: int = 8) -> None:
    import cloudpickle

    from multienv.wire import framing
    from multienv.wire.done_pipes import DoneNotifier
    from multienv.wire.shared_memory import SharedBatch, SlotWriter
    from multienv.worker.runner import EnvRunner
    from multienv.worker.worker import _Loop

    probe = make_env(env_name)
    shared = SharedBatch(probe.observation_space, probe.action_space, num_envs, [[0]])
    layout = pickle.loads(pickle.dumps(shared.layout))  # as the worker receives it
    assert shared.fd is not None
    assert shared.actions is not None
    fds = tuple(os.dup(fd) for fd in shared.done.worker_fds(0))
    writer = SlotWriter(layout, os.dup(shared.fd), DoneNotifier(0, fds), range(num_envs))
    runner = EnvRunner([cloudpickle.dumps(lambda: make_env(env_name))] * num_envs)
    runner.build()
    for position, env in enumerate(runner.envs):
        env.reset(seed=position)
    worker_end, parent_end = socket.socketpair()
    parent_end.setblocking(False)
    loop = _Loop(worker_end, runner)
    loop.is_trimmed = True
    if hasattr(loop, "use"):
        loop.use(writer)
    else:  # a checkout from before the worker's planned step (``--baseline``)
        loop.writer = writer
    planned = getattr(loop, "planned", None)
    actions = [
        np.asarray([probe.action_space.sample() for _ in range(num_envs)], shared.actions.dtype)
        for _ in range(64)
    ]
    flags = [  # a step of every env, observations to slot 0 or 1: what the parent writes
        framing.item_flags(
            np.zeros(num_envs, np.bool_), np.full(num_envs, slot), False, info_columns=True
        )
        for slot in (0, 1)
    ]
    done_read = shared.done.done_read(0)

    def drain_replies() -> None:  # the first batch's reply (the info schema), resets' infos
        try:
            while parent_end.recv(65536):
                pass
        except BlockingIOError:
            pass

    def run(count: int) -> None:
        for t in range(count):
            shared.actions[:] = actions[t % 64]
            shared.plan_flags[:] = flags[t & 1]
            shared.done.expect(0, t % 255 + 1)
            if planned is not None:  # as the loop does on a PLANNED_STEP
                planned.run(framing.PLANNED_STEP)
            else:
                loop._fast_batch(*writer.planned_items(), False, True)
            shared.done.drain(done_read)
            drain_replies()

    run(50)
    wait_for_mark("READY")
    run(steps)
    wait_for_mark("DONE")


def count(tree: str, child: list[str], per: int) -> float:
    """Run one counted process of checkout ``tree``; its instructions between the marks / per."""
    python = os.path.realpath(sys.executable)  # not a shim: valgrind would count the shim
    out_dir = tempfile.mkdtemp(prefix="multienv-callgrind-")
    out = os.path.join(out_dir, "callgrind.out")
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--trace-children=no",
        f"--callgrind-out-file={out}",
        python,
        os.path.abspath(__file__),
        "--child",
        *child,
    ]
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tree,  # workers import multienv from the current directory first
        )
        assert process.stdin is not None
        assert process.stdout is not None
        for label, control in (("READY", "-z"), ("DONE", "-d")):
            line = process.stdout.readline().strip()
            if line != label:
                process.kill()
                raise RuntimeError(f"the counted process said {line!r}, expected {label}")
            subprocess.run(
                ["callgrind_control", control, str(process.pid)], check=True, capture_output=True
            )
            process.stdin.write("\n")
            process.stdin.flush()
        process.wait(timeout=600)
        dumps = sorted(glob.glob(out + ".*"))  # the dump of -d; the exit dump has no suffix
        text = open(dumps[0]).read()
        match = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
        assert match is not None
        return int(match.group(1)) / per
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def main(args: Args) -> None:
    if args.child:
        side, env_name, k = args.child, args.env, int(args.layouts)
        if side == "parent":
            run_parent(env_name, k, args.steps, args.num_envs, args.autoreset)
        elif side == "async":
            run_async(env_name, k, args.steps, args.num_envs, args.autoreset)
        elif side.startswith("probe"):  # probe, probe-async, probe-ring, probe-ring-views
            run_probe(env_name, k, args.steps, args.num_envs, side[6:] or "step")
        else:
            run_worker(env_name, args.steps, k)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind is not installed: apt-get install valgrind")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this", here)] + ([("baseline", args.baseline)] if args.baseline else [])
    n = args.num_envs
    is_parent = args.side in ("parent", "async")
    if args.workers and is_parent:
        layouts = [-(-n // int(w)) for w in args.workers.split(",")]
    else:
        layouts = [int(k) for k in args.layouts.split(",")]
    if is_parent:
        trees.append(("probe", here))
    if args.side == "async":
        trees += [(name, here) for name in ("probe-async", "probe-ring", "probe-ring-views")]
    unit = {"parent": f"vector step of {n} envs", "async": f"recv({n // 2}) + send"}.get(
        args.side, "batch of a worker's k envs"
    )
    mode = f", {args.autoreset}" if is_parent else ""
    print(f"{args.side}, env {args.env}{mode}: instructions per {unit} ({args.steps} counted)")
    medians: dict[str, list[tuple[int, float]]] = {name: [] for name, _ in trees}
    for k in layouts:
        counts = {}
        for name, tree in trees:
            side = name if name.startswith("probe") else args.side
            child = [side, "--env", args.env, "--layouts", str(k), "--steps", str(args.steps)]
            child += ["--num-envs", str(n), "--autoreset", args.autoreset]
            per = args.steps * (2 if name == "probe" and args.side == "async" else 1)
            counts[name] = [count(tree, child, per) for _ in range(args.repeats)]
            medians[name].append((-(-n // k) if is_parent else k, float(np.median(counts[name]))))
            shown = ", ".join(f"{value:,.0f}" for value in counts[name])
            workers = f"W={-(-n // k):<3} " if is_parent else ""
            print(f"  {workers}k={k:<3} {name:9s} {shown}", flush=True)
        if args.baseline:
            ratio = np.median(counts["this"]) / np.median(counts["baseline"])
            print(f"  k={k:<3} this/baseline {ratio:.3f}")
        if "probe" in counts:
            ratio = np.median(counts["this"]) / np.median(counts["probe"])
            print(f"  k={k:<3} this/probe {ratio:.2f}")
        if "probe-async" in counts:
            ratio = np.median(counts["probe-async"]) / np.median(counts["probe"])
            print(f"  k={k:<3} probe-async/probe {ratio:.2f} (the loop's floor, bare)")
            ratio = np.median(counts["probe-ring"]) / np.median(counts["probe"])
            print(f"  k={k:<3} probe-ring/probe {ratio:.2f} (EnvPool's layout, bare)")
            ratio = np.median(counts["probe-ring-views"]) / np.median(counts["probe"])
            print(f"  k={k:<3} probe-ring-views/probe {ratio:.2f} (the same, returning views)")
    if len(layouts) > 1:
        for name, rows in medians.items():
            (w0, first), (w1, last) = min(rows), max(rows)
            if w1 > w0 and is_parent:
                growth = (last - first) / (w1 - w0)
                print(f"  {name}: {growth:,.0f} instructions per added worker (W={w0} to {w1})")
            elif w1 > w0:
                growth = (last - first) / (w1 - w0)
                print(f"  {name}: {growth:,.0f} instructions per added env (k={w0} to {w1})")


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, dest=field.name, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":
    main(parse_args())
