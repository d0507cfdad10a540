"""The episodes a worker's death cut, and the truncation each env's next step becomes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from multienv.supervision.truncation import CutEpisodes
from multienv.wire.protocol import Batch, BatchResult

SPACE = gym.spaces.Box(0, 10, shape=(2,), dtype=np.float32)


def steps(positions: list[int], resets: list[bool] | None = None) -> Batch:
    is_reset = np.array(resets if resets is not None else [False] * len(positions))
    return Batch(positions, is_reset, [0] * len(positions))


def result_of(obs: list[np.ndarray]) -> BatchResult:
    n = len(obs)
    return BatchResult(np.ones(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_), obs, {})


def cut(num_envs: int = 3) -> CutEpisodes:
    return CutEpisodes(num_envs, lambda position: None, lambda position: SPACE)


def test_after_a_death_each_env_is_truncated_once_at_its_next_step_and_not_sent():
    episodes = cut()
    episodes.note_obs(
        steps([0, 1, 2]), result_of([np.full(2, v, np.float32) for v in (1, 2, 3)]), {}, []
    )
    episodes.lose_all("SIGKILL")
    assert episodes.has_lost()
    batch = steps([0, 2])
    sent, sent_items, lost = episodes.split(batch)
    assert (sent_items, lost) == ([], {0: "SIGKILL", 1: "SIGKILL"})
    assert len(sent.positions) == 0
    result = BatchResult(np.ones(2), np.ones(2, np.bool_), np.zeros(2, np.bool_), [None, None], {})
    for item, cause in lost.items():
        episodes.truncate(result, batch, item, cause, restarts=1)
    assert result.truncated.tolist() == [True, True]
    assert result.terminated.tolist() == [False, False]
    assert result.rewards.tolist() == [0.0, 0.0]
    assert result.obs[1].tolist() == [3.0, 3.0]  # the last observation env 2's caller saw
    assert result.extras[0].info == {
        "multienv": {"restarted": True, "cause": "SIGKILL", "restarts": 1}
    }
    assert episodes.has_lost()  # env 1 is still to be told
    assert episodes.split(steps([1], [True]))[2] == {}  # a reset clears its loss
    assert not episodes.has_lost()


def test_an_env_never_seen_is_truncated_with_zeros_of_its_space():
    episodes = cut(1)
    assert episodes.last_obs(0).tolist() == [0.0, 0.0]
    shared = CutEpisodes(1, lambda position: np.full(2, 7.0, np.float32), lambda position: SPACE)
    assert shared.last_obs(0).tolist() == [7.0, 7.0]  # read from shared memory when there


def test_a_restored_state_goes_on_without_a_truncation():
    episodes = cut(2)
    episodes.lose_all("timeout")
    episodes.restored(0)
    assert episodes.split(steps([0, 1]))[2] == {1: "timeout"}
