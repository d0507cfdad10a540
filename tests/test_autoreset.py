"""The autoreset rule in all three modes, as a table, with no worker involved."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode

from multienv.errors import EnvStateError
from multienv.wire.autoreset import Autoreset, same_step_info, step_env
from multienv.wire.protocol import Outcome


class Toy:
    """Episodes of two steps; obs counts resets (x10) and steps."""

    def __init__(self) -> None:
        self.resets, self.t = 0, 0

    def reset(self, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        self.resets, self.t = self.resets + 1, 0
        return 10 * self.resets, {"reset": self.resets}

    def step(self, action: Any) -> tuple[int, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return 10 * self.resets + self.t, 1.0, self.t == 2, False, {"t": self.t}


def no_check(position: int, obs: Any) -> None:
    pass


# mode, episode ended?, the worker resets in the same trip?, next step resets?, misuse to step?
TABLE = [
    (AutoresetMode.NEXT_STEP, False, False, False, False),
    (AutoresetMode.NEXT_STEP, True, False, True, False),
    (AutoresetMode.SAME_STEP, False, False, False, False),
    (AutoresetMode.SAME_STEP, True, True, False, False),
    (AutoresetMode.DISABLED, False, False, False, False),
    (AutoresetMode.DISABLED, True, False, False, True),
]


@pytest.mark.parametrize(("mode", "ended", "worker_resets", "next_resets", "misuse"), TABLE)
def test_autoreset_rule(
    mode: AutoresetMode, ended: bool, worker_resets: bool, next_resets: bool, misuse: bool
) -> None:
    env = Toy()
    env.reset()
    if ended:
        env.step(0)
    rule = Autoreset(mode, 1)
    rule.after_reset([0])  # the vector's first reset, as env.reset() above
    obs, _reward, terminated, truncated, info, final = step_env(
        env, 0, 0, rule.is_same_step, no_check
    )
    assert terminated is ended
    assert (final is not None) is worker_resets
    if worker_resets:
        assert final == (12, {"t": 2})
        assert (obs, info) == (20, {"reset": 2})
    rule.after_step([0], np.array([terminated]), np.array([truncated]))
    assert rule.resets([0]).tolist() == [next_resets]
    if misuse:
        with pytest.raises(EnvStateError, match="env 0: step\\(\\) after its episode ended"):
            rule.check_can_step([0])
    else:
        rule.check_can_step([0])
    rule.after_reset([0])
    assert rule.resets([0]).tolist() == [False]
    rule.check_can_step([0])


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_a_step_before_an_envs_first_reset_is_refused_naming_it(mode: AutoresetMode) -> None:
    rule = Autoreset(mode, 3)
    rule.after_reset([0, 2])  # a reset_mask that left env 1 out
    rule.check_can_step([0, 2])
    with pytest.raises(ResetNeeded, match=r"env 1: step\(\) before the env's first reset\(\)"):
        rule.check_can_step(slice(None))
    rule.after_reset([1])
    rule.check_can_step(slice(None))


def test_same_step_info_is_gymnasiums_final_obs_and_final_info() -> None:
    rule = Autoreset(AutoresetMode.SAME_STEP, 1)
    extra = Outcome(obs=12, info={"t": 2}, reset=(None, {"reset": 2}))
    info, must_reset = rule.step_info(extra, is_done=True)
    assert (info, must_reset) == ({"final_obs": 12, "final_info": {"t": 2}, "reset": 2}, False)


def test_a_crash_under_same_step_asks_the_vector_to_reset_and_lifts_the_flag() -> None:
    rule = Autoreset(AutoresetMode.SAME_STEP, 1)
    flag = {"multienv": {"restarted": True, "cause": "SIGKILL", "restarts": 1}}
    info, must_reset = rule.step_info(Outcome(info=flag), is_done=True)
    assert must_reset
    assert info == flag
    merged = same_step_info(7, info, {"reset": 3})
    assert merged == {"final_obs": 7, "final_info": flag, **flag, "reset": 3}


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
def test_other_modes_report_the_step_info_as_is(mode: AutoresetMode) -> None:
    info, must_reset = Autoreset(mode, 1).step_info(Outcome(info={"t": 2}), is_done=True)
    assert (info, must_reset) == ({"t": 2}, False)
