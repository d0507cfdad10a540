"""Synchronous advantage actor-critic (A2C) on CartPole, with NumPy only, on a MultiEnv.

Run: python scripts/a2c.py                      (solves CartPole-v1, writes runs/<timestamp>/)
     python scripts/a2c.py --chaos-kill-every 200   (SIGKILLs a random worker every 200 steps)
     python scripts/a2c.py --backend ray            (the envs in Ray actors, on a local cluster)

The envs run in worker processes; the policy and value networks are small NumPy MLPs
trained with Adam on n-step returns. The run stops when the mean return of the last 20
complete episodes reaches 475 (exit 0) or the step budget runs out (exit 1).

Bootstrapping is where hand-written A2C scripts usually go wrong: on termination the return
is the reward alone; on truncation (the time limit, and the truncation multienv reports when
a worker crashed) the return bootstraps from the value of the final observation, which
same-step autoreset hands over in ``infos["final_obs"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np

from multienv import MultiEnv, RayOptions, RestartPolicy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # recording.py beside us
from recording import Recorder, make_out_dir, total_restarts


def arg(default: Any, help_text: str) -> Any:
    """A field of an Args dataclass: its default, and its ``--help`` line."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass
class Args:
    env_id: str = arg(
        "CartPole-v1", "Gymnasium id with a Box observation and Discrete action space"
    )
    num_envs: int = arg(8, "parallel envs")
    envs_per_worker: int = arg(1, "envs each worker process hosts; more is faster on cheap envs")
    backend: str = arg("subprocess", 'where envs run: subprocess, or ray (pip install -e ".[ray]")')
    n_steps: int = arg(8, "steps per env in a rollout (the n of n-step returns)")
    total_steps: int = arg(600_000, "budget of env steps (all envs together)")
    gamma: float = arg(0.99, "discount factor")
    learning_rate: float = arg(7e-4, "Adam step size, for both networks")
    anneal_lr: bool = arg(True, "decay the step size linearly to 0 over total_steps")
    ent_coef: float = arg(0.01, "weight of the entropy bonus in the policy loss")
    updates_per_rollout: int = arg(4, "updates per rollout, each on its own group of envs")
    max_grad_norm: float = arg(0.5, "clip each network's gradient to this global norm")
    hidden: int = arg(64, "units in each of the two hidden layers")
    seed: int = arg(0, "seeds the envs, the weights and the action sampling")
    target_return: float = arg(475.0, "solved when the recent mean return reaches this")
    window: int = arg(20, "episodes in the recent mean")
    chaos_kill_every: int = arg(0, "SIGKILL a random worker every K env steps; 0 turns it off")
    max_restarts: int = arg(50, "restart budget per env per minute (chaos mode needs far more)")
    out_dir: str = arg("", "where to write returns.csv and curve.png; default runs/<timestamp>")
    progress_every_s: float = arg(1.0, "seconds between progress lines on stderr")


ArgsT = TypeVar("ArgsT", bound=Args)


def make_env(env_id: str) -> Callable[[], gym.Env]:
    """Return a zero-argument env factory for the workers.

    A partial of ``gym.make`` pickles by reference to gymnasium, which every worker can
    import, whether this file runs as a script or is imported by a test or by a3c.py.
    """
    return functools.partial(gym.make, env_id)


def backend_options(args: Args) -> dict[str, Any]:
    """MultiEnv's keywords for ``args.backend``: the forkserver's preload, or a quiet Ray."""
    if args.backend == "ray":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet = {"include_dashboard": False, "log_to_driver": False}
        return {"backend": "ray", "ray_options": RayOptions(init_kwargs=quiet)}
    return {"backend": args.backend, "preload": env_modules(args.env_id)}


def env_modules(env_id: str) -> list[str]:
    """The module ``gym.make(env_id)`` imports, for the forkserver to import once for all."""
    entry_point = gym.spec(env_id).entry_point
    return [entry_point.partition(":")[0]] if isinstance(entry_point, str) else []


# ----------------------------------------------------------------------------- model


class MLP:
    """Two tanh hidden layers and a linear output, with hand-written backprop."""

    def __init__(self, sizes: list[int], rng: np.random.Generator, out_scale: float) -> None:
        self.params: list[np.ndarray] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            scale = out_scale if i == len(sizes) - 2 else np.sqrt(2.0)
            q, _ = np.linalg.qr(rng.normal(size=(max(fan_in, fan_out), min(fan_in, fan_out))))
            weight = q if fan_in >= fan_out else q.T  # orthogonal init, as in most A2C code
            self.params += [scale * weight[:fan_in, :fan_out], np.zeros(fan_out)]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Return the output and the activations that ``backward`` needs."""
        activations = [x]
        for i in range(0, len(self.params) - 2, 2):
            x = np.tanh(x @ self.params[i] + self.params[i + 1])
            activations.append(x)
        return x @ self.params[-2] + self.params[-1], activations

    def backward(self, grad_out: np.ndarray, activations: list[np.ndarray]) -> list[np.ndarray]:
        """Return d(loss)/d(param) for every param, given d(loss)/d(output)."""
        grads: list[np.ndarray] = [np.empty(0)] * len(self.params)
        grad = grad_out
        for layer in range(len(self.params) // 2 - 1, -1, -1):
            inputs = activations[layer]
            grads[2 * layer] = inputs.T @ grad
            grads[2 * layer + 1] = grad.sum(axis=0)
            if layer > 0:
                grad = (grad @ self.params[2 * layer].T) * (1.0 - inputs**2)
        return grads


class Adam:
    """Adam on a list of arrays, updated in place, with global-norm gradient clipping."""

    def __init__(self, params: list[np.ndarray], lr: float, max_grad_norm: float) -> None:
        self.params, self.lr, self.max_grad_norm = params, lr, max_grad_norm
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = 0

    def step(self, grads: list[np.ndarray]) -> float:
        norm = float(np.sqrt(sum(float((g * g).sum()) for g in grads)))
        clip = min(1.0, self.max_grad_norm / (norm + 1e-8))
        self.t += 1
        beta1, beta2 = 0.9, 0.999
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            g = g * clip
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            m_hat = m / (1 - beta1**self.t)
            v_hat = v / (1 - beta2**self.t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)
        return norm


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def nstep_returns(
    rewards: np.ndarray,
    terminations: np.ndarray,
    truncations: np.ndarray,
    final_values: np.ndarray,
    bootstrap_values: np.ndarray,
    gamma: float,
    crashed: np.ndarray | None = None,
) -> np.ndarray:
    """n-step discounted returns of a rollout, arrays shaped (n_steps, num_envs).

    At a termination the return is the reward alone. At a truncation it bootstraps from
    ``final_values`` (the value of the episode's final observation); the episode does not
    continue into the next one. After the last step it bootstraps from ``bootstrap_values``.

    A step where a worker crashed (``crashed``) did not happen: the env was cut off before
    acting, at the observation the step started from, whose value ``final_values`` holds.
    Its return is that value itself (no reward, no discount), so the step before it
    bootstraps from it and the crashed step's own advantage is zero.
    """
    returns = np.zeros_like(rewards, dtype=np.float64)
    following = bootstrap_values.astype(np.float64)
    for t in range(rewards.shape[0] - 1, -1, -1):
        following = np.where(truncations[t], final_values[t], following)
        following = np.where(terminations[t], 0.0, following)
        returns[t] = rewards[t] + gamma * following
        if crashed is not None:
            returns[t] = np.where(crashed[t], final_values[t], returns[t])
        following = returns[t]
    return returns


def a2c_gradients(
    actor: MLP,
    critic: MLP,
    obs: np.ndarray,
    actions: np.ndarray,
    returns: np.ndarray,
    ent_coef: float,
) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """Gradients of the A2C losses for one batch, and the losses themselves."""
    batch = obs.shape[0]
    logits, actor_acts = actor.forward(obs)
    values, critic_acts = critic.forward(obs)
    values = values[:, 0]
    probs = softmax(logits)
    log_probs = np.log(probs + 1e-12)
    advantages = returns - values
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    entropy = -(probs * log_probs).sum(axis=1)

    onehot = np.eye(logits.shape[1])[actions]
    grad_logits = -(advantages[:, None] * (onehot - probs)) / batch
    grad_logits += ent_coef * probs * (log_probs + entropy[:, None]) / batch
    grad_values = ((values - returns) / batch)[:, None]
    losses = {
        "policy_loss": float(-(advantages * log_probs[np.arange(batch), actions]).mean()),
        "value_loss": float(0.5 * ((values - returns) ** 2).mean()),
        "entropy": float(entropy.mean()),
    }
    return (
        actor.backward(grad_logits, actor_acts),
        critic.backward(grad_values, critic_acts),
        losses,
    )


# ----------------------------------------------------------------------------- outputs


class Chaos:
    """SIGKILLs a random worker every ``every`` env steps, through the public pid accessor."""

    def __init__(self, every: int, envs: list[Any], seed: int, recorder: Recorder) -> None:
        self.every, self.envs, self.recorder = every, envs, recorder
        self.rng = np.random.default_rng(seed)
        self.next_kill = every
        self.lock = threading.Lock()

    def maybe_kill(self) -> None:
        if not self.every:
            return
        with self.lock:
            if self.recorder.env_steps < self.next_kill:
                return
            self.next_kill += self.every
            victim = self.envs[int(self.rng.integers(len(self.envs)))]
            if victim.pid is None:
                return  # a Ray actor being replaced (by another A3C learner)
            try:
                os.kill(victim.pid, signal.SIGKILL)  # a Ray actor's process, on Ray
            except ProcessLookupError:
                return  # already dead and being respawned (another A3C learner's env)
            self.recorder.kill_steps.append(self.recorder.env_steps)


@dataclasses.dataclass
class Rollout:
    obs: np.ndarray  # (n_steps, num_envs, obs_dim)
    actions: np.ndarray  # (n_steps, num_envs)
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    final_values: np.ndarray  # value of the final observation, where an episode was truncated
    bootstrap: np.ndarray  # (num_envs,) value of the observation after the last step
    crashed: np.ndarray  # (n_steps, num_envs) the step was a worker crash's truncation


def collect_rollout(
    envs: MultiEnv,
    actor: MLP,
    critic: MLP,
    obs: np.ndarray,
    episode_returns: np.ndarray,
    n_steps: int,
    rng: np.random.Generator,
    recorder: Recorder,
    chaos: Chaos,
) -> tuple[Rollout, np.ndarray]:
    """Step ``envs`` n_steps times with the current policy; return the rollout and next obs."""
    num_envs = envs.num_envs
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    num_actions = int(envs.single_action_space.n)
    shape = (n_steps, num_envs)
    rollout = Rollout(
        np.zeros((*shape, obs_dim)),
        np.zeros(shape, dtype=np.int64),
        np.zeros(shape),
        np.zeros(shape, bool),
        np.zeros(shape, bool),
        np.zeros(shape),
        np.zeros(num_envs),
        np.zeros(shape, bool),
    )
    for t in range(n_steps):
        chaos.maybe_kill()
        flat_obs = obs.reshape(num_envs, -1)
        probs = softmax(actor.forward(flat_obs)[0])
        actions = (rng.random((num_envs, 1)) > probs.cumsum(axis=1)).sum(axis=1)
        actions = np.minimum(actions, num_actions - 1)
        rollout.obs[t], rollout.actions[t] = flat_obs, actions
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        rollout.rewards[t], rollout.terminations[t], rollout.truncations[t] = (
            rewards,
            terminations,
            truncations,
        )
        recorder.add_steps(num_envs)
        episode_returns += rewards
        # A crash's truncation says "restarted"; a recycled worker's reset says "recycled".
        crashed = infos.get("multienv", {}).get("_restarted", np.zeros(num_envs, bool))
        rollout.crashed[t] = crashed
        for i in np.flatnonzero(truncations & ~terminations):
            final_obs = np.asarray(infos["final_obs"][i], dtype=np.float64).reshape(1, -1)
            rollout.final_values[t, i] = critic.forward(final_obs)[0][0, 0]
        for i in np.flatnonzero(terminations | truncations):
            recorder.episode(float(episode_returns[i]), bool(crashed[i]))
            episode_returns[i] = 0.0
    rollout.bootstrap = critic.forward(obs.reshape(num_envs, -1))[0][:, 0]
    return rollout, obs


def rollout_gradients(
    actor: MLP, critic: MLP, rollout: Rollout, args: Args
) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """n-step returns of a rollout, then the A2C gradients on its steps that happened."""
    returns = nstep_returns(
        rollout.rewards,
        rollout.terminations,
        rollout.truncations,
        rollout.final_values,
        rollout.bootstrap,
        args.gamma,
        rollout.crashed,
    )
    obs_dim = rollout.obs.shape[-1]
    real = ~rollout.crashed.reshape(-1)  # a crashed step taught nothing: leave it out
    return a2c_gradients(
        actor,
        critic,
        rollout.obs.reshape(-1, obs_dim)[real],
        rollout.actions.reshape(-1)[real],
        returns.reshape(-1)[real],
        args.ent_coef,
    )


def split_by_envs(rollout: Rollout, parts: int) -> list[Rollout]:
    """The rollout as ``parts`` rollouts of disjoint groups of envs, one update each.

    One update per 256-step rollout (32 steps of 8 envs) left A2C short of updates: under
    ``--chaos-kill-every 200`` it took 197k-518k steps to solve, and 1 run in 10 sank to a
    mean return of about 150 and stayed there until the budget ran out. A3C, with an update
    per 16 steps, solved every run in 87k-194k. Four updates per 64-step rollout (8 steps,
    groups of 2 envs) make A2C's updates as frequent and as small as A3C's, in lock step.
    """
    if parts <= 1:
        return [rollout]
    arrays = [getattr(rollout, field.name) for field in dataclasses.fields(Rollout)]
    return [
        Rollout(*(array[:, group] if array.ndim > 1 else array[group] for array in arrays))
        for group in np.array_split(np.arange(rollout.bootstrap.shape[0]), parts)
        if group.size
    ]


def anneal(args: Args, env_steps: int, optimizers: tuple[Adam, ...]) -> None:
    """Decay the step size linearly to 0 over the budget, when ``args.anneal_lr`` is set.

    A fixed step size lets A2C collapse and recover again and again near the target; the
    decay lets it settle.
    """
    if args.anneal_lr:
        lr = args.learning_rate * max(0.0, 1.0 - env_steps / args.total_steps)
        for optimizer in optimizers:
            optimizer.lr = lr


def make_vector(args: Args, num_envs: int, envs_per_worker: int) -> MultiEnv:
    """``num_envs`` envs of ``args.env_id`` in subprocess workers (or Ray actors)."""
    return MultiEnv(
        [make_env(args.env_id)] * num_envs,
        autoreset_mode="SameStep",
        restart_policy=restart_policy(args),
        envs_per_worker=envs_per_worker,
        **backend_options(args),
    )


@dataclasses.dataclass
class ActorCritic:
    """The policy and value networks, and their optimizers."""

    actor: MLP
    critic: MLP
    optimizers: tuple[Adam, Adam]

    @classmethod
    def create(cls, envs: MultiEnv, args: Args, rng: np.random.Generator) -> ActorCritic:
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        num_actions = int(envs.single_action_space.n)
        actor = MLP([obs_dim, args.hidden, args.hidden, num_actions], rng, out_scale=0.01)
        critic = MLP([obs_dim, args.hidden, args.hidden, 1], rng, out_scale=1.0)
        optimizers = (
            Adam(actor.params, args.learning_rate, args.max_grad_norm),
            Adam(critic.params, args.learning_rate, args.max_grad_norm),
        )
        return cls(actor, critic, optimizers)

    def rollout(
        self,
        envs: MultiEnv,
        obs: np.ndarray,
        episode_returns: np.ndarray,
        args: Args,
        rng: np.random.Generator,
        recorder: Recorder,
        chaos: Chaos,
    ) -> tuple[Rollout, np.ndarray]:
        """Step ``envs`` n_steps times with the policy; the rollout and the next obs."""
        return collect_rollout(
            envs, self.actor, self.critic, obs, episode_returns, args.n_steps, rng, recorder, chaos
        )

    def gradients(
        self, rollout: Rollout, args: Args
    ) -> tuple[tuple[list[np.ndarray], list[np.ndarray]], dict[str, float]]:
        """Both networks' gradients on a rollout, and the losses."""
        actor_grads, critic_grads, losses = rollout_gradients(
            self.actor, self.critic, rollout, args
        )
        return (actor_grads, critic_grads), losses

    def apply(
        self, grads: tuple[list[np.ndarray], list[np.ndarray]], args: Args, env_steps: int
    ) -> None:
        """One optimizer step of both networks, at the step size for ``env_steps``."""
        anneal(args, env_steps, self.optimizers)
        self.optimizers[0].step(grads[0])
        self.optimizers[1].step(grads[1])


def restart_policy(args: Args) -> RestartPolicy:
    # Chaos mode kills workers faster than any real crash would (at 4,000 steps/s, every 200
    # steps is 20 kills a second), so it lifts the budget that guards against crash loops.
    max_restarts = 100_000 if args.chaos_kill_every else args.max_restarts
    return RestartPolicy(max_restarts=max_restarts, window_s=60.0)


# ----------------------------------------------------------------------------- main


def main(args: Args) -> int:
    logging.basicConfig(level=logging.WARNING, format="\n%(levelname)s %(name)s: %(message)s")
    recorder = Recorder(args, make_out_dir(args, "a2c"), "A2C")

    # Setup
    envs = make_vector(args, args.num_envs, args.envs_per_worker)

    # Seeding
    rng = np.random.default_rng(args.seed)
    model = ActorCritic.create(envs, args, rng)
    chaos = Chaos(args.chaos_kill_every, envs.envs, args.seed + 1, recorder)
    obs, _ = envs.reset(seed=args.seed)
    episode_returns = np.zeros(args.num_envs)

    losses: dict[str, float] = {}
    try:
        while not recorder.is_done:
            # Rollout
            rollout, obs = model.rollout(envs, obs, episode_returns, args, rng, recorder, chaos)
            # Update
            for part in split_by_envs(rollout, args.updates_per_rollout):
                grads, losses = model.gradients(part, args)
                model.apply(grads, args, recorder.env_steps)
            # Logging
            recorder.progress(total_restarts(envs), timing=getattr(envs, "timing", None))
        restarts = total_restarts(envs)
    finally:
        envs.close()
    return recorder.summary(restarts, losses)


def parse_args(
    argv: list[str] | None = None, args_type: type[ArgsT] = Args, doc: str = __doc__
) -> ArgsT:
    """One ``--flag`` per field of the Args dataclass, typed by its default, with its help."""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for field in dataclasses.fields(args_type):
        flag = f"--{field.name.replace('_', '-')}"
        help_text = field.metadata.get("help", "")
        if isinstance(field.default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        else:
            parser.add_argument(
                flag, type=type(field.default), default=field.default, help=help_text
            )
    return args_type(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(parse_args()))
