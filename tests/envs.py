"""Toy envs for the tests; module-level so they pickle by reference under forkserver/spawn."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class CountingEnv(gym.Env):
    """Observation is the step count in the episode; terminates after ``episode_length`` steps."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"]}

    def __init__(self, episode_length: int = 5, render_mode: str | None = None) -> None:
        self.observation_space = gym.spaces.Box(0, 1000, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode_length = episode_length
        self.render_mode = render_mode
        self.count = 0
        self.scale = 1.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.count = 0
        return self._obs(), {"seed_used": -1 if seed is None else seed}

    def step(self, action):
        self.count += 1
        terminated = self.count >= self.episode_length
        return self._obs(), float(action) * self.scale, terminated, False, {"count": self.count}

    def render(self):
        return np.full((2, 2, 3), self.count, dtype=np.uint8)

    def add(self, a: int, b: int = 0) -> int:
        return a + b

    def _obs(self) -> np.ndarray:
        return np.array([self.count], dtype=np.float32)


class ActionTypeEnv(CountingEnv):
    """Keeps the type of every action it was given."""

    def __init__(self) -> None:
        super().__init__(episode_length=1000)
        self.action_types: list[str] = []

    def step(self, action):
        self.action_types.append(type(action).__name__)
        return super().step(action)


class DictObsEnv(gym.Env):
    """A Dict observation space with random dynamics and episodes of random length."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "position": gym.spaces.Box(-10, 10, shape=(2,), dtype=np.float64),
                "mode": gym.spaces.Discrete(3),
            }
        )
        self.action_space = gym.spaces.Box(-1, 1, shape=(2,), dtype=np.float32)
        self.position = np.zeros(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-1, 1, size=2)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.position = np.clip(self.position + action + self.np_random.normal(0, 0.1, 2), -10, 10)
        terminated = bool(np.abs(self.position).max() > 3)
        truncated = self.t >= 40
        return (
            self._obs(),
            -float(np.abs(self.position).sum()),
            terminated,
            truncated,
            {"t": self.t},
        )

    def _obs(self) -> dict[str, Any]:
        return {"position": self.position.copy(), "mode": int(self.t % 3)}


class FrameObsEnv(DictObsEnv):
    """DictObsEnv's dynamics seen as a 16 KiB frame.

    Observations this large are written by the worker one by one, each as soon as its env
    has stepped (``SlotWriter.writes_each_obs``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Box(0, 255, shape=(64, 64, 4), dtype=np.uint8)

    def _obs(self) -> Any:
        frame = np.full((64, 64, 4), int(abs(self.position[0]) * 50) % 256, dtype=np.uint8)
        frame[self.t % 64] = int(abs(self.position[1]) * 50) % 256
        return frame


class FrameDictObsEnv(FrameObsEnv):
    """FrameObsEnv's frame beside DictObsEnv's observation, in one Dict."""

    def __init__(self) -> None:
        super().__init__()
        frame_space = self.observation_space
        self.observation_space = gym.spaces.Dict(
            {
                "frame": frame_space,
                "position": gym.spaces.Box(-10, 10, shape=(2,), dtype=np.float64),
                "mode": gym.spaces.Discrete(3),
            }
        )

    def _obs(self) -> Any:
        return {"frame": super()._obs(), **DictObsEnv._obs(self)}


class SlowInitEnv(CountingEnv):
    """Takes ``delay_s`` seconds to construct."""

    def __init__(self, delay_s: float = 0.5) -> None:
        time.sleep(delay_s)
        super().__init__()


class RaiseOnStep(CountingEnv):
    """Raises ValueError on the step that reaches ``at_count``."""

    def __init__(self, at_count: int = 2) -> None:
        super().__init__(episode_length=100)
        self.at_count = at_count

    def step(self, action):
        if self.count + 1 == self.at_count:
            self.count += 1
            raise ValueError(f"boom at count {self.count}")
        return super().step(action)


class RaiseInInit(gym.Env):
    def __init__(self) -> None:
        raise RuntimeError("cannot build this env")


def _crash_once(marker: str) -> bool:
    """True the first time it is called for ``marker`` across all processes."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def segfault() -> None:
    ctypes.string_at(0)


class SegfaultOnceOnStep(CountingEnv):
    """Segfaults on step ``at_count`` of the first worker that gets there (marker file)."""

    def __init__(self, marker: str, at_count: int = 3) -> None:
        super().__init__(episode_length=10)
        self.marker, self.at_count = marker, at_count

    def step(self, action):
        if self.count + 1 == self.at_count and _crash_once(self.marker):
            segfault()
        return super().step(action)


class SegfaultOnceThenHang(CountingEnv):
    """The first step anywhere segfaults its worker (marker file); every later step hangs."""

    def __init__(self, marker: str) -> None:
        super().__init__(episode_length=100)
        self.marker = marker

    def step(self, action):
        if _crash_once(self.marker):
            segfault()
        time.sleep(3600)
        return super().step(action)


class SlowReset(CountingEnv):
    """reset() takes ``delay_s`` seconds; used to kill a worker in the middle of a reset."""

    def __init__(self, delay_s: float = 0.5) -> None:
        super().__init__(episode_length=10)
        self.delay_s = delay_s

    def reset(self, *, seed=None, options=None):
        time.sleep(self.delay_s)
        return super().reset(seed=seed, options=options)


class QuietSlowReset(SlowReset):
    """A ``SlowReset`` whose reset info is empty, so a planned step's reset answers by record."""

    def reset(self, *, seed=None, options=None):
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {}


class BoxActionEnv(gym.Env):
    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, shape=(3,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1, 1, shape=(2,), dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(3, dtype=np.float32), float(np.sum(action)), False, False, {}


class ExitOnStep(CountingEnv):
    """Calls os._exit(code) on step ``at_count`` of the first worker that gets there."""

    def __init__(self, marker: str, at_count: int = 2, code: int = 1) -> None:
        super().__init__(episode_length=10)
        self.marker, self.at_count, self.code = marker, at_count, code

    def step(self, action):
        if self.count + 1 == self.at_count and _crash_once(self.marker):
            os._exit(self.code)
        return super().step(action)


class SegfaultEveryStep(CountingEnv):
    """Writes a line to stderr, then segfaults, on every step: a crash loop."""

    def step(self, action):
        sys.stderr.write("about to dereference NULL\n")
        sys.stderr.flush()
        segfault()


class AllocateOnStep(CountingEnv):
    """Allocates 2 GiB, a chunk at a time, on every step (to be killed mid-allocation)."""

    def step(self, action):
        chunks = [np.ones(2**24) for _ in range(16)]  # 16 x 128 MiB = 2 GiB, in about 1 s
        del chunks
        return super().step(action)


class HangOnStep(CountingEnv):
    """Sleeps ``hang_s`` seconds on step ``at_count`` (in every worker)."""

    def __init__(self, at_count: int = 2, hang_s: float = 3600.0) -> None:
        super().__init__(episode_length=100)
        self.at_count, self.hang_s = at_count, hang_s

    def step(self, action):
        if self.count + 1 == self.at_count:
            time.sleep(self.hang_s)
        return super().step(action)


class HangOnResetOnce(CountingEnv):
    """Hangs forever in reset() in the first worker only."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def reset(self, *, seed=None, options=None):
        if _crash_once(self.marker):
            time.sleep(3600)
        return super().reset(seed=seed, options=options)


class HangInInitOnce(CountingEnv):
    def __init__(self, marker: str) -> None:
        if _crash_once(marker):
            time.sleep(3600)
        super().__init__()


class CrashInInitOnce(CountingEnv):
    def __init__(self, marker: str) -> None:
        if _crash_once(marker):
            os._exit(3)
        super().__init__()


class CrashInInitAlways(CountingEnv):
    def __init__(self) -> None:
        os._exit(4)


class WrongObsShape(CountingEnv):
    def step(self, action):
        _obs, *rest = super().step(action)
        return np.zeros(3, dtype=np.float32), *rest


class WrongObsDtype(gym.Env):
    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, shape=(2, 2), dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros((2, 2), dtype=np.uint8), {}

    def step(self, action):
        return np.full((2, 2), 0.5), 0.0, False, False, {}


class UnpicklableInfo(CountingEnv):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.count == 2:
            info["handle"] = threading.Lock()
        return obs, reward, terminated, truncated, info


class Chaotic(CountingEnv):
    """CountingEnv with long episodes, for the chaos soak."""

    def __init__(self) -> None:
        super().__init__(episode_length=37)


class SlowMethod(CountingEnv):
    """Has a method that takes a while, so a test can kill the worker in the middle of call()."""

    def slow_value(self, delay_s: float = 0.5) -> int:
        time.sleep(delay_s)
        return 42


class SleepyEnv(CountingEnv):
    """Each step sleeps ``step_s`` (or ``slow_s``, for a straggler).

    Every step reports when it started and ended (``info["began"]``, ``info["ended"]``) so a
    test can count how many envs were stepping at once.
    """

    def __init__(self, step_s: float = 0.05, slow_s: float | None = None) -> None:
        super().__init__(episode_length=1000)
        self.step_s, self.slow_s = step_s, slow_s

    def step(self, action):
        began = time.time()
        time.sleep(self.slow_s if self.slow_s is not None else self.step_s)
        obs, reward, terminated, truncated, info = super().step(action)
        info.update(began=began, ended=time.time())
        return obs, reward, terminated, truncated, info


class TextObsEnv(gym.Env):
    """A Text observation space: not fixed-shape, so it goes through pickling, not shared memory."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Text(max_length=8)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return "a", {}

    def step(self, action):
        self.t += 1
        return "ab"[action] * (self.t % 8 + 1), 1.0, self.t >= 5, False, {}


class _KillOnPickle:
    """SIGKILLs the process that pickles it: the worker, while it encodes a reply."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


class KilledAfterItsDoneRecord(CountingEnv):
    """On step ``at_count`` of the first worker there (marker file), the info cannot be sent:
    the worker has written its DONE record (a reply follows) and dies encoding the reply."""

    def __init__(self, marker: str, at_count: int = 3) -> None:
        super().__init__(episode_length=10)
        self.marker, self.at_count = marker, at_count

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.count == self.at_count and _crash_once(self.marker):
            info["bomb"] = _KillOnPickle()
        return obs, reward, terminated, truncated, info


class StatefulCartPole(CartPoleEnv):
    """CartPole with the planning convention: ``get_state()`` / ``set_state(state)``.

    Truncates at 500 steps by itself (no TimeLimit wrapper), so its state is complete.
    """

    def __init__(self) -> None:
        super().__init__()
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, _, info = super().step(action)
        self.t += 1
        return obs, reward, terminated, self.t >= 500, info

    def get_state(self):
        return np.array(self.state, dtype=np.float64), self.steps_beyond_terminated, self.t

    def set_state(self, state):
        physics, steps_beyond, t = state
        self.state = np.array(physics, dtype=np.float64)
        self.steps_beyond_terminated, self.t = steps_beyond, t


class ArrayStateCartPole(StatefulCartPole):
    """Its state is one numpy array, as plangym's envs pass states around."""

    def get_state(self):
        steps_beyond = -1 if self.steps_beyond_terminated is None else self.steps_beyond_terminated
        return np.array([*self.state, steps_beyond, self.t], dtype=np.float64)

    def set_state(self, state):
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (6,):
            raise ValueError(f"a state is 6 numbers, got shape {state.shape}")
        self.state = state[:4].copy()
        self.steps_beyond_terminated = None if state[4] < 0 else int(state[4])
        self.t = int(state[5])


class ThreadProbe(CountingEnv):
    """Reports what its worker process sees: thread variables, loaded pools, CPUs."""

    def thread_variables(self):
        import os

        names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        return {name: os.environ.get(name) for name in names}

    def pool_threads(self):
        import threadpoolctl

        return {info["user_api"]: info["num_threads"] for info in threadpoolctl.threadpool_info()}

    def cpus(self):
        import os

        return sorted(os.sched_getaffinity(0))


class FixedLengthEnv(CountingEnv):
    """Episodes of exactly ``length`` steps, reward 1 per step."""

    def __init__(self, length: int) -> None:
        super().__init__(episode_length=length)

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, 1.0, terminated, truncated, info


class NoisyFixedLengthEnv(FixedLengthEnv):
    """``FixedLengthEnv`` whose observation adds a draw from ``np_random`` on every call."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.observation_space = gym.spaces.Box(0, 1000, shape=(2,), dtype=np.float32)

    def _obs(self) -> np.ndarray:
        return np.array([self.count, self.np_random.random()], dtype=np.float32)


class OldApiEnv:
    """A pre-0.26 Gym env, without gym: ``reset()`` -> obs, ``step`` -> 4-tuple, ``seed()``.

    The observation is [count, seed]. Action 2 ends the episode (a termination); otherwise
    the 4th step ends it with ``info["TimeLimit.truncated"] = True``.
    """

    metadata = {"render.modes": []}  # noqa: RUF012 - as old Gym envs declared it

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 1000, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(3)
        self.count, self.seed_value = 0, -1

    def seed(self, seed=None):
        self.seed_value = -1 if seed is None else seed
        return [seed]

    def reset(self):
        self.count = 0
        return self._obs()

    def step(self, action):
        self.count += 1
        if action == 2:
            return self._obs(), 10.0, True, {}
        if self.count >= 4:
            return self._obs(), 1.0, True, {"TimeLimit.truncated": True}
        return self._obs(), 1.0, False, {"count": self.count}

    def close(self):
        pass

    def _obs(self):
        return np.array([self.count, self.seed_value], dtype=np.float32)


class FixedLengthCrashOnce(FixedLengthEnv):
    """A FixedLengthEnv that segfaults on step ``at_count`` of the first worker there."""

    def __init__(self, length: int, marker: str, at_count: int) -> None:
        super().__init__(length)
        self.marker, self.at_count = marker, at_count

    def step(self, action):
        if self.count + 1 == self.at_count and _crash_once(self.marker):
            segfault()
        return super().step(action)


class OptionsEcho(CountingEnv):
    """Its reset info's "a" is ``options["a"]`` (-1 without options)."""

    def reset(self, *, seed=None, options=None):
        obs, _ = super().reset(seed=seed)
        return obs, {"a": -1 if options is None else options.get("a", -1)}


class RaiseOnReset(CountingEnv):
    """Raises ValueError in every reset after the first ``ok`` ones."""

    def __init__(self, ok: int = 0) -> None:
        super().__init__()
        self.ok = ok

    def reset(self, *, seed=None, options=None):
        if self.ok <= 0:
            raise ValueError("reset boom")
        self.ok -= 1
        return super().reset(seed=seed, options=options)


class WideObsEnv(CountingEnv):
    """A CountingEnv whose observation bounds are wider: same shape, another space."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Box(0, 2000, shape=(1,), dtype=np.float32)


class FrameEnv(CountingEnv):
    """A CountingEnv whose observation is a small RGB frame filled with the step count."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Box(0, 255, shape=(32, 32, 3), dtype=np.uint8)

    def _obs(self) -> np.ndarray:
        return np.full((32, 32, 3), self.count, dtype=np.uint8)


class SequenceObsEnv(CountingEnv):
    """A Sequence observation space: dynamic shape, which no shared memory can hold."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Sequence(gym.spaces.Discrete(4))

    def _obs(self):
        return (1,) * self.count


class DictActionEnv(CountingEnv):
    """Dict actions: {"a": Discrete(3), "b": Box(-1, 1, (2,))}; the reward is a + b[0]."""

    def __init__(self) -> None:
        super().__init__(episode_length=7)
        self.action_space = gym.spaces.Dict(
            {"a": gym.spaces.Discrete(3), "b": gym.spaces.Box(-1, 1, shape=(2,), dtype=np.float32)}
        )

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(1)
        return obs, float(action["a"]) + float(action["b"][0]), terminated, truncated, info


class TupleActionEnv(CountingEnv):
    """Tuple actions: (Discrete(3), Box(-1, 1, (2,))); the reward is a + b[0]."""

    def __init__(self) -> None:
        super().__init__(episode_length=7)
        self.action_space = gym.spaces.Tuple(
            (gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, shape=(2,), dtype=np.float32))
        )

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(1)
        return obs, float(action[0]) + float(action[1][0]), terminated, truncated, info


class LeakyEnv(CountingEnv):
    """Keeps ``mb_per_step`` MiB more (touched, so resident) on every step, like a leaking sim."""

    def __init__(self, mb_per_step: float = 2.0, episode_length: int = 5) -> None:
        super().__init__(episode_length=episode_length)
        self.mb_per_step = mb_per_step
        self.leaked: list[np.ndarray] = []

    def step(self, action):
        self.leaked.append(np.ones(int(self.mb_per_step * 2**20), dtype=np.uint8))
        return super().step(action)


class ChattyReset(CountingEnv):
    """Writes a line with its seed to its stderr at each reset."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        sys.stderr.write(f"chatty {seed} says hello\n")
        sys.stderr.flush()
        return super().reset(seed=seed, options=options)


class EnvironEcho(CountingEnv):
    """Reads its worker's environment variables (``call("getenv", name)``)."""

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def affinity(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))


class FragmentingEnv(CountingEnv):
    """Each reset allocates 32 MiB in 4 KiB arrays and keeps one in 32, like a sim's loader.

    The arrays come from malloc's heap, and the ones kept pin it: the freed 31 MiB stay
    there, resident, until the allocator is asked to give free pages back.
    """

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        chunks = [np.ones(512) for _ in range(8192)]
        self.kept = chunks[::32]
        return super().reset(seed=seed, options=options)


class ActionTypeEcho(BoxActionEnv):
    """Says in its info the type and dtype of the action it was given."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"dtype": str(np.asarray(action).dtype)}


class VaryingInfoEnv(CountingEnv):
    """Infos of many shapes, by step: plain numbers of each kind, none, and unplain values."""

    INFOS: ClassVar[list[Any]] = [
        lambda t: {"x": float(t), "n": t, "ok": t % 2 == 0},  # Python float, int, bool
        lambda t: {"x": np.float32(t / 3), "n": np.int32(-t), "u": np.uint8(t)},
        lambda t: {},
        lambda t: {"x": np.float64(t), "flag": np.bool_(t % 2)},  # np.bool_: an object array
        lambda t: {"nested": {"a": t}, "x": 1.5},
        lambda t: {"n": np.int64(t), "x": np.float16(t)},
        lambda t: {"vec": np.arange(3) + t},
        lambda t: {"name": f"step {t}", "n": t},
        lambda t: {f"k{i}": float(i + t) for i in range(20)},  # more keys than a row holds
        lambda t: {"x": float(t), "n": t, "ok": True},
    ]

    def __init__(self, episode_length: int = 7, shift: int = 0) -> None:
        super().__init__(episode_length)
        self.shift = shift

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {"reset_n": 1, "x": -1.0}

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        t = self.count + self.shift + (int(self.np_random.integers(3)) if action else 0)
        return obs, reward, terminated, truncated, self.INFOS[t % len(self.INFOS)](t)


class PidInfoEnv(CountingEnv):
    """Each step's info names its worker process: ``{"pid_<pid>": pid}``."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        pid = os.getpid()
        return obs, reward, terminated, truncated, {f"pid_{pid}": pid, "count": self.count}


class BigFrameEnv(CountingEnv):
    """A CountingEnv with Atari-sized frames, a fresh 100 KB copy at every step, as ale-py gives."""

    def __init__(self) -> None:
        super().__init__(episode_length=500)
        self.observation_space = gym.spaces.Box(0, 255, shape=(210, 160, 3), dtype=np.uint8)
        self.frame = np.zeros((210, 160, 3), dtype=np.uint8)

    def _obs(self) -> np.ndarray:
        self.frame[self.count % 210] = self.count % 256
        return self.frame.copy()


class SegfaultOnceFrameEnv(BigFrameEnv):
    """A BigFrameEnv that segfaults on step ``at_count`` once, as SegfaultOnceOnStep does.

    Its worker mates have written their frames of that step (one by one, as large
    observations are) when it dies.
    """

    def __init__(self, marker: str, at_count: int = 3) -> None:
        super().__init__()
        self.marker, self.at_count = marker, at_count

    def step(self, action):
        if self.count + 1 == self.at_count and _crash_once(self.marker):
            segfault()
        return super().step(action)


class IncarnationEnv(gym.Env):
    """``obs = [t, total, incarnation]``: the step in the episode, the steps this instance took,
    and a random id drawn when the instance is built, so a result from a dead worker shows.

    ``step_sleep_s`` (``reset_sleep_s``) makes a step (a reset) last long enough for a kill
    to land in it. The markers are
    files armed by their absence (``_crash_once`` creates them as it fires): ``marker`` makes
    the next reset segfault, ``raise_marker`` the next step raise, ``reset_raise_marker``
    the next reset raise.
    """

    def __init__(
        self,
        episode_length: int = 1000,
        step_sleep_s: float = 0.0,
        marker: str | None = None,
        raise_marker: str | None = None,
        reset_raise_marker: str | None = None,
        reset_sleep_s: float = 0.0,
    ) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
        self.reset_sleep_s = reset_sleep_s
        self.action_space = gym.spaces.Discrete(2)
        self.episode_length = episode_length
        self.step_sleep_s = step_sleep_s
        self.marker, self.raise_marker = marker, raise_marker
        self.reset_raise_marker = reset_raise_marker
        self.incarnation = float(int.from_bytes(os.urandom(3), "little") + 1)
        self.t = self.total = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.reset_sleep_s:
            time.sleep(self.reset_sleep_s)
        if self.marker is not None and _crash_once(self.marker):
            segfault()
        if self.reset_raise_marker is not None and _crash_once(self.reset_raise_marker):
            raise ValueError("reset raised on request")
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        if self.raise_marker is not None and _crash_once(self.raise_marker):
            raise ValueError("step raised on request")
        self.t += 1
        self.total += 1
        return self._obs(), float(action) + 1.0, self.t >= self.episode_length, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.total, self.incarnation], dtype=np.float64)


class BusyEnv(CountingEnv):
    """Each step computes for ``step_s`` seconds of the CPU (no sleep): an env that computes."""

    def __init__(self, step_s: float = 0.002) -> None:
        super().__init__(episode_length=1000)
        self.step_s = step_s

    def step(self, action):
        until = time.process_time() + self.step_s
        while time.process_time() < until:
            pass
        return super().step(action)


class WaitingEnv(CountingEnv):
    """A ``CountingEnv`` whose steps and resets sleep ``wait_s`` first (I/O, a remote simulator).

    Its info says whether a thread other than the worker's main one stepped it
    (``info["on_thread"]``) and when the step began and ended. ``fail_at``: the step count
    whose step raises; ``hang_at``: the step count whose step sleeps for an hour (both in
    every worker).
    """

    def __init__(
        self,
        episode_length: int = 3,
        wait_s: float = 0.004,
        fail_at: int | None = None,
        hang_at: int | None = None,
    ) -> None:
        super().__init__(episode_length=episode_length)
        self.wait_s, self.fail_at, self.hang_at = wait_s, fail_at, hang_at
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        time.sleep(self.wait_s)
        return super().reset(seed=seed, options=options)

    def step(self, action):
        began = time.time()
        self.steps += 1
        time.sleep(3600.0 if self.steps == self.hang_at else self.wait_s)
        if self.steps == self.fail_at:
            raise ValueError(f"boom at step {self.steps}")
        obs, reward, terminated, truncated, info = super().step(action)
        on_thread = threading.current_thread() is not threading.main_thread()
        info.update(on_thread=on_thread, began=began, ended=time.time())
        return obs, reward, terminated, truncated, info
