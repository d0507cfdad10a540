"""WORKER SIDE, no transport: hosts the k envs of one worker and runs orders on them.

``EnvRunner`` builds its envs, describes them, resets and steps them (checking each
observation against its space), serves ``call`` / ``get_attr`` / ``set_attr`` / ``render``,
and packages env exceptions as ``RemoteFailure``. It knows nothing of pipes, shared memory
or processes: the subprocess worker loop (``multienv.worker.worker``) wraps it, and so can any
other transport.
"""

from __future__ import annotations

import pickle
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import gymnasium as gym
import numpy as np

from multienv.wire.autoreset import Stepped, step_env
from multienv.wire.framing import encode
from multienv.wire.protocol import (
    Command,
    EnvDescription,
    EnvSnapshot,
    Order,
    Outcome,
    PairResults,
    Pairs,
    RemoteFailure,
    Reply,
    Request,
    StepCost,
    pack_states,
)
from multienv.worker.legacy import LegacyEnv, adapt
from multienv.worker.waiting import voluntary_switches
from multienv.worker.worker_tracebacks import restore_script_names, user_traceback

if TYPE_CHECKING:
    from multienv.worker.waiting import WaitingEnvs

ObsCheck = Callable[[Any], "str | None"]
PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


class BuildError(Exception):
    """An ``env_fn`` raised while the runner built its envs; ``failure`` names the env."""

    def __init__(self, failure: RemoteFailure) -> None:
        """Keep the packaged failure."""
        super().__init__(failure.message)
        self.failure = failure


class EnvRunner:
    """The envs of one worker, addressed by their position in it.

    Args:
        env_fn_bytes: The cloudpickled env factories, one per env of the worker.
    """

    def __init__(self, env_fn_bytes: Sequence[bytes]) -> None:
        """Keep the factories; ``build()`` calls them."""
        self._env_fn_bytes = list(env_fn_bytes)
        self.envs: list[gym.Env[Any, Any]] = []
        self._checks: list[ObsCheck | None] = []
        self._state_methods: dict[int, tuple[str, Any, Any]] = {}  # by position, see get_state
        self.waiting: WaitingEnvs | None = None  # its planned steps' (``PlannedStep``)

    def build(self) -> list[EnvDescription]:
        """Build every env in order and describe it.

        Raises:
            BuildError: An ``env_fn`` raised; the envs built so far are closed.
        """
        for position, env_fn_bytes in enumerate(self._env_fn_bytes):
            try:
                env = adapt(restore_script_names(cloudpickle.loads(env_fn_bytes))())
            except Exception as exc:
                self.close()
                raise BuildError(package_failure(exc, position)) from exc
            self.envs.append(env)
            self._checks.append(make_obs_check(env.observation_space))
        return [
            EnvDescription(
                observation_space=env.observation_space,
                action_space=env.action_space,
                metadata=dict(env.metadata),
                render_mode=env.render_mode,
                spec=_picklable_or_none(env.spec),
                env_type=env_type(env),
                has_own_state=self.has_own_state(position),
            )
            for position, env in enumerate(self.envs)
        ]

    @property
    def checks(self) -> list[ObsCheck | None]:
        """Each env's observation check, by position: a problem's text, or None if it fits.

        None in place of a check: the space takes any observation of its type.
        """
        return self._checks

    def has_own_state(self, position: int) -> bool:
        """Whether the env has ``get_state()`` and ``set_state(state)`` of its own."""
        return self._state_access(position)[1] is not None

    def reset(
        self, position: int, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset one env; its observation is checked against its space."""
        obs, info = self.envs[position].reset(seed=seed, options=options)
        self.check(position, obs)
        return obs, info

    def step(self, position: int, action: Any, autoreset: bool = False) -> Stepped:
        """Step one env; with ``autoreset``, reset it at once if the step ended its episode."""
        return step_env(self.envs[position], position, action, autoreset, self.check)

    def run(self, order: Order) -> Outcome:
        """Run one order; an env exception becomes its failure (the other orders go on)."""
        try:
            if order.is_reset:
                if order.np_random is not None:
                    self.envs[order.position].set_wrapper_attr("np_random", order.np_random)
                obs, info = self.reset(order.position, order.seed, order.options)
                return Outcome(obs, info=info)
            obs, reward, terminated, truncated, info, final = self.step(
                order.position, order.action, order.autoreset
            )
            if final is None:
                outcome = Outcome(obs, float(reward), terminated, truncated, info)
            else:  # obs holds the final observation; reset, the new episode's
                outcome = Outcome(final[0], float(reward), terminated, truncated, final[1])
                outcome.reset = (obs, info)
            if order.keep_np_random and (outcome.terminated or outcome.truncated):
                outcome.np_random = np_random_or_none(self.envs[order.position])
            return outcome
        except Exception as exc:  # noqa: BLE001 - reported for this env only
            return Outcome(failure=package_failure(exc, order.position))

    def serve(self, request: Request) -> Reply:
        """Answer a pickled ``BATCH`` or one-env call; an env exception becomes the failure."""
        try:
            if request.command is Command.BATCH:
                return Reply([self.run(order) for order in request.payload])
            return Reply(self.call(request.position, request.command, request.payload))
        except Exception as exc:  # noqa: BLE001 - env errors go back to the parent as EnvError
            return Reply(failure=package_failure(exc, request.position))

    def call(self, position: int, command: Command, payload: Any) -> Any:
        """Serve ``render``, ``call``, ``get_attr`` or ``set_attr`` for one env."""
        env = self.envs[position]
        if command is Command.RENDER:
            return env.render()
        if command is Command.CALL:
            name, args, kwargs = payload
            attr = env.get_wrapper_attr(name)
            return attr(*args, **kwargs) if callable(attr) else attr
        if command is Command.GET_ATTR:
            return env.get_wrapper_attr(payload)
        if command is Command.SET_ATTR:
            env.set_wrapper_attr(*payload)
            return None
        if command is Command.GET_STATE:
            return self.get_state(position)
        if command is Command.SET_STATE:
            self.set_state(position, payload)
            return None
        if command is Command.STEP_PAIRS:
            return self.step_pairs(payload)
        if command is Command.MEASURE:
            return self.measure(position, *payload)
        if command is Command.IS_WRAPPED:
            while isinstance(env, gym.Wrapper):
                if isinstance(env, payload):
                    return True
                env = env.env
            return False
        raise ValueError(f"{command!r} is not a call of one env")

    def measure(self, position: int, budget_s: float, max_steps: int) -> StepCost:
        """Time the env's reset and its steps of random actions, in this process.

        Steps until ``budget_s`` has passed (one step at least: an env slower than the
        budget is timed once) or ``max_steps`` are done; an episode that ends is reset, and
        that reset is timed as one. Only the env's own
        calls are timed, not the sampling of the actions. The env is left mid-episode.
        """
        env = self.envs[position]
        space = env.action_space
        clock, cpu_clock = time.perf_counter, time.process_time  # wall, and CPU of all threads
        blocked = 0  # steps in which this thread blocked (a busy machine only preempts)
        began = clock()
        env.reset()
        resets = [clock() - began]
        steps: list[float] = []
        cpu: list[float] = []
        deadline = began + budget_s
        while len(steps) < max_steps and (not steps or clock() < deadline):
            action = space.sample()
            started, cpu_started, switches = clock(), cpu_clock(), voluntary_switches()
            _, _, terminated, truncated, _ = env.step(action)
            steps.append(clock() - started)
            cpu.append(cpu_clock() - cpu_started)
            blocked += voluntary_switches() > switches
            if terminated or truncated:
                started = clock()
                env.reset()
                resets.append(clock() - started)
        return StepCost(
            statistics.median(steps),
            statistics.median(resets),
            len(steps),
            statistics.median(cpu),
            blocked / len(steps),
        )

    def get_state(self, position: int) -> Any:
        """What the env's own ``get_state()`` returns, or else the whole env pickled."""
        env_class, getter, _ = self._state_access(position)
        if getter is not None:
            return getter()
        return EnvSnapshot(env_class, "object", _dumps(self.envs[position]))

    def set_state(self, position: int, snapshot: Any) -> None:
        """Restore a state of ``get_state`` into the env at ``position``.

        A state that is not an ``EnvSnapshot`` goes to the env's own ``set_state()``.
        """
        env_class, _, setter = self._state_access(position)
        if not isinstance(snapshot, EnvSnapshot):
            if setter is None:
                raise TypeError(
                    f"the state is a {type(snapshot).__name__}, but {env_class} has no "
                    "get_state()/set_state() of its own; pass a state from get_states()"
                )
            setter(snapshot)
            return
        if snapshot.env_type != env_class:
            raise ValueError(
                f"the state is of a {snapshot.env_type} env; this env is a {env_class}"
            )
        if snapshot.kind == "state":
            if setter is None:
                raise ValueError(f"the state came from get_state(), which {env_class} lacks")
            setter(pickle.loads(snapshot.data))
        else:
            self.envs[position] = pickle.loads(snapshot.data)
            self._state_methods.pop(position, None)  # a new object: bound methods change

    def _state_access(self, position: int) -> tuple[str, Any, Any]:
        """The env's class name and its ``get_state`` / ``set_state`` (None, None if not both)."""
        access = self._state_methods.get(position)
        if access is None:
            env = self.envs[position]
            getter, setter = _state_method(env, "get_state"), _state_method(env, "set_state")
            if getter is None or setter is None:
                getter = setter = None
            access = self._state_methods[position] = (env_type(env), getter, setter)
        return access

    def step_pairs(self, pairs: Pairs) -> PairResults:
        """For each pair: restore its state, repeat its action up to ``dt`` times, snapshot."""
        count = len(pairs.dts)
        positions, width = pairs.positions, len(pairs.positions)
        snapshots: list[Any] = [None] * count
        observations: list[Any] = [None] * count
        rewards = [0.0] * count
        terminated_flags = [False] * count
        truncated_flags = [False] * count
        infos: list[dict[str, Any]] = [{}] * count
        failures: dict[int, RemoteFailure] = {}
        for j, (snapshot, action, dt) in enumerate(
            zip(pairs.snapshots, pairs.actions, pairs.dts, strict=True)
        ):
            position = positions[j % width]
            try:
                if snapshot is not None:
                    self.set_state(position, snapshot)
                env = self.envs[position]
                total = 0.0
                terminated = truncated = False
                obs: Any = None
                info: dict[str, Any] = {}
                for _ in range(dt):
                    obs, reward, terminated, truncated, info = env.step(action)
                    total += float(reward)
                    if terminated or truncated:
                        break
                self.check(position, obs)
                snapshots[j] = self.get_state(position)
            except Exception as exc:  # noqa: BLE001 - reported for this pair only
                failures[j] = package_failure(exc, position)
                continue
            observations[j] = obs
            rewards[j] = total
            terminated_flags[j] = bool(terminated)
            truncated_flags[j] = bool(truncated)
            infos[j] = info
        obs_column: Any = observations
        if not failures and all(isinstance(o, np.ndarray) for o in observations):
            try:
                obs_column = np.stack(observations)  # one array pickles faster than many
            except ValueError:
                pass  # shapes differ (an invalid obs is caught by check())
        return PairResults(
            snapshots if failures else pack_states(snapshots),
            obs_column,
            np.array(rewards, dtype=np.float64),
            np.array(terminated_flags, dtype=np.bool_),
            np.array(truncated_flags, dtype=np.bool_),
            infos,
            failures,
        )

    def close(self) -> None:
        """Close every env that was built; errors in closing are reported on stderr."""
        for env in self.envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the process exits next
                traceback.print_exc()
        self.envs = []

    def check(self, position: int, obs: Any) -> None:
        """Raise ValueError if ``obs`` does not fit the observation space of that env."""
        check = self._checks[position]
        if check is not None:
            problem = check(obs)
            if problem is not None:
                raise ValueError(f"the observation {problem} (the env's observation_space)")


def package_failure(exc: BaseException, position: int | None = None) -> RemoteFailure:
    """Package an exception for the parent, keeping the object itself when it pickles.

    The traceback leaves out multienv's frames, and its last line when the exception
    travels too: the parent shows it right after (``failures.remote_error``).
    """
    try:
        pickle.dumps(exc)
        kept: BaseException | None = exc
    except Exception:  # noqa: BLE001 - any pickling failure means "send the text only"
        kept = None
    text = user_traceback(exc, with_last_line=kept is None)
    return RemoteFailure(type(exc).__qualname__, str(exc), text, kept, position)


def explain_unpicklable(name: str, outcome: Outcome, exc: Exception) -> TypeError:
    """Name the info key (or the part of the reply) of ``name()`` that could not be pickled."""
    infos = [outcome.info] + ([outcome.reset[1]] if outcome.reset is not None else [])
    for info in infos:
        for key, value in info.items():
            try:
                pickle.dumps(value)
            except PICKLE_ERRORS as key_exc:
                return TypeError(
                    f"{name}() returned info[{key!r}] of type {type(value).__name__}, which "
                    f"cannot be pickled ({key_exc}); return plain data in info"
                )
    return TypeError(f"the reply to {name}() cannot be pickled ({exc}); return plain data")


def encode_reply(reply: Reply, request: Request | None, resets: set[int] | None = None) -> bytes:
    """Pickle a reply; an outcome that cannot be pickled becomes a TypeError naming its key.

    Args:
        reply: The reply to send.
        request: The pickled request it answers, or None for a fast batch (whose reply's
            value is a dict of outcomes by position).
        resets: For a fast batch, the positions whose order was a reset.
    """
    try:
        return encode(reply)
    except PICKLE_ERRORS as exc:
        if request is not None and request.command is not Command.BATCH:
            problem = TypeError(
                f"the reply to {request.command.name.lower()}() cannot be pickled ({exc}); "
                "return plain data"
            )
            return encode(Reply(failure=package_failure(problem, request.position)))
    outcomes = reply.value
    keys = list(outcomes) if isinstance(outcomes, dict) else range(len(outcomes))
    for key in keys:
        outcome = outcomes[key]
        if request is None:
            position, is_reset = key, key in (resets or set())
        else:
            order = request.payload[key]
            position, is_reset = order.position, order.is_reset
        try:
            encode(outcome)
        except PICKLE_ERRORS as item_exc:
            name = "reset" if is_reset else "step"
            problem = explain_unpicklable(name, outcome, item_exc)
            outcomes[key] = Outcome(failure=package_failure(problem, position))
    return encode(reply)


def _dumps(value: Any) -> bytes:
    """Pickle a state: with plain pickle (4x faster) when it can, else with cloudpickle."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - lambdas, local classes: cloudpickle handles them
        return bytes(cloudpickle.dumps(value))


def env_type(env: gym.Env[Any, Any]) -> str:
    """The unwrapped env's class, as ``module.QualName``."""
    unwrapped = env.unwrapped
    cls = type(unwrapped.env) if isinstance(unwrapped, LegacyEnv) else type(unwrapped)
    return f"{cls.__module__}.{cls.__qualname__}"


def _state_method(env: gym.Env[Any, Any], name: str) -> Callable[..., Any] | None:
    """The env's (or a wrapper's) method ``name``, or None."""
    try:
        method = env.get_wrapper_attr(name)
    except AttributeError:
        return None
    return method if callable(method) else None


def np_random_or_none(env: gym.Env[Any, Any]) -> Any:
    """The env's ``np_random``, or None for an env without one (an old-API env, say)."""
    try:
        return env.get_wrapper_attr("np_random")
    except Exception:  # noqa: BLE001 - without it the next worker's env keeps its own stream
        return None


def _picklable_or_none(value: Any) -> Any:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - a spec holding e.g. a lambda is dropped, not fatal
        return None
    return value


def make_obs_check(space: gym.Space[Any]) -> ObsCheck | None:
    """Return a cheap check of an observation's shape and dtype, or None if the space has none.

    Shapes must match exactly. Dtypes must cast to the space's dtype within the same kind
    (float64 into float32 is accepted, as Gymnasium's batching does; float into uint8 is not).
    """
    if isinstance(space, gym.spaces.Box):
        shape, dtype = space.shape, space.dtype

        accepted: set[np.dtype[Any]] = set()  # dtypes seen to cast; can_cast costs a µs

        def check_box(obs: Any) -> str | None:
            array = obs if isinstance(obs, np.ndarray) else np.asarray(obs)
            if array.shape == shape and array.dtype in accepted:
                return None  # the usual case, on every step: one lookup
            if array.dtype not in accepted and np.can_cast(array.dtype, dtype, "same_kind"):
                accepted.add(array.dtype)
            if array.shape != shape or array.dtype not in accepted:
                return (
                    f"has shape {array.shape} and dtype {array.dtype}; "
                    f"expected shape {shape} and dtype {dtype}"
                )
            return None

        return check_box
    if isinstance(space, gym.spaces.Dict):
        checks = {key: make_obs_check(sub) for key, sub in space.spaces.items()}

        def check_dict(obs: Any) -> str | None:
            if not isinstance(obs, dict) or obs.keys() != checks.keys():
                keys = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
                return f"has keys {keys!r}; expected {sorted(checks)!r}"
            for key, check in checks.items():
                problem = check(obs[key]) if check is not None else None
                if problem is not None:
                    return f"[{key!r}] {problem}"
            return None

        return check_dict
    if isinstance(space, gym.spaces.Tuple):
        tuple_checks = [make_obs_check(sub) for sub in space.spaces]

        def check_tuple(obs: Any) -> str | None:
            if not isinstance(obs, tuple) or len(obs) != len(tuple_checks):
                return f"is {type(obs).__name__}; expected a tuple of {len(tuple_checks)}"
            for position, (check, item) in enumerate(zip(tuple_checks, obs, strict=True)):
                problem = check(item) if check is not None else None
                if problem is not None:
                    return f"[{position}] {problem}"
            return None

        return check_tuple
    return None
