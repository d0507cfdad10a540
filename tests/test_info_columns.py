"""Plain per-step infos travel as shared-memory columns and come out as Gymnasium merges them."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, VectorEnv

from multienv import MultiEnv
from multienv.wire.info_columns import MAX_CELLS, ColumnReader, ColumnWriter, InfoSchema, schema_of
from tests.envs import CountingEnv, PidInfoEnv, VaryingInfoEnv
from tests.test_multi_env import assert_same_tree, run_side_by_side


class _Gymnasium:
    """Gymnasium's own merging, for comparison."""

    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs

    def merge(self, infos_by_env: dict[int, dict]) -> dict:
        merged: dict = {}
        for env_index in sorted(infos_by_env):
            merged = self._add_info(merged, infos_by_env[env_index], env_index)
        return merged


def _columns(num_envs: int, worker_of_env: list[int]):
    ids = np.zeros(num_envs, dtype=np.uint8)
    cells = np.zeros((num_envs, MAX_CELLS), dtype=np.float64)
    writers = [ColumnWriter(ids, cells) for _ in range(max(worker_of_env) + 1)]
    reader = ColumnReader(ids, cells, np.asarray(worker_of_env))
    return writers, reader


def test_plain_values_are_the_ones_add_info_batches_as_numbers():
    assert schema_of(("a", "b", "c"), (float, int, bool)) == InfoSchema(
        ("a", "b", "c"), (np.dtype(float), np.dtype(int), np.dtype(bool))
    )
    assert schema_of(("a",), (np.float32,)) is not None
    assert schema_of(("a",), (np.bool_,)) is None  # Gymnasium: an object array
    assert schema_of(("a",), (np.uint64,)) is None  # no exact int64 cell
    assert schema_of(("a",), (np.longdouble,)) is None
    assert schema_of(("a",), (str,)) is None
    assert schema_of(("final_obs",), (float,)) is None
    assert schema_of(tuple(range(MAX_CELLS + 1)), (float,) * (MAX_CELLS + 1)) is None


@pytest.mark.parametrize("worker_of_env", [[0, 0, 0, 0, 0], [0, 0, 1, 1, 2], [0, 1, 2, 3, 4]])
def test_rows_merge_exactly_as_add_info_for_every_info_shape(worker_of_env):
    num_envs = len(worker_of_env)
    writers, reader = _columns(num_envs, worker_of_env)
    gymnasium = _Gymnasium(num_envs)
    rng = np.random.default_rng(0)
    shapes = VaryingInfoEnv.INFOS
    for step in range(60):
        infos_by_env = {
            env_index: shapes[int(rng.integers(len(shapes)))](step)
            for env_index in range(num_envs)
            if rng.random() < 0.9
        }
        pickled: dict[int, dict] = {}
        for env_index in range(num_envs):
            info = infos_by_env.get(env_index, {})
            writer = writers[worker_of_env[env_index]]
            if not info:
                writer.clear(env_index)
            elif not writer.write(env_index, info):
                pickled[env_index] = info
        for worker_number, writer in enumerate(writers):
            reader.register(worker_number, writer.take_pending())
        merged = reader.merge(pickled, slice(None), _Gymnasium(num_envs)._add_info)
        assert_same_tree(merged, gymnasium.merge(infos_by_env), f"step {step}")
        for key in merged:
            if isinstance(merged[key], np.ndarray):
                assert merged[key].dtype == gymnasium.merge(infos_by_env)[key].dtype, key


def test_rows_of_some_envs_come_as_gymnasium_merges_them_when_one_schema_holds_them():
    """``rows_columns``: the infos of a recv's envs, as ``merge`` cut to them; None if mixed."""
    num_envs, worker_of_env = 6, [0, 0, 1, 1, 2, 2]
    writers, reader = _columns(num_envs, worker_of_env)
    rng = np.random.default_rng(1)
    shapes = [lambda step: {"x": step + 0.5, "n": step}, lambda step: {"y": float(step)}]
    seen = {True: 0, False: 0}
    for step in range(40):
        infos_by_env = {e: shapes[int(rng.integers(2))](step) for e in range(num_envs)}
        for env_index, info in infos_by_env.items():
            assert writers[worker_of_env[env_index]].write(env_index, info)
        for worker_number, writer in enumerate(writers):
            reader.register(worker_number, writer.take_pending())
        ids = np.sort(rng.permutation(num_envs)[: int(rng.integers(1, num_envs + 1))])
        rows = reader.rows_columns(ids.astype(np.int64))
        keys = {tuple(infos_by_env[e]) for e in ids.tolist()}
        seen[rows is not None] += 1
        assert (rows is None) == (len(keys) > 1), f"step {step}"
        if rows is not None:
            sub = {row: infos_by_env[e] for row, e in enumerate(ids.tolist())}
            assert_same_tree(rows, _Gymnasium(len(ids)).merge(sub), f"step {step}")
    assert seen[True]  # both ways were taken
    assert seen[False]


def test_a_step_without_infos_after_one_with_rows_and_back_merges_as_add_info():
    writers, reader = _columns(4, [0, 0, 1, 1])
    gymnasium = _Gymnasium(4)
    steps = [{}, {1: {"x": 1.5}}, {}, {e: {"x": 0.5} for e in range(4)}, {}, {2: {"n": 3}}]
    for step, infos_by_env in enumerate(steps):
        for env_index in range(4):
            writer = writers[env_index // 2]
            info = infos_by_env.get(env_index)
            if info is None:
                writer.clear(env_index)
            else:
                assert writer.write(env_index, info)
        for worker_number, writer in enumerate(writers):
            reader.register(worker_number, writer.take_pending())
        merged = reader.merge({}, slice(None), gymnasium._add_info)
        assert_same_tree(merged, gymnasium.merge(infos_by_env), f"step {step}")
        assert bool(merged) == bool(infos_by_env)


def test_an_int_beyond_int64_is_pickled_instead():
    writers, _reader = _columns(1, [0])
    assert not writers[0].write(0, {"n": 2**70})
    assert writers[0]._ids[0] == 0


def test_stale_rows_are_not_read_and_plain_rows_really_are_columns():
    writers, reader = _columns(4, [0, 0, 1, 1])
    for env_index in range(4):
        assert writers[env_index // 2].write(env_index, {"x": float(env_index)})
    for worker_number, writer in enumerate(writers):
        reader.register(worker_number, writer.take_pending())
    merged = reader.merge({}, np.array([2, 3]), _Gymnasium(4)._add_info)
    np.testing.assert_array_equal(merged["x"], [0.0, 0.0, 2.0, 3.0])
    np.testing.assert_array_equal(merged["_x"], [False, False, True, True])


def test_a_respawned_worker_numbers_afresh_and_its_schemas_replace_the_old_ones():
    writers, reader = _columns(2, [0, 0])
    writers[0].write(0, {"old": 1})
    reader.register(0, writers[0].take_pending())
    fresh_writer = ColumnWriter(*_shared_of(writers[0]))  # the respawned worker
    assert fresh_writer.write(0, {"new": 2.5})
    reader.register(0, fresh_writer.take_pending())
    merged = reader.merge({}, np.array([0]), _Gymnasium(2)._add_info)
    assert list(merged) == ["new", "_new"]
    assert merged["new"][0] == 2.5


def _shared_of(writer: ColumnWriter):
    return writer._ids.obj, writer._cells


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize(
    "layout",
    [{"envs_per_worker": 1}, {"envs_per_worker": 3}, {"envs_per_worker": 2, "num_threads": 3}],
    ids=["k1", "k3", "k2-3threads"],
)
def test_vector_infos_match_sync_vector_env_for_every_info_shape(mode, layout):
    assert run_side_by_side(VaryingInfoEnv, mode, steps=120, num_envs=6, **layout) > 10


def test_plain_infos_take_the_columns_not_the_pipe():
    with MultiEnv([CountingEnv] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        infos = envs.step(np.ones(4, dtype=np.int64))[4]
        np.testing.assert_array_equal(infos["count"], [1, 1, 1, 1])
        shared = envs._link._shared
        assert shared.infos._known[1].schema.keys == ("count",)
        np.testing.assert_array_equal(shared._mapping.info_schema, [1, 1, 1, 1])


@pytest.mark.fault
def test_after_a_sigkill_the_new_worker_s_infos_carry_its_own_keys():
    with MultiEnv([PidInfoEnv] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)
        old_pid = envs.envs[0].pid
        os.kill(old_pid, signal.SIGKILL)
        infos = envs.step(actions)[4]
        assert infos["multienv"]["_restarted"].tolist() == [True, True, False, False]
        new_pid = envs.envs[0].pid
        assert new_pid != old_pid
        seen = set()
        for _ in range(3):  # the first step resets envs 0 and 1 (next-step autoreset)
            infos = envs.step(actions)[4]
            keys = {key for key in infos if key.startswith("pid_")}
            for key in keys:
                mask = infos[f"_{key}"]
                np.testing.assert_array_equal(infos[key][mask], int(key[4:]))
            seen |= keys
        assert seen == {f"pid_{new_pid}", f"pid_{envs.envs[2].pid}"}
