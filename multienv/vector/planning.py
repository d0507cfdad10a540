"""VECTOR API: env states and ``step_batch`` for planners.

A planner (Monte-Carlo tree search, Go-Explore style search) clones env states, steps many
(state, action) pairs in parallel and restores states at will. ``PlanningApi`` holds the
vector's ``get_states``, ``set_states``, ``sync_states`` and ``step_batch`` (``MultiEnv``
inherits them), thin methods over the functions here.

``step_batch`` spreads M pairs over the workers in proportion to their envs (a contiguous
share each, so every core is busy), sends each worker its share as one ``STEP_PAIRS``
request, and waits for them all. In the worker, each pair restores its state, repeats its
action up to ``dt`` times (stopping at the episode's end), sums the rewards and snapshots
the state reached. A worker that dies meanwhile is respawned and its share replayed from
the pairs' states, so the results are those of an undisturbed run;
``info["multienv"]`` says it happened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from multienv.supervision.env_proxy import check_state
from multienv.wire.protocol import (
    Command,
    EnvDescription,
    EnvSnapshot,
    PairResults,
    Pairs,
    pack_states,
)
from multienv.wire.shared_memory import ARRAY_SPACES

if TYPE_CHECKING:
    from multienv.vector.fan_out import WorkerGroup
    from multienv.wire.autoreset import Autoreset


class PlanningApi:
    """The planning methods of a vector env; ``MultiEnv`` inherits them."""

    if TYPE_CHECKING:  # what they use of the vector
        num_envs: int
        envs: list[Any]
        single_observation_space: gym.Space[Any]
        single_action_space: gym.Space[Any]
        _autoreset: Autoreset
        _groups: list[WorkerGroup]

        def _map(self, call: Callable[[int], Any], name: str) -> tuple[Any, ...]: ...

        def _check_idle(self, name: str) -> None: ...

    def get_states(self) -> list[Any]:
        """Each env's state, picklable, for ``set_states`` and ``step_batch``.

        An env with ``get_state()`` / ``set_state(state)`` methods (the planning convention,
        as plangym passes states around) gives what its ``get_state()`` returns, as it is; any
        other env gives an opaque ``EnvSnapshot``: the env pickled whole, wrapper stack
        included (time limit counters, RNG), so restoring it and stepping it again gives the
        same results.
        """
        return list(self._map(lambda i: self.envs[i].get_state(), "get_states"))

    def set_states(self, states: Sequence[Any]) -> None:
        """Restore one state per env; each goes on mid-episode from there.

        A worker that dies meanwhile is respawned and the state restored into the fresh env.
        The observations the vector holds are not updated (a state carries none); the next
        ``step`` returns those of the restored envs.

        Raises:
            TypeError, ValueError: ``states`` is not one state per env that the env can take
                (an ``EnvSnapshot`` of its class, or any value for an env with
                ``set_state``); raised before anything is sent. A value the env's own
                ``set_state`` refuses raises ``EnvError`` naming the env.
        """
        self._check_idle("set_states")  # (before the states are checked against the envs)
        checked = check_set_states(self, states)
        self._map(lambda i: self.envs[i].set_state(checked[i]), "set_states")
        self._autoreset.after_reset(np.arange(self.num_envs))

    def sync_states(self, state: Any) -> None:
        """Restore the same state into every env (see ``set_states``)."""
        self.set_states([state] * self.num_envs)

    def step_batch(
        self, actions: Any, states: Sequence[Any] | None = None, dt: Any = 1
    ) -> tuple[list[Any], Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        """Step M (state, action) pairs in parallel, M independent of N.

        Pair j restores ``states[j]`` into some env, repeats ``actions[j]`` up to ``dt[j]``
        times (stopping early at the episode's end), sums the rewards and returns the state
        reached. Each worker gets a contiguous share of the pairs, in proportion to its envs,
        in one round trip. A worker that dies is respawned and its share replayed from the
        pairs' states, so the results are those of an undisturbed run; their infos carry
        ``"multienv": {"restarted": True, "replayed": True, ...}``. Afterwards each env holds
        the state of the last pair it ran; ``set_states`` or ``reset`` before ``step``.

        Args:
            actions: M actions (an array with a leading axis of M for array action spaces).
            states: M states from ``get_states`` or an earlier ``step_batch`` (for envs with
                ``get_state``/``set_state``, any values they take); None steps the envs
                from their current states (then M must equal N).
            dt: Steps per pair: an int, or M ints, each >= 1.

        Returns:
            ``(new_states, obs, rewards, terminated, truncated, infos)``: a list of M states
            (in the envs' own form, as ``get_states`` gives them),
            batched observations, float64 summed rewards and bool flags of the last step,
            each of length M, and a list of M info dicts (the last step's).

        Raises:
            ValueError, TypeError: Actions, states and ``dt`` do not agree in length or kind,
                or a state is of another env class; raised before anything is sent.
            EnvError: An env raised; the lowest pair's error, naming its env.
        """
        self._check_idle("step_batch")
        if states is None:
            count = len(actions)
            if count != self.num_envs:
                raise ValueError(
                    f"step_batch() without states steps every env from its current state: "
                    f"pass {self.num_envs} actions, got {count}."
                )
            states = self.get_states()
        return step_batch(self, actions, states, dt)

    def worker_groups(self) -> list[WorkerGroup]:
        """The vector's workers, with their envs' positions (for ``multienv.vector.planning``)."""
        return self._groups


def _descriptions(vec: PlanningApi) -> list[EnvDescription]:
    return [proxy.supervisor.descriptions[proxy.position] for proxy in vec.envs]


def check_states(vec: PlanningApi, states: Sequence[Any], what: str) -> list[Any]:
    """``states`` as a list, each a state some env of the vector can take.

    An ``EnvSnapshot`` must be of a class the vector's envs have; any other value is a raw
    state, for envs with ``get_state()``/``set_state()`` of their own: all of them, since a
    pair may run on any env.
    """
    if isinstance(states, EnvSnapshot | np.ndarray) or not isinstance(states, Sequence):
        raise TypeError(
            f"{what} takes a list of states (one per pair or env), got {type(states).__name__}."
        )
    descriptions = _descriptions(vec)
    known = {description.env_type for description in descriptions}
    without = [i for i, description in enumerate(descriptions) if not description.has_own_state]
    checked = list(states)
    for j, state in enumerate(checked):
        if not isinstance(state, EnvSnapshot):
            if without:
                raise TypeError(
                    f"{what}: state {j} is a {type(state).__name__}, not a state from "
                    f"get_states(): env {without[0]} has no get_state()/set_state() of its own."
                )
        elif state.env_type not in known:
            raise ValueError(
                f"{what}: state {j} is of a {state.env_type} env; these envs are "
                f"{', '.join(sorted(known))}."
            )
    return checked


def check_set_states(vec: PlanningApi, states: Sequence[Any]) -> list[Any]:
    """One state per env, each one that env can take; raises naming the env otherwise."""
    if isinstance(states, EnvSnapshot | np.ndarray) or not isinstance(states, Sequence):
        raise TypeError(
            f"set_states() takes a list of states, one per env, got {type(states).__name__}."
        )
    checked = list(states)
    if len(checked) != vec.num_envs:
        raise ValueError(
            f"set_states() got {len(checked)} states for {vec.num_envs} envs; pass one per env, "
            "or use sync_states(state) to put the same state into every env."
        )
    for env_index, (state, description) in enumerate(zip(checked, _descriptions(vec), strict=True)):
        check_state(state, description, env_index)
    return checked


def step_batch(
    vec: PlanningApi, actions: Any, states: Sequence[Any] | None, dt: Any
) -> tuple[list[Any], Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """See ``MultiEnv.step_batch``; ``states`` None has been replaced by the current ones."""
    assert states is not None
    checked = check_states(vec, states, "step_batch()")
    count = len(checked)
    action_column = _actions(vec, actions, count)
    steps = _dts(dt, count)
    if count == 0:  # no pairs: nothing to send
        no_obs = create_empty_array(vec.single_observation_space, 0)
        no_flags = np.zeros(0, dtype=np.bool_)
        return [], no_obs, np.zeros(0, dtype=np.float64), no_flags, no_flags.copy(), []
    packed = pack_states(checked)  # one array for all pairs when it can be; sliced per share
    workers = vec.worker_groups()
    sizes = [len(worker.env_ids) for worker in workers]
    total = sum(sizes)
    shares: list[tuple[Any, range]] = []
    first = envs_before = 0
    for worker, size in zip(workers, sizes, strict=True):
        envs_before += size
        last = round(count * envs_before / total)
        if last > first:
            shares.append((worker, range(first, last)))
        first = last
    restarts_before = []
    for worker, items in shares:
        span = slice(items.start, items.stop)
        pairs = Pairs(worker.positions, packed[span], action_column[span], steps[span])
        supervisor = worker.supervisor
        restarts_before.append(supervisor.stats.restarts)
        supervisor.send_request(
            worker.positions[0], Command.STEP_PAIRS, pairs, int(steps[span].sum())
        )
    new_states: list[Any] = []
    parts: list[PairResults] = []
    errors: dict[int, Exception] = {}
    replays: list[tuple[range, dict[str, Any]]] = []
    for (worker, items), before in zip(shares, restarts_before, strict=True):
        supervisor = worker.supervisor
        try:
            results: PairResults = supervisor.finish_request()
        except Exception as exc:  # noqa: BLE001 - raised below, lowest pair first
            errors[items[0]] = exc
            continue
        for n, failure in results.failures.items():
            errors[items[n]] = supervisor.env_error(failure, "step_batch", failure.position)
        parts.append(results)
        new_states.extend(results.snapshots)
        stats = supervisor.stats
        if stats.restarts != before:
            replay = {
                "restarted": True,
                "cause": stats.last_failure,
                "restarts": stats.restarts,
                "replayed": True,
            }
            replays.append((items, replay))
    if errors:
        raise errors[min(errors)]
    infos = [info for part in parts for info in part.infos]
    for items, replay in replays:
        for j in items:
            infos[j] = {**infos[j], "multienv": replay}
    space = vec.single_observation_space
    share_obs = [part.obs for part in parts]
    if isinstance(space, gym.spaces.Box) and all(isinstance(o, np.ndarray) for o in share_obs):
        obs: Any = np.concatenate(share_obs).astype(space.dtype, copy=False)  # workers stacked
    else:
        rows = [row for part in share_obs for row in part]
        buffer: Any = create_empty_array(space, count)
        obs = concatenate(space, rows, buffer)
    rewards = np.concatenate([part.rewards for part in parts])  # float64, as the workers send
    terminated = np.concatenate([part.terminated for part in parts])
    truncated = np.concatenate([part.truncated for part in parts])
    return new_states, obs, rewards, terminated, truncated, infos


def _actions(vec: PlanningApi, actions: Any, count: int) -> np.ndarray | list[Any]:
    """One action per pair: an array for array spaces, else a list.

    An array's elements reach the envs as numpy values, as ``SyncVectorEnv`` passes them.
    """
    space = vec.single_action_space
    if isinstance(space, ARRAY_SPACES):
        array = np.asarray(actions)
        shape = tuple(space.shape or ())
        if array.shape != (count, *shape):
            raise ValueError(
                f"step_batch() got actions of shape {array.shape}; expected {(count, *shape)} "
                f"for {count} states."
            )
        return array
    action_list = list(actions)
    if len(action_list) != count:
        raise ValueError(f"step_batch() got {len(action_list)} actions for {count} states.")
    return action_list


def _dts(dt: Any, count: int) -> np.ndarray:
    if type(dt) is int and dt >= 1:  # the usual call, checked in a tenth of the time
        return np.full(count, dt)
    steps = np.asarray(dt)
    if steps.ndim == 0:
        steps = np.full(count, steps)
    if steps.shape != (count,) or not np.issubdtype(steps.dtype, np.integer) or (steps < 1).any():
        raise ValueError(f"step_batch() dt must be an int >= 1 or {count} of them, got {dt!r}.")
    return steps
