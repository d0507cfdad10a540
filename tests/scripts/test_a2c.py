"""Smoke tests of the example scripts' main(), and the return computation they rely on."""

import csv
import importlib.util
import pathlib
import re
import sys

import numpy as np
import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def load(name):
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


a2c = load("a2c")


def test_nstep_returns_bootstrap_only_where_the_episode_was_cut_off():
    gamma = 0.5
    rewards = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    terminations = np.array([[False, False], [True, False], [False, False]])
    truncations = np.array([[False, False], [False, True], [False, False]])
    final_values = np.array([[0.0, 0.0], [0.0, 8.0], [0.0, 0.0]])
    bootstrap = np.array([4.0, 2.0])
    returns = a2c.nstep_returns(rewards, terminations, truncations, final_values, bootstrap, gamma)
    # env 0: terminated at t=1, so t=1 is the reward alone and t=0 sees only t=1.
    # env 1: truncated at t=1, so t=1 bootstraps from the final observation's value (8).
    # After the episode ends, t=2 starts a new one and bootstraps from the next value.
    assert returns[:, 0].tolist() == [1.5, 1.0, 1.0 + 0.5 * 4.0]
    assert returns[:, 1].tolist() == [1.0 + 0.5 * 5.0, 1.0 + 0.5 * 8.0, 1.0 + 0.5 * 2.0]


def test_a_crashed_step_returns_its_starting_value_and_the_step_before_bootstraps_from_it():
    gamma = 0.5
    rewards = np.array([[1.0], [0.0], [1.0]])  # t=1: the worker died; multienv says reward 0
    truncations = np.array([[False], [True], [False]])
    final_values = np.array([[0.0], [6.0], [0.0]])  # V of the obs t=1 started from
    crashed = np.array([[False], [True], [False]])
    returns = a2c.nstep_returns(
        rewards, np.zeros((3, 1), bool), truncations, final_values, np.array([4.0]), gamma, crashed
    )
    # t=1 did not happen: its return is V(obs_1) itself, not 0 + gamma * V(obs_1).
    assert returns[:, 0].tolist() == [1.0 + 0.5 * 6.0, 6.0, 1.0 + 0.5 * 4.0]


def test_nstep_returns_without_episode_end_discount_the_bootstrap():
    returns = a2c.nstep_returns(
        np.ones((2, 1)),
        np.zeros((2, 1), bool),
        np.zeros((2, 1), bool),
        np.zeros((2, 1)),
        np.array([10.0]),
        0.9,
    )
    assert returns[:, 0] == pytest.approx([1 + 0.9 * (1 + 0.9 * 10), 1 + 0.9 * 10])


def test_split_by_envs_partitions_the_rollout_and_keeps_each_env_whole():
    rng = np.random.default_rng(0)
    n_steps, num_envs = 3, 5
    shape = (n_steps, num_envs)
    rollout = a2c.Rollout(
        rng.normal(size=(*shape, 4)),
        rng.integers(0, 2, shape),
        rng.normal(size=shape),
        rng.random(shape) < 0.3,
        rng.random(shape) < 0.3,
        rng.normal(size=shape),
        rng.normal(size=num_envs),
        rng.random(shape) < 0.3,
    )
    parts = a2c.split_by_envs(rollout, 2)
    assert [part.bootstrap.shape[0] for part in parts] == [3, 2]
    for name in ("obs", "actions", "rewards", "terminations", "truncations", "crashed"):
        joined = np.concatenate([getattr(part, name) for part in parts], axis=1)
        np.testing.assert_array_equal(joined, getattr(rollout, name), err_msg=name)
    np.testing.assert_array_equal(
        np.concatenate([part.bootstrap for part in parts]), rollout.bootstrap
    )

    def returns(r):
        return a2c.nstep_returns(
            r.rewards, r.terminations, r.truncations, r.final_values, r.bootstrap, 0.9, r.crashed
        )

    np.testing.assert_allclose(np.concatenate([returns(p) for p in parts], 1), returns(rollout))
    assert a2c.split_by_envs(rollout, 1)[0] is rollout


def test_mlp_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    net = a2c.MLP([3, 5, 4, 2], rng, out_scale=1.0)
    x = rng.normal(size=(6, 3))
    upstream = rng.normal(size=(6, 2))
    _out, acts = net.forward(x)
    grads = net.backward(upstream, acts)
    param, grad = net.params[2], grads[2]
    eps = 1e-6
    param[1, 2] += eps
    plus = (net.forward(x)[0] * upstream).sum()
    param[1, 2] -= 2 * eps
    minus = (net.forward(x)[0] * upstream).sum()
    param[1, 2] += eps
    assert grad[1, 2] == pytest.approx((plus - minus) / (2 * eps), rel=1e-5)


def check_outputs(out_dir, expect_png=True):
    rows = list(csv.DictReader(open(out_dir / "returns.csv")))
    assert rows, "no episode was recorded"
    assert all(np.isfinite(float(r["return"])) for r in rows)
    assert (out_dir / "curve.png").exists() == expect_png


def test_command_line_flags_follow_the_args_fields_and_their_comments(capsys):
    a3c = load("a3c")
    args = a3c.parse_args(
        ["--no-anneal-lr", "--learners", "3", "--gamma", "0.9"], a3c.A3CArgs, a3c.__doc__
    )
    assert (args.anneal_lr, args.learners, args.gamma) == (False, 3, 0.9)
    with pytest.raises(SystemExit):
        a3c.parse_args(["--help"], a3c.A3CArgs, a3c.__doc__)
    help_text = " ".join(capsys.readouterr().out.split())
    assert "discount factor (default: 0.99)" in help_text  # a2c.Args field
    assert "learner threads, each with its own envs (default: 4)" in help_text  # A3CArgs


def test_a2c_main_runs_and_writes_outputs(tmp_path, capsys):
    code = a2c.main(a2c.Args(total_steps=256, num_envs=2, out_dir=str(tmp_path)))
    assert code == 1  # a tiny budget cannot solve CartPole
    check_outputs(tmp_path, expect_png=importlib.util.find_spec("matplotlib") is not None)
    summary = capsys.readouterr().err
    assert "budget ran out" in summary
    losses = dict(re.findall(r"(policy_loss|value_loss|entropy) ([^,;]+)", summary))
    assert set(losses) == {"policy_loss", "value_loss", "entropy"}
    assert all(np.isfinite(float(value)) for value in losses.values()), losses


def test_a3c_main_runs_and_writes_outputs(tmp_path, capsys):
    a3c = load("a3c")
    code = a3c.main(
        a3c.A3CArgs(total_steps=256, learners=2, envs_per_learner=1, out_dir=str(tmp_path))
    )
    assert code == 1
    check_outputs(tmp_path, expect_png=importlib.util.find_spec("matplotlib") is not None)
    assert "budget ran out" in capsys.readouterr().err


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_a2c_chaos_smoke_kills_and_respawns(tmp_path, capsys, envs_per_worker):
    a2c.main(
        a2c.Args(
            total_steps=512,
            num_envs=2 * envs_per_worker,
            envs_per_worker=envs_per_worker,
            chaos_kill_every=64,
            out_dir=str(tmp_path),
        )
    )
    summary = capsys.readouterr().err
    killed, restarts = map(
        int, re.search(r"workers killed (\d+), env restarts (\d+)", summary).groups()
    )
    assert killed == 7  # at 64, 128, ..., 448 env steps
    assert restarts == killed * envs_per_worker  # a kill restarts every env of its worker


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", [0, 200])
def test_a2c_solves_cartpole(tmp_path, chaos):
    assert a2c.main(a2c.Args(chaos_kill_every=chaos, out_dir=str(tmp_path))) == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", [0, 200])
def test_a3c_solves_cartpole(tmp_path, chaos):
    a3c = load("a3c")
    assert a3c.main(a3c.A3CArgs(chaos_kill_every=chaos, out_dir=str(tmp_path))) == 0
