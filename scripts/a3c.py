"""Asynchronous advantage actor-critic (A3C) on CartPole: learner threads, shared NumPy weights.

Run: python scripts/a3c.py                       (writes runs/<timestamp>-a3c-seed0/)
     python scripts/a3c.py --chaos-kill-every 200

Each learner thread drives its own small MultiEnv (``envs_per_learner`` worker processes),
collects an n-step rollout with the current shared weights, computes gradients on its own,
and applies them to the shared weights. Env stepping happens in the worker processes and
NumPy releases the GIL in its kernels, so the threads overlap.

Updates take a lock (not Hogwild): Adam's in-place moment updates are several NumPy calls
each, and two threads interleaving them would corrupt the moments rather than merely apply
a stale gradient. The lock covers only the optimizer step; rollouts and gradient
computation run unlocked and read the weights as they are (a little staleness is the A3C
trade-off). The model, returns, outputs and chaos come from a2c.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import threading

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # import a2c.py beside us

from a2c import ActorCritic, Args, Chaos, arg, make_vector, parse_args, split_by_envs
from recording import Recorder, make_out_dir, total_restarts

from multienv import MultiEnv


@dataclasses.dataclass
class A3CArgs(Args):
    learners: int = arg(4, "learner threads, each with its own envs")
    envs_per_learner: int = arg(2, "worker processes per learner (num_envs is learners times this)")
    n_steps: int = arg(8, "steps per env between one learner's updates")
    learning_rate: float = arg(7e-4, "Adam step size")
    updates_per_rollout: int = arg(1, "each learner's rollout is already small: one update")


def learner(
    learner_index: int,
    envs: MultiEnv,
    model: ActorCritic,
    update_lock: threading.Lock,
    args: A3CArgs,
    recorder: Recorder,
    chaos: Chaos,
    losses: dict[str, float],
) -> None:
    """Roll out and update until the run is solved or out of budget."""
    rng = np.random.default_rng(args.seed + 1000 * (learner_index + 1))
    obs, _ = envs.reset(seed=args.seed + 100 * learner_index)
    episode_returns = np.zeros(envs.num_envs)
    while not recorder.is_done:
        rollout, obs = model.rollout(envs, obs, episode_returns, args, rng, recorder, chaos)
        for part in split_by_envs(rollout, args.updates_per_rollout):
            grads, step_losses = model.gradients(part, args)
            with update_lock:
                model.apply(grads, args, recorder.env_steps)
                losses.update(step_losses)


def main(args: A3CArgs) -> int:
    logging.basicConfig(level=logging.WARNING, format="\n%(levelname)s %(name)s: %(message)s")
    args.num_envs = args.learners * args.envs_per_learner
    recorder = Recorder(args, make_out_dir(args, "a3c"), "A3C")

    # Setup
    per_worker = min(args.envs_per_worker, args.envs_per_learner)
    groups = [make_vector(args, args.envs_per_learner, per_worker) for _ in range(args.learners)]

    # Seeding
    rng = np.random.default_rng(args.seed)
    model = ActorCritic.create(groups[0], args, rng)
    chaos = Chaos(
        args.chaos_kill_every, [p for g in groups for p in g.envs], args.seed + 1, recorder
    )

    # Rollout and update, in the learner threads
    update_lock = threading.Lock()
    losses: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            learner(index, groups[index], model, update_lock, args, recorder, chaos, losses)
        except BaseException as exc:
            errors.append(exc)
            recorder.stop()  # the other learners end after their current rollout
            raise

    threads = [
        threading.Thread(target=run, args=(i,), name=f"learner-{i}") for i in range(args.learners)
    ]
    try:
        for thread in threads:
            thread.start()
        # Logging
        while any(thread.is_alive() for thread in threads):
            threads[0].join(timeout=args.progress_every_s)
            recorder.progress(sum(total_restarts(g) for g in groups))
        restarts = sum(total_restarts(g) for g in groups)
    finally:
        recorder.stop()
        for thread in threads:
            thread.join(timeout=30)
        for group in groups:
            group.close()
    if errors:
        raise errors[0]
    return recorder.summary(restarts, losses)


if __name__ == "__main__":
    sys.exit(main(parse_args(args_type=A3CArgs, doc=__doc__)))
