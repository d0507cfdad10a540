"""VECTOR API: from the workers' results to the vector's batch, and infos merged Gymnasium's way.

``Assembly`` owns what a vector returns: the batched observations (from the link's shared
memory, or concatenated from each env's last observation), the reward and flag arrays, the
infos (``key`` + ``_key`` mask arrays), and the bookkeeping that follows a result: the
autoreset state of each env and, for planned steps, the counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import VectorEnv
from gymnasium.vector.utils import concatenate, create_empty_array

from multienv.supervision.handles import SharedMemoryLink, VectorLink
from multienv.supervision.worker_stats import VectorCounters
from multienv.vector.fan_out import ByWorker, WorkerGroup
from multienv.wire.autoreset import Autoreset, same_step_info
from multienv.wire.protocol import BatchResult, StepPlan

StepBatch = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]
_ALL = slice(None)
# SAME_STEP, after a crash: reset that env now; returns its final obs, new obs and reset info.
ResetAfterCrash = Callable[[int], tuple[Any, Any, dict[str, Any]]]


class InfoMerger:
    """Merges infos Gymnasium's way (``key`` + ``_key`` arrays) for a batch of ``num_envs``."""

    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        """Merge into arrays of this length."""
        self.num_envs = num_envs

    def add(self, infos: dict[str, Any], info: dict[str, Any], env_index: int) -> dict[str, Any]:
        """``infos`` with ``info`` merged in at ``env_index``."""
        merged: dict[str, Any] = self._add_info(infos, info, env_index)  # type: ignore[misc]
        return merged

    def merge(self, infos_by_env: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The infos of many envs (by env index) merged, in env order."""
        infos: dict[str, Any] = {}
        for env_index in sorted(infos_by_env):
            infos = self.add(infos, infos_by_env[env_index], env_index)
        return infos


class Assembly:
    """A vector's returned batches, and the per-env state that results update.

    Args:
        observation_space: The single-env observation space.
        num_envs: How many envs the vector has.
        link: The backend's link (observations come from it when it shares them).
        autoreset: The vector's autoreset state.
        copy: Return copies of the batched observations.
        reset_after_crash: Resets an env whose worker died in a SAME_STEP step.
    """

    def __init__(
        self,
        observation_space: gym.Space[Any],
        num_envs: int,
        link: VectorLink,
        autoreset: Autoreset,
        copy: bool,
        reset_after_crash: ResetAfterCrash,
    ) -> None:
        """Allocate the arrays returned by every step."""
        self.observation_space = observation_space
        self.num_envs = num_envs
        self.shared_link = (
            link if isinstance(link, SharedMemoryLink) and link.has_shared_obs else None
        )
        self.autoreset = autoreset
        self.copy = copy
        self.counters = VectorCounters(num_envs)
        self._reset_after_crash = reset_after_crash
        self._infos = InfoMerger(num_envs)
        self.add_info = self._infos.add  # Gymnasium's _add_info for the vector's size
        self.env_obs: list[Any] = [None] * num_envs  # when not in shared memory
        self._observations: Any = create_empty_array(observation_space, n=num_envs, fn=np.zeros)
        self._rewards = np.zeros(num_envs, dtype=np.float64)
        self._terminations = np.zeros(num_envs, dtype=np.bool_)
        self._truncations = np.zeros(num_envs, dtype=np.bool_)

    def reset_batch(
        self,
        outcome: ByWorker,
        groups: Sequence[WorkerGroup],
        mask: np.ndarray,
        plan: StepPlan | None = None,
    ) -> tuple[Any, dict[str, Any], dict[int, BaseException]]:
        """The reset's batched observations and infos, and its errors by env index.

        ``plan``: the data plane's reset handed over (``StepPlan.skip``): a worker that
        answered its part in full left it all in shared memory, and the infos of any that
        answered it are in its envs' rows of the info columns.
        """
        pickled: dict[int, dict[str, Any]] = {}
        errors: dict[int, BaseException] = {}
        answered: list[int] = []  # envs whose infos are in their rows
        for number, group in enumerate(groups):
            if number not in outcome:
                continue
            result, group_errors = outcome[number]
            errors.update(group_errors)
            ids = [env_index for env_index in group.env_ids if mask[env_index]]
            if result is None:
                if plan is not None and not group_errors and ids:  # all in shared memory
                    assert self.shared_link is not None
                    self.shared_link.commit(plan, np.asarray(ids, dtype=np.intp))
                    self.autoreset.after_reset(ids)
                    answered += ids
                continue
            self.autoreset.after_reset([i for i in ids if i not in group_errors])
            if result.info_columns:
                answered += ids
            for item, env_index in enumerate(ids):
                if env_index in group_errors:
                    continue
                if result.obs is not None:
                    self.env_obs[env_index] = result.obs[item]
                extra = result.extras.get(item)
                if extra is not None and extra.info:
                    pickled[env_index] = extra.info
        if answered:
            assert self.shared_link is not None
            fresh = np.asarray(answered, dtype=np.intp)
            infos = self.shared_link.merge_info_columns(pickled, fresh, self._infos.add)
        else:
            infos = self._infos.merge(pickled)
        return self.observations(), infos, errors

    def step_batch(
        self, outcome: ByWorker, groups: Sequence[WorkerGroup], plan: StepPlan | None
    ) -> tuple[StepBatch, dict[int, BaseException]]:
        """The step's batch, and its errors by env index (an env that raised did not step)."""
        if plan is not None and _is_clean(outcome, len(groups)):
            return self._clean_step(plan), {}
        rewards, terminations, truncations = self._rewards, self._terminations, self._truncations
        pickled: dict[int, dict[str, Any]] = {}  # infos that came through the pipe, by env
        errors: dict[int, BaseException] = {}
        autoreset = self.autoreset
        # An env that raised is as it was: one whose autoreset's reset raised still needs
        # it (as in SyncVectorEnv), so the step is not taken from the ended episode.
        resets_before = autoreset.needs_reset.copy()
        clean = [
            n
            for n, (result, group_errors) in outcome.items()
            if result is None and not group_errors
        ]
        if clean:
            assert plan is not None
            if len(clean) == len(groups):
                self._commit(plan, slice(None))  # the usual case: one op for all envs
                pickled.update(self._finals(plan, _ALL, terminations | truncations))
            else:
                for number in clean:
                    index = groups[number].index
                    self._commit(plan, index)
                    done = terminations[index] | truncations[index]
                    pickled.update(self._finals(plan, index, done))
        for number, (result, group_errors) in outcome.items():
            errors.update(group_errors)
            if result is None:
                continue
            group = groups[number]
            index = group.index
            rewards[index] = result.rewards
            terminations[index] = result.terminated
            truncations[index] = result.truncated
            autoreset.after_step(index, result.terminated, result.truncated)
            for item, env_index in enumerate(group.env_ids):
                if env_index not in group_errors:  # an env that raised keeps its obs
                    info = self._file_env(result, item, env_index)
                    if info:
                        pickled[env_index] = info
        if plan is not None:
            infos = self._column_infos(pickled, outcome, groups, len(clean))
        else:
            infos = self._infos.merge(pickled)
        if errors:
            failed = np.array(sorted(errors))
            rewards[failed], terminations[failed], truncations[failed] = 0.0, False, False
            autoreset.after_episodes(failed, resets_before[failed])
        batch = self.observations(), rewards.copy(), terminations.copy(), truncations.copy(), infos
        return batch, errors

    def receive(
        self,
        outcome: ByWorker,
        flying: dict[int, list[int]],
        received: dict[int, tuple[Any, ...]],
        plans: dict[int, StepPlan],
    ) -> dict[int, BaseException]:
        """File collected workers' envs under ``received``, in the order they came in.

        Args:
            outcome: The collected workers' results.
            flying: Per worker number, the envs sent to it; the collected ones are removed.
            received: By env index, (reward, terminated, truncated, info) not yet returned.
            plans: Per worker number, the planned step whose part it took (a part the parts
                plane handed over); the collected ones are removed.
        """
        errors: dict[int, BaseException] = {}
        for number, (result, group_errors) in outcome.items():
            ids = flying.pop(number)
            plan = plans.pop(number, None)
            errors.update(group_errors)
            if result is None:
                if plan is not None and not group_errors:  # all of it in shared memory
                    self._receive_part(plan, ids, received)
                continue
            failed = [env_index for env_index in ids if env_index in group_errors]
            resets_before = self.autoreset.needs_reset[failed].copy()
            self.autoreset.after_step(ids, result.terminated, result.truncated)
            self.autoreset.after_episodes(failed, resets_before)  # as it was (``step_batch``)
            rows = self._row_infos(ids) if result.info_columns else {}
            for item, env_index in enumerate(ids):
                if env_index in group_errors:
                    continue
                info = self._file_env(result, item, env_index)
                if env_index in rows:
                    info = {**rows[env_index], **info}
                terminated, truncated = bool(result.terminated[item]), bool(result.truncated[item])
                received[env_index] = (float(result.rewards[item]), terminated, truncated, info)
        return errors

    def _receive_part(
        self, plan: StepPlan, ids: list[int], received: dict[int, tuple[Any, ...]]
    ) -> None:
        """File a worker's clean part of a planned step (its envs ``ids``, a run)."""
        index = slice(ids[0], ids[-1] + 1)
        self._commit(plan, index)
        rows = self._row_infos(ids)
        rewards = self._rewards[index].tolist()
        terminated = self._terminations[index].tolist()
        truncated = self._truncations[index].tolist()
        finals = self._finals(plan, index, self._terminations[index] | self._truncations[index])
        for item, env_index in enumerate(ids):
            info = rows.get(env_index, {})
            if env_index in finals:  # its final obs and info first, then its reset's info
                info = {**finals[env_index], **info}
            received[env_index] = (rewards[item], terminated[item], truncated[item], info)

    def _row_infos(self, ids: list[int]) -> dict[int, dict[str, Any]]:
        """The infos in the rows of envs ``ids``, by env (their worker answered a plan)."""
        assert self.shared_link is not None
        return self.shared_link.row_infos(np.asarray(ids, dtype=np.intp))

    def _file_env(self, result: BatchResult, item: int, env_index: int) -> dict[str, Any]:
        """One env's part of its worker's step: keep its observation, return its info.

        The info is what the autoreset rule makes of the worker's extras for that env
        (``Autoreset.step_info``), with a crash's reset applied; empty when there are none.
        """
        if result.obs is not None:
            self.env_obs[env_index] = result.obs[item]
        extra = result.extras.get(item)
        if extra is None:
            return {}
        is_done = bool(result.terminated[item] or result.truncated[item])
        info, must_reset = self.autoreset.step_info(extra, is_done)
        return self._crash_reset(env_index, info) if must_reset else info

    def partial_batch(self, ids: list[int], rows: list[tuple[Any, ...]]) -> StepBatch:
        """The batch of some envs' received steps, ``infos["env_id"]`` naming them."""
        size = len(ids)
        infos: dict[str, Any] = {}
        merger = InfoMerger(size)
        for position, row in enumerate(rows):
            if row[3]:
                infos = merger.add(infos, row[3], position)
        infos["env_id"] = np.asarray(ids, dtype=np.int64)
        observations: Any
        if self.shared_link is not None:
            observations = self.shared_link.observations(ids, copy=True)
        else:
            observations = create_empty_array(self.observation_space, n=size, fn=np.zeros)
            observations = concatenate(
                self.observation_space, [self.env_obs[i] for i in ids], observations
            )
        return (
            observations,
            np.array([row[0] for row in rows], dtype=np.float64),
            np.array([row[1] for row in rows], dtype=np.bool_),
            np.array([row[2] for row in rows], dtype=np.bool_),
            infos,
        )

    def observations(self) -> Any:
        """The batched observations of every env."""
        if self.shared_link is not None:
            return self.shared_link.observations(None, copy=self.copy)
        self._observations = concatenate(self.observation_space, self.env_obs, self._observations)
        return deepcopy(self._observations) if self.copy else self._observations

    def _clean_step(self, plan: StepPlan) -> StepBatch:
        """The usual step: every worker's part of a plan is in shared memory, infos too."""
        link = self.shared_link
        assert link is not None
        rewards, terminated, truncated = link.commit(plan, _ALL)
        done = terminated | truncated
        self.autoreset.after_episodes(_ALL, done)
        if plan.num_resets:
            self.counters.note_planned(_ALL, plan.is_reset, done)
        else:
            self.counters.note_steps(done)
        infos = link.merge_info_columns(self._finals(plan, _ALL, done), _ALL, self._infos.add)
        return self.observations(), rewards.copy(), terminated.copy(), truncated.copy(), infos

    def _commit(self, plan: StepPlan, index: slice) -> None:
        """Take the results of envs ``index`` of a planned step from shared memory."""
        assert self.shared_link is not None
        rewards, terminated, truncated = self.shared_link.commit(plan, index)
        self._rewards[index] = rewards
        self._terminations[index] = terminated
        self._truncations[index] = truncated
        done = terminated | truncated
        self.autoreset.after_episodes(index, done)
        self.counters.note_planned(index, plan.is_reset[index], done)

    def _finals(self, plan: StepPlan, index: Any, done: np.ndarray) -> dict[int, dict[str, Any]]:
        """The infos of the episodes that envs ``index`` of a clean planned step ended.

        ``done``: which of them ended; their workers left the finals in shared memory when
        ``plan.has_finals``, and then each gets its ``final_obs`` and ``final_info``.
        """
        if not plan.has_finals or not np.count_nonzero(done):
            return {}
        ended = np.arange(len(self._rewards))[index][done]
        assert self.shared_link is not None
        return self.shared_link.finals(ended)

    def _column_infos(
        self,
        pickled: dict[int, dict[str, Any]],
        outcome: ByWorker,
        groups: Sequence[WorkerGroup],
        num_clean: int,
    ) -> dict[str, Any]:
        """A planned step's infos: ``pickled`` and the rows of the workers that answered it."""
        assert self.shared_link is not None
        if num_clean == len(groups):
            return self.shared_link.merge_info_columns(pickled, slice(None), self._infos.add)
        answered = [
            groups[number].env_ids
            for number, (result, group_errors) in outcome.items()
            if (result is None and not group_errors) or (result is not None and result.info_columns)
        ]
        if not answered:
            return self._infos.merge(pickled)
        fresh = np.concatenate([np.asarray(ids, dtype=np.intp) for ids in answered])
        return self.shared_link.merge_info_columns(pickled, fresh, self._infos.add)

    def _crash_reset(self, env_index: int, info: dict[str, Any]) -> dict[str, Any]:
        """SAME_STEP: reset an env whose worker died mid-step; report the crash's final obs."""
        final_obs, obs, reset_info = self._reset_after_crash(env_index)
        self.env_obs[env_index] = obs
        return same_step_info(final_obs, info, reset_info)


def _is_clean(outcome: ByWorker, num_workers: int) -> bool:
    """Whether every worker answered its part of a planned step with all of it in memory."""
    if len(outcome) != num_workers:
        return False
    return all(result is None and not errors for result, errors in outcome.values())
