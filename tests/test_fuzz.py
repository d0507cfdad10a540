"""Bad input, fuzzed (Hypothesis): the same result as SyncVectorEnv, or a clear exception
raised before anything is sent; either way the vector stays usable."""

import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multienv import MultiEnv
from tests.envs import BoxActionEnv, CountingEnv, DictActionEnv

N = 3
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CLEAR = (ValueError, TypeError, KeyError)


@pytest.fixture(scope="module", params=[CountingEnv, BoxActionEnv, DictActionEnv])
def pair(request):
    ours, ref = MultiEnv([request.param] * N), SyncVectorEnv([request.param] * N)
    ours.reset(seed=0)
    ref.reset(seed=0)
    yield ours, ref
    ours.close()
    ref.close()


def steps(envs):
    return [row["steps"] for row in envs.stats()]


scalars = st.one_of(
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
)


def filled(shape: tuple[int, ...], dtype: type, fill: float) -> np.ndarray:
    """An array of ``fill``; NaN cast to an integer dtype is garbage, on purpose, unwarned."""
    with np.errstate(invalid="ignore"):
        return np.full(shape, fill).astype(dtype, copy=False)


arrays = st.builds(
    filled,
    st.sampled_from([(N,), (N - 1,), (N + 1,), (N, 2), (N, 1), (), (2, N)]),
    st.sampled_from([np.int64, np.int32, np.uint8, np.float32, np.float64, np.bool_]),
    st.one_of(st.integers(-2, 4), st.floats(-2, 2), st.just(np.nan)),
)
batches = st.one_of(
    arrays,
    st.lists(scalars, min_size=0, max_size=N + 1),
    st.lists(st.lists(st.floats(-2, 2, width=32), min_size=0, max_size=3), min_size=N, max_size=N),
    scalars,
    st.lists(
        st.fixed_dictionaries(
            {"a": st.integers(-1, 3), "b": st.lists(st.floats(-2, 2), min_size=2, max_size=2)}
        ),
        min_size=N,
        max_size=N,
    ),
)


@SETTINGS
@given(actions=batches)
def test_any_action_batch_matches_sync_vector_env_or_is_refused_before_sending(pair, actions):
    ours, ref = pair
    before = steps(ours)
    try:
        got = ours.step(actions)
    except CLEAR as exc:
        message = str(exc)  # says what is wrong
        assert message
        assert steps(ours) == before  # nothing was sent
    else:
        want = ref.step(actions)
        for part_got, part_want in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(part_got, part_want)
        return
    # Still usable: a valid step works and matches the reference.
    valid = ref.action_space.sample()
    got, want = ours.step(valid), ref.step(valid)
    for part_got, part_want in zip(got[:4], want[:4], strict=True):
        np.testing.assert_array_equal(part_got, part_want)


seeds = st.one_of(
    st.none(),
    st.integers(0, 2**31),
    st.lists(st.one_of(st.none(), st.integers(0, 1000)), min_size=0, max_size=N + 1),
    st.builds(np.int64, st.integers(0, 1000)),
    st.builds(lambda v: np.arange(N, dtype=np.int32) + v, st.integers(0, 10)),
)
options = st.one_of(
    st.none(),
    st.just({}),
    st.builds(
        lambda mask: {"reset_mask": np.array(mask)},
        st.lists(st.booleans(), min_size=0, max_size=N + 1),
    ),
    st.lists(st.one_of(st.none(), st.just({})), min_size=0, max_size=N + 1),
    st.integers(),
)


@SETTINGS
@given(seed=seeds, reset_options=options)
def test_any_reset_arguments_match_sync_vector_env_or_are_refused(pair, seed, reset_options):
    ours, ref = pair
    try:
        got = ours.reset(seed=seed, options=reset_options)
    except CLEAR as exc:
        message = str(exc)
        assert message
        ours.reset(seed=0)
        ref.reset(seed=0)
        return
    if isinstance(seed, np.ndarray | np.integer):  # multienv takes numpy ints; Sync does not
        seed = seed.tolist()
    if isinstance(reset_options, list):  # per-env options: multienv's own extension
        want = ref.reset(seed=seed)
    else:
        want = ref.reset(seed=seed, options=reset_options)
    np.testing.assert_array_equal(got[0], want[0])
