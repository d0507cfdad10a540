"""BOTH SIDES, no I/O: the typed messages between the parent and a worker hosting k envs.

A worker hosts k envs; each has a ``position`` (0 to k-1) in its worker. This module holds
the typed messages; how they travel as bytes is ``multienv.wire.framing``.

A worker sends one unsolicited ``Reply`` when it starts: the list of its envs'
``EnvDescription`` once all are built, or a ``RemoteFailure`` naming the env whose
``env_fn`` raised.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np


class Command(enum.IntEnum):
    """What the parent asks a worker to do with one of its envs, or with several."""

    BATCH = 1  # payload: list[Order]; the reply's value is list[Outcome]
    RENDER = 3  # payload: None
    CALL = 4  # payload: (name, args, kwargs)
    GET_ATTR = 5  # payload: name
    SET_ATTR = 6  # payload: (name, value)
    CLOSE = 7  # payload: None; the worker closes its envs, replies and exits
    ATTACH = 8  # payload: (BatchLayout, worker_number, env_indices); two fds follow
    GET_STATE = 9  # payload: None; the reply's value is a state (see EnvSnapshot)
    SET_STATE = 10  # payload: a state
    STEP_PAIRS = 11  # payload: Pairs; the reply's value is PairResults
    IS_WRAPPED = 12  # payload: a wrapper class; the reply's value is a bool
    MEASURE = 13  # payload: (budget_s, max_steps); the reply's value is a StepCost


@dataclasses.dataclass(frozen=True)
class Request:
    """One pickled command; ``position`` is the env's place in its worker (-1: the worker)."""

    command: Command
    position: int
    payload: Any = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """The answer to a ``Request`` (or to a fast batch that had more to say than its record).

    ``value`` is the result when ``failure`` is None. ``schemas`` are the info schemas a
    worker numbered in this fast batch (``info_columns``), as ``(id, InfoSchema)``.
    ``modules``, in a worker's ready reply: what building its envs imported
    (``module_server``).
    """

    value: Any = None
    failure: RemoteFailure | None = None
    schemas: list[tuple[int, Any]] | None = None
    modules: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What an env's steps and resets cost in its worker, timed there (``Command.MEASURE``).

    Attributes:
        step_s: The median seconds of a step of random actions.
        reset_s: The median seconds of a reset.
        steps: How many steps were timed.
        step_cpu_s: The median CPU seconds (the worker process's) of those steps: far below
            ``step_s`` for an env that waits (I/O, a remote simulator) rather than computes.
        blocked_share: The share of those steps in which the worker's thread blocked (a
            voluntary context switch): near 1 for an env that waits, near 0 for one that
            computes, however busy the machine (a preempted step does not block).
    """

    step_s: float
    reset_s: float
    steps: int
    step_cpu_s: float | None = None
    blocked_share: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Order:
    """A step or a reset of one env, as part of a batch for its worker.

    Attributes:
        position: The env's place in its worker.
        is_reset: Reset the env instead of stepping it.
        action: The action of a step, or None when it is in shared memory.
        autoreset: Reset a finished episode in the same round trip (same-step autoreset).
        seed: The reset's seed.
        options: The reset's options.
        slot: The shared observation slot to write into, or None to return the observation.
        np_random: A generator the env takes before the reset (a recycled env's, passed
            on so that its episodes continue the same random stream).
        keep_np_random: If the step ends the episode, return the env's ``np_random`` with
            it (a worker due for recycling, so that the swap needs no call to fetch it).
    """

    position: int
    is_reset: bool
    action: Any = None
    autoreset: bool = False
    seed: int | None = None
    options: dict[str, Any] | None = None
    slot: int | None = None
    np_random: Any = None
    keep_np_random: bool = False


@dataclasses.dataclass(slots=True)
class Outcome:
    """What one order produced.

    On the shared-memory path ``obs`` is None when the observation is in its slot, and the
    reward and flags are read from shared memory by the parent.

    Attributes:
        obs: The observation (for an autoreset step: the final one of the ended episode).
        reward: The step's reward.
        terminated: The step ended the episode.
        truncated: The step cut the episode short.
        info: The step's or reset's info.
        reset: ``(obs, info)`` of the worker's same-step autoreset, when it did one.
        failure: The env raised; everything else is meaningless.
        np_random: The env's generator after a step that ended its episode, when the order
            asked to keep it.
    """

    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    reset: tuple[Any, dict[str, Any]] | None = None
    failure: RemoteFailure | None = None
    np_random: Any = None


@dataclasses.dataclass
class Batch:
    """The steps and resets the parent asks of some envs of one worker, as arrays.

    Attributes:
        positions: The envs' places in their worker, one per item.
        is_reset: Per item, reset the env instead of stepping it.
        actions: One action per item (ignored for resets): an array with a leading axis for
            array action spaces, else a list.
        autoreset: Reset a finished episode in the same round trip (same-step autoreset).
        seeds: Per item, the reset's seed; None for no seeds at all.
        options: Per item, the reset's options; None for no options at all.
        is_whole: The items are all the worker's envs, in order (positions 0 to k-1).
        np_randoms: Per item, a generator the env takes before its reset; None for none.
        keep_np_randoms: Return the ``np_random`` of each env whose episode the step ends.
    """

    positions: list[int] | np.ndarray
    is_reset: np.ndarray
    actions: Any
    autoreset: bool = False
    seeds: list[int | None] | None = None
    options: list[dict[str, Any] | None] | None = None
    is_whole: bool = False
    np_randoms: list[Any] | None = None
    keep_np_randoms: bool = False

    def subset(self, items: Sequence[int]) -> Batch:
        """The batch of only ``items`` of this one."""
        return Batch(
            [self.positions[item] for item in items],
            self.is_reset[list(items)],
            [self.actions[item] for item in items],
            self.autoreset,
            None if self.seeds is None else [self.seeds[item] for item in items],
            None if self.options is None else [self.options[item] for item in items],
        )

    def orders(self) -> list[Order]:
        """The batch as one ``Order`` per item, for the pickled path."""
        return [
            Order(
                position,
                bool(self.is_reset[item]),
                None if self.is_reset[item] else self.actions[item],
                self.autoreset,
                None if self.seeds is None else self.seeds[item],
                None if self.options is None else self.options[item],
                np_random=None if self.np_randoms is None else self.np_randoms[item],
                keep_np_random=self.keep_np_randoms,
            )
            for item, position in enumerate(self.positions)
        ]


@dataclasses.dataclass
class StepPlan:
    """A whole vector's step, prepared once by its link; each worker sends its own slice.

    Only for a vector whose workers each host a contiguous run of its envs, in position
    order (env ``first + p`` at position ``p``), as ``create_subprocess_envs`` lays them out.

    Attributes:
        actions: All N actions (an array with a leading axis).
        is_reset: Per env, reset it instead of stepping it.
        autoreset: Reset a finished episode in the same round trip (same-step autoreset).
        wire: The backend's prepared request data (the subprocess backend's: the slot each
            env's observation goes to; the items are in shared memory).
        num_resets: How many of ``is_reset`` are set.
        is_counted: Every worker gets its slice, and the vector collects them all before it
            returns: the workers' answers may be counted, so that only the last one wakes
            the parent (a round, ``done_pipes``).
        has_finals: Same-step autoreset, and a worker that answers its part all in shared
            memory leaves there the final obs and info of each episode that ended
            (``framing.IS_FINALS``, sent by the data plane only).
        skip: Per env, left out of the plan: a data plane's reset of the others (every
            env not skipped resets); None: every env is in it.
    """

    actions: np.ndarray
    is_reset: np.ndarray
    autoreset: bool
    wire: Any = None
    num_resets: int = -1
    is_counted: bool = False
    has_finals: bool = False
    skip: np.ndarray | None = None

    def batch(self, env_slice: slice) -> Batch:
        """The general ``Batch`` of one worker's part, for the paths that need it."""
        if self.skip is not None:  # a reset of the envs not skipped, in position order
            positions = np.flatnonzero(~self.skip[env_slice]).tolist()
            size = len(positions)
            return Batch(positions, np.ones(size, dtype=np.bool_), [None] * size)
        count = env_slice.stop - env_slice.start
        return Batch(
            list(range(count)),
            self.is_reset[env_slice].copy(),
            self.actions[env_slice],
            self.autoreset,
            is_whole=True,
        )


# A planned part whose DONE record said DONE_OK (``framing``): all its results are in shared
# memory, so its result is this, not a ``BatchResult`` (the DONE_OK family: the record kind,
# this, and ``process_handle._DONE_OK_REPLY``).
DONE_OK_RESULT = None


@dataclasses.dataclass
class BatchResult:
    """What a batch produced, item by item.

    Attributes:
        rewards: Per item; 0 for a reset.
        terminated: Per item; False for a reset.
        truncated: Per item; False for a reset.
        obs: Per item, the observation the caller sees now (after a same-step autoreset, the
            new episode's first); None when the observations are in shared memory.
        extras: By item index, only where there is more to say: a non-empty info, a
            same-step autoreset (``obs`` holds the final observation, ``reset`` the new
            episode's info), or a failure.
        info_columns: The worker answered this planned step itself, so its envs' rows of
            the shared info columns are this step's (``info_columns``).
    """

    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    obs: list[Any] | None
    extras: dict[int, Outcome]
    info_columns: bool = False

    @staticmethod
    def empty(size: int) -> BatchResult:
        """A result of ``size`` items with nothing in it yet (no observations)."""
        return BatchResult(
            np.zeros(size, dtype=np.float64),
            np.zeros(size, dtype=np.bool_),
            np.zeros(size, dtype=np.bool_),
            None,
            {},
        )

    def merge(self, part: BatchResult, items: Sequence[int]) -> None:
        """Write ``part``, the result of ``items`` of this batch, into this result."""
        index = list(items)
        self.rewards[index] = part.rewards
        self.terminated[index] = part.terminated
        self.truncated[index] = part.truncated
        if self.obs is not None and part.obs is not None:
            for item, obs in zip(index, part.obs, strict=True):
                self.obs[item] = obs
        for item, extra in part.extras.items():
            self.extras[index[item]] = extra


def unpack_outcomes(outcomes: list[Outcome]) -> BatchResult:
    """A pickled batch's outcomes as a ``BatchResult`` (obs as the caller sees them now)."""
    size = len(outcomes)
    rewards = np.zeros(size, dtype=np.float64)
    terminated = np.zeros(size, dtype=np.bool_)
    truncated = np.zeros(size, dtype=np.bool_)
    obs: list[Any] = [None] * size
    extras: dict[int, Outcome] = {}
    for item, outcome in enumerate(outcomes):
        rewards[item] = outcome.reward
        terminated[item] = outcome.terminated
        truncated[item] = outcome.truncated
        if outcome.reset is not None:
            obs[item] = outcome.reset[0]
            extras[item] = outcome
        else:
            obs[item] = outcome.obs
            if outcome.info or outcome.failure is not None or outcome.np_random is not None:
                extras[item] = Outcome(
                    info=outcome.info, failure=outcome.failure, np_random=outcome.np_random
                )
    return BatchResult(rewards, terminated, truncated, obs, extras)


def failed_batch(size: int, failure: RemoteFailure, has_obs: bool) -> BatchResult:
    """The result of a batch whose request failed as a whole: every item carries ``failure``."""
    failed = Outcome(failure=failure)
    return BatchResult(
        np.zeros(size),
        np.zeros(size, dtype=np.bool_),
        np.zeros(size, dtype=np.bool_),
        [None] * size if has_obs else None,
        dict.fromkeys(range(size), failed),
    )


@dataclasses.dataclass(frozen=True)
class EnvDescription:
    """What ``initialize()`` caches from the worker, so the parent never builds a throwaway env."""

    observation_space: Any
    action_space: Any
    metadata: dict[str, Any]
    render_mode: str | None
    spec: Any
    env_type: str = ""  # the unwrapped env's class, as module.qualname; snapshots carry it
    has_own_state: bool = False  # get_state()/set_state(state): its states are their values


@dataclasses.dataclass(frozen=True)
class EnvSnapshot:
    """The state of an env without ``get_state()``/``set_state()``: the whole env, pickled.

    An env with both methods (the planning convention, as plangym passes states around) has
    for states whatever its ``get_state()`` returns; ``MultiEnv.get_states()`` returns those
    as they are. Any other env's state is one of these: opaque and picklable, the env with
    its wrapper stack (time limit counters, RNG) pickled by its worker. The parent passes it
    between workers without unpickling it.

    Attributes:
        env_type: The unwrapped env's class (``module.QualName``); a snapshot is restored
            only into an env of the same class.
        kind: ``"object"``: ``data`` pickles the whole env, wrapper stack included;
            ``"state"`` (made by earlier versions): ``data`` pickles what the env's own
            ``get_state()`` returned.
        data: The pickled state.
    """

    env_type: str
    kind: str
    data: bytes

    def value(self) -> Any:
        """The state itself: what ``get_state()`` returned, or a copy of the whole env."""
        return pickle.loads(self.data)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """A worker's share of ``step_batch``, column by column (cheaper to pickle than rows).

    Attributes:
        positions: The worker's envs that run the pairs, in turn: pair n runs on
            ``positions[n % len(positions)]``.
        snapshots: Per pair, the state to restore first, or None for the current one; one
            array when they are arrays of one shape and dtype (``pack_states``).
        actions: Per pair, the action, repeated: one array for array action spaces.
        dts: Per pair, steps to repeat it for, stopping early at the episode's end.
    """

    positions: Sequence[int]
    snapshots: list[Any] | np.ndarray
    actions: Any
    dts: np.ndarray

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the arrays as raw bytes (``_flatten``)."""
        fields = (self.positions, self.snapshots, self.actions, self.dts)
        return _rebuild_pairs, _flatten(fields)


def pack_states(states: list[Any]) -> list[Any] | np.ndarray:
    """States as one array when they are numpy arrays of one shape and dtype, else as given.

    One array pickles in one piece; a list of M arrays pays M headers and M object
    rebuilds. Iterating either gives the states back (the array, by rows).
    """
    if len(states) < 2:
        return states
    first = states[0]
    if not isinstance(first, np.ndarray) or first.dtype.hasobject:
        return states
    shape, dtype = first.shape, first.dtype
    for state in states:
        if type(state) is not np.ndarray or state.shape != shape or state.dtype != dtype:
            return states
    return np.array(states)  # as np.stack(states) does, in a third of the time


@dataclasses.dataclass
class PairResults:
    """What a share of pairs produced, column by column.

    Attributes:
        snapshots: Per pair, the state reached (None where it failed); one array when they
            are arrays of one shape and dtype (``pack_states``).
        obs: Per pair, the last observation: one stacked array when they fit, else a list.
        rewards: Per pair, the summed reward (float64).
        terminated: Per pair, the last step's flag (bool).
        truncated: Per pair, the last step's flag (bool).
        infos: Per pair, the last step's info.
        failures: By pair index, the env's exception.
    """

    snapshots: list[Any] | np.ndarray
    obs: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: list[dict[str, Any]]
    failures: dict[int, RemoteFailure]

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the arrays as raw bytes (``_flatten``)."""
        fields = (self.snapshots, self.obs, self.rewards, self.terminated, self.truncated)
        return _rebuild_results, (*_flatten(fields), self.infos, self.failures)


# Numpy's own pickling of an array costs 2 to 4 µs each way, most of it in Python; a pair
# share has three arrays and its results five. Their raw bytes cost a tenth of that.
_RAW_KINDS = frozenset("biufc")  # bool, ints, floats, complex: bytes, dtype and shape say all
_ARRAY = "multienv.raw_array"


def _flatten(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each plain numpy array as ``(_ARRAY, bytes, dtype string, shape)``; the rest as it is."""
    return tuple(
        (_ARRAY, value.tobytes(), value.dtype.str, value.shape)
        if type(value) is np.ndarray and value.dtype.kind in _RAW_KINDS
        else value
        for value in values
    )


def _unflatten(value: Any) -> Any:
    """An array of ``_flatten`` back, writable; anything else as it is."""
    if type(value) is tuple and len(value) == 4 and value[0] == _ARRAY:
        _, data, dtype, shape = value
        return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return value


def _rebuild_pairs(*values: Any) -> Pairs:
    return Pairs(*(_unflatten(value) for value in values))


def _rebuild_results(*values: Any) -> PairResults:
    return PairResults(*(_unflatten(value) for value in values))


@dataclasses.dataclass(frozen=True)
class RemoteFailure:
    """An exception raised by env code in the worker.

    Attributes:
        type_name: Qualified name of the exception type, e.g. ``"ValueError"``.
        message: ``str(exc)``.
        traceback: The worker's formatted traceback.
        exception: The exception itself when it could be pickled, else None.
        position: The env that raised, when the failure concerns one env of the worker.
    """

    type_name: str
    message: str
    traceback: str
    exception: BaseException | None
    position: int | None = None


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of the re-raised exception."""

    def __init__(self, traceback_text: str) -> None:
        """Store the traceback text."""
        super().__init__(traceback_text)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        """Show the traceback as the worker printed it."""
        text = self.traceback_text.rstrip("\n")
        if text.count("\n") < 1 and text.startswith("Traceback"):  # no frame of the env's
            return (
                "in the env's worker, outside the env's code (its result could not be sent "
                "back as it was; the message below says which part)"
            )
        return "in the env's worker:\n" + text


class OwnerWatch(enum.Enum):
    """How a worker makes sure it exits within 2 s of the process that owns it dying."""

    THREAD = "thread"  # a thread waits on the owner's pidfd (spawn, fork)
    # Also PR_SET_PDEATHSIG on the direct parent, the forkserver, which exits with its owner.
    PDEATHSIG_AND_THREAD = "pdeathsig+thread"
    # The module server, the direct parent, watches the owner, exits with it and has set
    # PR_SET_PDEATHSIG in the worker before it runs: no thread in the worker.
    SERVER = "server"


WORKER_MODULE = "multienv.worker.worker"


def worker_main(*args: Any) -> None:
    """Process target: import the worker module in the child and run its loop.

    The parent names the worker through this function, so the parent side and ``worker``
    never import each other.
    """
    worker_module().run_worker(*args)


def worker_module() -> Any:
    """``multienv.worker.worker``, imported by name: for the processes workers are forked from."""
    import importlib

    return importlib.import_module(WORKER_MODULE)
