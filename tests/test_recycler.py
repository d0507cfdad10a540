"""recycler: when and how one worker is replaced at an episode boundary, against a fake host."""

import numpy as np

from multienv import RecyclePolicy
from multienv.supervision.recycler import Recycler
from multienv.wire.protocol import Batch, BatchResult, Command, Outcome


class Host:
    """What a Recycler uses of its worker's supervisor, recording what it is asked."""

    num_envs = 2

    def __init__(self, rss_mb=10.0):
        self.steps = self.episodes = 0
        self.recycle_s = 0.0
        self.rss = rss_mb
        self.pid = 100
        self.calls = []
        self.handle = self
        self.stats = self

    # the handle
    def rss_mb(self):
        return self.rss

    def prestart(self):
        self.calls.append("prestart")

    # the stats
    def since_spawn(self):
        return self.steps, self.episodes

    def note_recycle(self):
        self.calls.append("note_recycle")

    # the supervisor
    def has_lost_episodes(self):
        return False

    def kill_for(self, cause):
        self.calls.append(f"kill_for {cause}")

    def replace_worker(self):
        self.calls.append("replace_worker")
        self.pid += 1

    def request(self, position, command, payload):
        assert command is Command.GET_ATTR
        return f"rng of {position}"

    def envs_text(self):
        return "envs 0-1"


def steps(autoreset=False):
    return Batch([0, 1], np.zeros(2, np.bool_), [1, 1], autoreset)


def resets():
    return Batch([0, 1], np.ones(2, np.bool_), [None, None])


def result(done=(False, False), extras=None):
    return BatchResult(np.zeros(2), np.array(done), np.zeros(2, bool), None, extras or {})


def test_a_worker_under_its_budget_is_left_alone():
    host = Host()
    recycler = Recycler(RecyclePolicy(max_steps=100), host)
    batch = steps()
    assert recycler.before(batch) is batch
    assert not recycler.is_busy()
    assert host.calls == []


def test_near_its_budget_a_successor_starts_and_steps_keep_the_ending_generators():
    host = Host()
    host.steps = 95
    recycler = Recycler(RecyclePolicy(max_steps=100), host)
    sent = recycler.before(steps())
    assert host.calls == ["prestart"]
    assert sent.keep_np_randoms
    assert recycler.is_busy()  # its steps cannot be planned while a successor waits


def test_due_it_is_swapped_when_a_batch_resets_every_env_and_the_resets_are_flagged():
    host = Host()
    host.steps = 100
    recycler = Recycler(RecyclePolicy(max_steps=100), host)
    sent = recycler.before(steps())  # not a boundary: no swap yet
    assert "replace_worker" not in host.calls
    ended = {0: Outcome(np_random="rng kept at its end")}
    recycler.after(sent, result((True, False), ended))
    sent = recycler.before(resets())
    assert host.calls == ["prestart", "replace_worker", "note_recycle"]
    assert host.recycle_s > 0  # the time the swap took, for MultiEnv.timing()
    assert sent.np_randoms == ["rng kept at its end", "rng of 1"]  # the same random numbers
    reset_result = result()
    recycler.after(sent, reset_result)
    info = reset_result.extras[1].info["multienv"]
    assert info == {"recycled": True, "reason": "max_steps"}


def test_over_the_hard_cap_a_worker_is_killed_at_once():
    host = Host(rss_mb=900.0)
    recycler = Recycler(RecyclePolicy(hard_rss_mb=500.0), host)
    recycler.before(steps())
    assert host.calls == ["kill_for rss"]


def test_same_step_a_due_workers_episodes_end_unreset_and_the_swap_follows_the_last():
    host = Host()
    host.episodes = 5
    recycler = Recycler(RecyclePolicy(max_episodes=5), host)
    sent = recycler.before(steps(autoreset=True))
    assert not sent.autoreset  # held: the vector resets each ended episode
    done = result((True, True))
    recycler.after(sent, done)
    assert "replace_worker" in host.calls
    assert all(done.extras[item].reset is None for item in (0, 1))
