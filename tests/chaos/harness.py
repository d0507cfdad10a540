"""Chaos harness for multienv: inject faults while checking every returned step.

One run = one MultiEnv configuration for --seconds; exit 0 only if no invariant broke.

    nice -n 19 python harness.py --mode NextStep --k 3 --n 7 --seconds 60 [--spin] [--seed S]

What it checks (see README.md): per env, each result against the env's own counters
(obs = [t, env_id, total, incarnation, L], reward = action + 1), flags of crash truncations,
EnvError naming the env that raised, no hang (watchdog dumps every thread's stack, then
exits 3), close() time, no worker left, fds and threads back to the baseline.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import functools
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos_env import (
    CODES,
    EXIT,
    HANG,
    NONE,
    RAISE,
    SEGV,
    SLOW,
    CounterEnv,
    executed_col,
    open_control,
)

from multienv import EnvError, MultiEnv, RestartPolicy
from multienv.errors import EnvStateError, WaitTimeoutError

NEXT, SAME, DIS = "NextStep", "SameStep", "Disabled"
OP_WATCHDOG_S = 90.0  # one op (a call, or a send/recv burst's one call) longer than this: a hang


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------- watchdog
class Watchdog:
    """Arm before each call; on expiry dump all threads + worker states, then _exit(3)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.deadline = None
        self.what = ""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="watchdog")
        self.thread.start()

    def arm(self, what: str, seconds: float = OP_WATCHDOG_S) -> None:
        with self.lock:
            self.deadline = time.monotonic() + seconds
            self.what = what
        faulthandler.dump_traceback_later(seconds + 20, exit=True)  # backstop, C level

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                late = self.deadline is not None and time.monotonic() > self.deadline
                what = self.what
            if late:
                log(f"HANG [{self.tag}] {what}: no return after {OP_WATCHDOG_S} s; stacks:")
                faulthandler.dump_traceback(sys.stdout, all_threads=True)
                sys.stdout.flush()
                for p in my_descendants():
                    try:
                        log(
                            f"  child {p.pid} {p.name()} status={p.status()} "
                            f"wchan={open(f'/proc/{p.pid}/wchan').read()}"
                        )
                    except Exception:  # noqa: BLE001, S110 - a child gone meanwhile
                        pass
                os._exit(3)


def my_descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def worker_procs() -> list[psutil.Process]:
    out = []
    for p in my_descendants():
        try:
            if p.name().startswith("multienv-w"):
                out.append(p)
        except psutil.Error:
            pass
    return out


# ---------------------------------------------------------------------------- the harness
class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.mode, self.k, self.n = args.mode, args.k, args.n
        self.rng = np.random.default_rng(args.seed)
        self.pyrng = random.Random(args.seed)
        self.num_workers = -(-self.n // self.k)
        self.ctl_path = f"/dev/shm/chaos-ctl-{os.getpid()}.bin"
        self.ctl = open_control(self.ctl_path, self.n, create=True)
        self.tag = (
            f"{self.mode} k={self.k} n={self.n}{' spin' if args.spin else ''}"
            f"{f' wait={args.wait_s}' if args.wait_s else ''} seed={args.seed}"
        )
        # model, per env
        self.last = np.zeros((self.n, 5))
        self.ended = np.zeros(self.n, bool)
        self.crashed = np.zeros(self.n, bool)  # last result a crash truncation (NEXT/DIS)
        self.in_flight = np.zeros(self.n, bool)
        self.sent_action = np.zeros(self.n, np.int64)
        self.executed_seen = np.zeros((self.n, 16), np.int64)
        self.pending_raises: collections.Counter[int] = collections.Counter()
        # counts
        self.c = collections.Counter()
        self.causes = collections.Counter()
        self.violations: list[str] = []
        self.vkinds = collections.Counter()
        self.deaths_definite = np.zeros(self.num_workers, np.int64)
        self.deaths_maybe = np.zeros(self.num_workers, np.int64)
        self.op = 0
        self.opname = ""
        self.envs: MultiEnv | None = None
        self.bg_stop = threading.Event()
        self.kill_lock = threading.Lock()
        self.watchdog = Watchdog(self.tag)
        self.quiet = False  # no new faults (the final steps)
        self.op_had_env_error = False
        self.timers: list[threading.Timer] = []
        self.trace: collections.deque[str] = collections.deque(maxlen=200)
        self.t_start = time.monotonic()

    # ------------------------------------------------------------------ recording
    def ev(self, what: str) -> None:
        self.trace.append(f"{time.monotonic() - self.t_start:8.3f} op#{self.op} {what}")

    def V(self, kind: str, detail: str) -> None:
        self.vkinds[kind] += 1
        msg = f"VIOLATION {kind} op#{self.op} {self.opname}: {detail}"
        self.violations.append(msg)
        if self.vkinds[kind] <= 5:
            log(msg)
            if self.vkinds[kind] <= 2:
                log("  recent events:\n    " + "\n    ".join(list(self.trace)[-25:]))

    def worker_of(self, j: int) -> int:
        return j // self.k

    def mates(self, j: int) -> range:
        w = self.worker_of(j)
        return range(w * self.k, min(self.n, (w + 1) * self.k))

    # ------------------------------------------------------------------ faults from outside
    def pid_of(self, j: int) -> int | None:
        assert self.envs is not None
        try:
            pid = self.envs.envs[j].pid
        except Exception:  # noqa: BLE001
            return None
        if not pid:
            return None
        try:
            p = psutil.Process(pid)
            if not p.name().startswith("multienv-w") or p.status() == psutil.STATUS_ZOMBIE:
                return None
            if p.ppid() == 1:
                return None
        except psutil.Error:
            return None
        return pid

    def signal_worker(self, j: int, kind: str, source: str) -> bool:
        """kind: kill, stop_short, stop_long. Returns True if delivered to a live worker."""
        with self.kill_lock:
            pid = self.pid_of(j)
            if pid is None:
                return False
            w = self.worker_of(j)
            try:
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                    self.deaths_definite[w] += 1
                elif kind == "stop_short":
                    os.kill(pid, signal.SIGSTOP)
                    tm = threading.Timer(self.pyrng.uniform(0.02, 0.4), _cont, (pid,))
                    tm.start()
                    self.timers.append(tm)
                else:  # stop_long: a hang past step_timeout if stepped; CONT later if not
                    os.kill(pid, signal.SIGSTOP)
                    self.deaths_maybe[w] += 1
                    later = 3 * self.a.step_timeout * self.k + 2
                    tm = threading.Timer(later, _cont, (pid,))
                    tm.start()
                    self.timers.append(tm)
            except ProcessLookupError:
                return False
            self.c[f"{source}:{kind}"] += 1
            self.ev(f"SIGNAL {kind} worker {w} (env {j}, pid {pid}) from {source}")
            return True

    def background(self) -> None:
        """Faults at random moments, whatever the main thread is doing."""
        while not self.bg_stop.wait(float(self.pyrng.expovariate(1 / self.a.bg_every_s))):
            j = self.pyrng.randrange(self.n)
            kind = self.pyrng.choices(["kill", "stop_short", "stop_long"], [6, 3, 1])[0]
            self.signal_worker(j, kind, "bg")
            if self.pyrng.random() < 0.15:  # two at once
                self.signal_worker(self.pyrng.randrange(self.n), "kill", "bg2")

    def timer_fault(self) -> threading.Timer | None:
        """A fault a few ms into the call about to be made (during reset/step/recv)."""
        if self.quiet:
            return None
        j = self.pyrng.randrange(self.n)
        kind = self.pyrng.choices(["kill", "stop_short"], [7, 3])[0]
        t = threading.Timer(self.pyrng.uniform(0.0, 0.03), self.signal_worker, (j, kind, "timer"))
        t.start()
        return t

    # ------------------------------------------------------------------ faults from inside
    def command(self, j: int, phase: int, code: int) -> None:
        if self.ctl[j, phase] == NONE:
            self.ctl[j, phase] = code
            self.ev(f"COMMAND env {j} {'step' if phase == 0 else 'reset'}:{CODES[code]}")
            self.c[f"cmd:{'step' if phase == 0 else 'reset'}:{CODES[code]}"] += 1

    def random_commands(self, for_reset: bool, envs_pool: list[int] | None = None) -> None:
        if self.quiet:
            return
        pool = envs_pool if envs_pool is not None else list(range(self.n))
        if not pool:
            return
        count = 2 if self.pyrng.random() < 0.2 else 1
        for j in self.pyrng.sample(pool, min(count, len(pool))):
            if for_reset:
                code = self.pyrng.choices([RAISE, EXIT, SEGV, HANG], [35, 25, 25, 8])[0]
                self.command(j, 1, code)
            else:
                if self.mode != DIS and self.pyrng.random() < 0.15:
                    # a fault in the autoreset's reset, inside a step
                    choices = [EXIT, SEGV] + ([RAISE] if self.mode == NEXT else [])
                    self.command(j, 1, self.pyrng.choice(choices))
                else:
                    code = self.pyrng.choices([RAISE, EXIT, SEGV, HANG, SLOW], [30, 20, 20, 3, 27])[
                        0
                    ]
                    self.command(j, 0, code)

    def clear_commands(self, only_reset_raise: bool) -> None:
        for j in range(self.n):
            if only_reset_raise:
                if self.ctl[j, 1] == RAISE:
                    self.ctl[j, 1] = NONE
            else:
                self.ctl[j, 0] = NONE
                self.ctl[j, 1] = NONE

    def note_executed(self) -> None:
        """Read which in-env faults ran since the last look."""
        now = np.array(self.ctl)
        diff = now - self.executed_seen
        self.executed_seen = now
        for j in range(self.n):
            for phase in (0, 1):
                for code in (RAISE, EXIT, SEGV, HANG, SLOW):
                    d = int(diff[j, executed_col(phase, code)])
                    if d <= 0:
                        continue
                    self.c[f"ran:{'step' if phase == 0 else 'reset'}:{CODES[code]}"] += d
                    if code == RAISE:
                        self.pending_raises[j] += d
                    elif code in (EXIT, SEGV, HANG):
                        self.deaths_definite[self.worker_of(j)] += d

    # ------------------------------------------------------------------ checks
    @staticmethod
    def flag_of(infos: dict, row: int) -> tuple[bool, object]:
        m = infos.get("multienv")
        if not isinstance(m, dict):
            return False, None
        r = m.get("_restarted")
        if r is None or not bool(r[row]):
            return False, None
        cause = m.get("cause")
        return True, (cause[row] if cause is not None else None)

    def check_step(self, j: int, obs, rew, term, trunc, infos: dict, row: int, action) -> None:
        obs = np.asarray(obs, dtype=np.float64)
        rew, term, trunc = float(rew), bool(term), bool(trunc)
        p = self.last[j].copy()
        ctx = f"env {j} prev={p.tolist()} got obs={obs.tolist()} r={rew} term={term} trunc={trunc}"
        flagged, cause = self.flag_of(infos, row)
        final = None
        if self.mode == SAME and (term or trunc):
            fo, fm = infos.get("final_obs"), infos.get("_final_obs")
            if fo is not None and fm is not None and bool(fm[row]):
                final = np.asarray(fo[row], dtype=np.float64)
        if int(obs[1]) != j:
            self.V("wrong-env-obs", ctx)
        self.c["results"] += 1
        if flagged:
            self.c["flags"] += 1
            if self.pending_raises[j] > 0:  # the env raised, then its worker died: the death wins
                self.pending_raises[j] = 0
                self.c["raise-superseded-by-death"] += 1
            self.causes[str(cause)] += 1
            if not trunc or term:
                self.V("flag-not-truncation", ctx)
            if rew != 0.0:
                self.V("flag-reward-nonzero", ctx)
            if not cause:
                self.V("flag-without-cause", ctx)
            if self.mode == SAME:
                if final is None or not np.array_equal(final, p):
                    self.V(
                        "crash-final-obs-not-last-seen",
                        f"{ctx} final={None if final is None else final.tolist()}",
                    )
                if obs[0] != 0 or obs[2] != 0:
                    self.V("crash-obs-not-fresh-reset", ctx)
                if obs[3] == p[3]:
                    self.V("flag-without-respawn", ctx)
                self.last[j] = obs
                self.ended[j] = False
                self.crashed[j] = False
            else:
                if not np.array_equal(obs, p):
                    self.V("crash-obs-not-last-seen", ctx)
                self.last[j] = obs
                self.ended[j] = True
                self.crashed[j] = True
            return
        if self.mode == NEXT and self.ended[j]:  # the autoreset step
            self.c["autoresets"] += 1
            if obs[0] != 0:
                self.V("stepped-past-end-no-autoreset", ctx)
            if rew != 0.0 or term or trunc:
                self.V("autoreset-result-not-neutral", ctx)
            self.check_reset_counts(j, obs, p, ctx, allow_new=True)
            self.last[j] = obs
            self.ended[j] = False
            self.crashed[j] = False
            return
        if self.mode == DIS and self.ended[j]:
            self.V("stepped-ended-env-disabled", ctx)
        if obs[3] != p[3]:
            self.superseded(j)
            self.V("unflagged-respawn (episode spliced)", ctx)
            self.last[j] = obs
            self.ended[j] = (term or trunc) and self.mode != SAME
            self.crashed[j] = False
            return
        if self.crashed[j]:
            self.V("flag-without-respawn", ctx)
        src = obs
        if self.mode == SAME and (term or trunc):
            if final is None:
                self.V("same-step-end-without-final-obs", ctx)
                src = None
            else:
                src = final
                ctx += f" final={final.tolist()}"
        if src is not None:
            if src[0] != p[0] + 1:
                kind = "splice-unflagged-restart" if src[0] == 0 else "t-not-incremented"
                self.V(kind, ctx)
            d = src[2] - p[2]
            if d != 1:
                kind = (
                    "lost-step" if d > 1 else ("duplicate-result" if d == 0 else "total-backwards")
                )
                self.V(kind, ctx)
            if src[4] != p[4]:
                self.V("episode-length-changed (splice)", ctx)
            if rew != float(action) + 1:
                self.V("reward-not-from-sent-action", f"{ctx} action={action}")
            ends = src[0] >= src[4]
            want_term, want_trunc = ends and src[4] % 2 == 0, ends and src[4] % 2 == 1
            if term != want_term or trunc != want_trunc:
                self.V("end-flags-wrong", ctx)
            if self.mode == SAME and (term or trunc):
                if obs[0] != 0 or obs[2] != src[2] or obs[3] != src[3]:
                    self.V("same-step-reset-obs-wrong", ctx)
        self.last[j] = obs
        self.ended[j] = (term or trunc) and self.mode != SAME
        self.crashed[j] = False

    def superseded(self, j: int) -> None:
        """A new instance of env j: a death came after a raise that ran, and wins."""
        if self.pending_raises[j] > 0:
            self.pending_raises[j] = 0
            self.c["raise-superseded-by-death"] += 1

    def check_reset_counts(self, j, obs, p, ctx, allow_new: bool) -> None:
        if obs[3] != p[3]:
            self.superseded(j)
        if obs[0] != 0:
            self.V("reset-obs-t-nonzero", ctx)
        if obs[3] == p[3]:
            if self.crashed[j]:
                self.V("flag-without-respawn", ctx)
            if obs[2] != p[2]:
                self.V("reset-changed-total (a step lost or run in reset)", ctx)
        else:
            if obs[2] != 0:
                self.V("fresh-env-total-nonzero", ctx)
            if not self.crashed[j]:
                self.c["silent-respawn-at-reset"] += 1

    def check_reset(self, obs_batch, infos, mask: np.ndarray) -> None:
        for j in range(self.n):
            obs = np.asarray(obs_batch[j], dtype=np.float64)
            p = self.last[j].copy()
            ctx = f"env {j} prev={p.tolist()} got obs={obs.tolist()} mask={mask[j]}"
            if int(obs[1]) != j:
                self.V("wrong-env-obs", ctx)
            if mask[j]:
                self.c["reset-results"] += 1
                self.check_reset_counts(j, obs, p, ctx, allow_new=True)
                self.last[j] = obs
                self.ended[j] = False
                self.crashed[j] = False
            elif not np.array_equal(obs, p):
                self.V("unmasked-env-obs-changed-by-reset", ctx)

    def check_phase(self, exc: BaseException, call_kind: str) -> None:
        """An env error must come from the call it is raised by: in Disabled mode a step
        never resets, and a reset never steps."""
        msg = str(exc)
        late = ("raises in reset" in msg and call_kind == "step" and self.mode == DIS) or (
            "raises in step" in msg and call_kind == "reset"
        )
        if late:
            self.V(
                "error-of-an-earlier-call-raised-by-a-later-one (reply desync)",
                f"{call_kind} call raised: {msg[:160]}",
            )

    def settle_raises(self, failed: list[int]) -> None:
        self.op_had_env_error = True
        for j in failed:
            if self.pending_raises[j] > 0:
                self.pending_raises[j] -= 1
            else:
                self.V(
                    "EnvError-for-env-that-did-not-raise",
                    f"env {j}; pending {dict(self.pending_raises)}",
                )
        self.c["EnvError"] += len(failed)

    def quiescent_checks(self) -> None:
        left = {j: c for j, c in self.pending_raises.items() if c > 0}
        if left:
            if self.op_had_env_error:  # raise_first: the others are only logged
                self.V(
                    "second-env-error-only-logged (env left flight, no EnvError names it)",
                    f"envs {left} raised in an op whose EnvError named another env",
                )
            else:
                self.V("env-raise-swallowed (no EnvError)", f"envs {left}")
            self.pending_raises.clear()
        self.op_had_env_error = False

    # ------------------------------------------------------------------ ops
    def actions(self, m: int) -> np.ndarray:
        return self.rng.integers(0, 1000, m, dtype=np.int64)

    def ensure_steppable(self) -> None:
        """Disabled autoreset: reset the ended envs first (the caller's job)."""
        if self.mode == DIS and self.ended.any():
            self.do_reset(self.ended.copy(), why="disabled-ended")

    def call(self, what: str, fn, *args, _wd: float = OP_WATCHDOG_S, **kwargs):
        self.watchdog.arm(f"op#{self.op} {what}", _wd)
        self.ev(f"call {what} {_short(args)}")
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            self.ev(f"  -> raised {type(exc).__name__}: {str(exc)[:120]}")
            raise
        finally:
            self.watchdog.disarm()
        if isinstance(out, tuple) and len(out) == 5 and isinstance(out[4], dict):
            ids = out[4].get("env_id")
            m = out[4].get("multienv")
            fl = (
                None
                if not isinstance(m, dict) or "_restarted" not in m
                else np.flatnonzero(m["_restarted"]).tolist()
            )
            self.ev(
                f"  -> ids={None if ids is None else ids.tolist()} t={np.asarray(out[0])[:, 0].tolist()} "
                f"flags(rows)={fl} term={np.flatnonzero(out[2]).tolist()} trunc={np.flatnonzero(out[3]).tolist()}"
            )
        return out

    def process_step_batch(self, out, acts, failed=()) -> None:
        obs, rew, term, trunc, infos = out
        for j in range(self.n):
            if j in failed:
                p = self.last[j]
                if not np.array_equal(np.asarray(obs[j]), p) or rew[j] != 0 or term[j] or trunc[j]:
                    self.V(
                        "failed-env-entry-not-as-documented",
                        f"env {j} prev={p.tolist()} entry={np.asarray(obs[j]).tolist()} r={rew[j]} {term[j]} {trunc[j]}",
                    )
                continue
            self.check_step(j, obs[j], rew[j], term[j], trunc[j], infos, j, acts[j])
        self.after_result_faults(infos, range(self.n))

    def after_result_faults(self, infos, ids) -> None:
        """Right after a respawn: fault the fresh worker again, now and then."""
        m = infos.get("multienv")
        if not isinstance(m, dict) or "_restarted" not in m:
            return
        for row, j in enumerate(ids):
            if bool(m["_restarted"][row]) and not self.quiet and self.pyrng.random() < 0.25:
                if self.pyrng.random() < 0.5:
                    self.signal_worker(int(j), "kill", "after-respawn")
                else:
                    self.command(int(j), 0, self.pyrng.choice([RAISE, EXIT, SEGV]))
                    self.c["after-respawn:cmd"] += 1

    def op_step(self, use_list: bool = False) -> None:
        self.ensure_steppable()
        acts = self.actions(self.n)
        timer = self.timer_fault() if self.pyrng.random() < 0.12 else None
        try:
            out = self.call("step", self.envs.step, acts.tolist() if use_list else acts)
        except EnvError as e:
            self.note_executed()
            self.check_phase(e, "step")
            failed = sorted(e.failed_env_ids or [e.env_index])
            self.settle_raises(failed)
            if e.results is None:
                self.V("step-EnvError-without-results", repr(e))
                return
            self.process_step_batch(e.results, acts, failed)
        else:
            self.note_executed()
            self.process_step_batch(out, acts)
        finally:
            if timer is not None:
                timer.join()

    def op_async(self) -> None:
        self.ensure_steppable()
        acts = self.actions(self.n)
        self.call("step_async", self.envs.step_async, acts)
        if self.pyrng.random() < 0.15:
            self.signal_worker(self.pyrng.randrange(self.n), "kill", "in-async")
        began = time.monotonic()
        while True:
            timeout = self.pyrng.choice([None, 0.0, 0.002, 0.05, 0.5])
            try:
                out = self.call("step_wait", self.envs.step_wait, timeout)
                break
            except WaitTimeoutError:
                self.c["step_wait-timeouts"] += 1
                if time.monotonic() - began > OP_WATCHDOG_S:
                    self.V(
                        "step_wait-never-done", f"{OP_WATCHDOG_S} s of step_wait(timeout) retries"
                    )
                    out = self.call("step_wait", self.envs.step_wait, None)
                    break
            except EnvError as e:
                self.note_executed()
                self.check_phase(e, "step")
                failed = sorted(e.failed_env_ids or [e.env_index])
                self.settle_raises(failed)
                if self.envs._pending is not None:  # finding: the step stays pending
                    self.V(
                        "step_wait-EnvError-leaves-step-pending (later calls: PendingCallError)",
                        f"envs._pending={self.envs._pending!r}; cleared by the harness to go on",
                    )
                    self.envs._pending = None
                if e.results is None:
                    self.V("step_wait-EnvError-without-results", repr(e))
                    return
                self.process_step_batch(e.results, acts, failed)
                return
        self.note_executed()
        self.process_step_batch(out, acts)

    def do_reset(self, mask: np.ndarray | None, why: str, seed=None, use_async=False) -> None:
        full = mask is None
        m = np.ones(self.n, bool) if full else mask
        if self.pyrng.random() < 0.25:
            self.random_commands(for_reset=True, envs_pool=[int(j) for j in np.flatnonzero(m)])
        timer = self.timer_fault() if self.pyrng.random() < 0.2 else None
        options = None if full else {"reset_mask": m.copy()}
        for _attempt in range(6):
            try:
                if use_async:
                    self.call("reset_async", self.envs.reset_async, seed=seed, options=options)
                    while True:
                        try:
                            out = self.call(
                                "reset_wait",
                                self.envs.reset_wait,
                                self.pyrng.choice([None, 0.0, 0.01, 0.2]),
                            )
                            break
                        except WaitTimeoutError:
                            self.c["reset_wait-timeouts"] += 1
                else:
                    out = self.call(
                        f"reset({why})",
                        self.envs.reset,
                        seed=seed,
                        options=None if options is None else dict(options),
                    )
            except EnvError as e:
                self.note_executed()
                self.check_phase(e, "reset")
                # A reset's EnvError names every env that raised (failed_env_ids).
                self.settle_raises(sorted(e.failed_env_ids or [e.env_index]))
                self.c["reset-retries"] += 1
                if self.envs._pending_reset is not None:  # finding: the reset stays pending
                    self.V(
                        "reset_wait-EnvError-leaves-reset-pending (later calls: PendingCallError)",
                        "cleared by the harness to go on",
                    )
                    self.envs._pending_reset = None
                self.clear_commands(only_reset_raise=True)
                # which envs were reset is unknown: the retry resets them all again
                continue
            else:
                break
        else:
            self.V("reset-never-succeeded", "6 attempts")
            return
        if timer is not None:
            timer.join()
        self.note_executed()
        obs, infos = out
        self.check_reset(obs, infos, m)

    def op_reset(self) -> None:
        r = self.pyrng.random()
        if r < 0.15:
            self.do_reset(None, "full-seeded", seed=self.pyrng.randrange(10**6))
            return
        mask = self.rng.random(self.n) < 0.4
        if self.mode == DIS:
            mask |= self.ended
        if not mask.any():
            mask[self.pyrng.randrange(self.n)] = True
        self.do_reset(mask, "masked", use_async=r > 0.85)

    def op_call(self) -> None:
        r = self.pyrng.random()
        if r < 0.4:
            # one call for both: a respawn between two calls would mix two instances
            pairs = self.call("call(state)", self.envs.call, "state")
            incs = [p[0] for p in pairs]
            totals = [p[1] for p in pairs]
            # a replay on a fresh worker shows a new incarnation: then nothing to compare
            for j in range(self.n):
                if incs[j] == int(self.last[j, 3]) and totals[j] != int(self.last[j, 2]):
                    if not self.crashed[j]:
                        self.V(
                            "get_attr-total-differs (a step ran unseen or was lost)",
                            f"env {j} total={totals[j]} last seen={self.last[j].tolist()}",
                        )
                if incs[j] != int(self.last[j, 3]):
                    self.c["get_attr-saw-respawn"] += 1
        else:
            x = self.pyrng.randrange(1000)
            got = self.call("call(ping)", self.envs.call, "ping", x)
            want = tuple(x * 1000 + j for j in range(self.n))
            if tuple(got) != want:
                self.V("call-result-wrong", f"{got} != {want}")

    # -------------------------------------------------------- send/recv
    def sendable(self) -> list[int]:
        busy_workers = {self.worker_of(j) for j in np.flatnonzero(self.in_flight)}
        out = []
        for j in range(self.n):
            if self.in_flight[j] or self.worker_of(j) in busy_workers:
                continue
            if self.mode == DIS and self.ended[j]:
                continue
            out.append(j)
        return out

    def do_send(self, ids, as_given=None) -> None:
        ids = [int(j) for j in ids]
        if not ids:
            return
        acts = self.actions(len(ids))
        arg = as_given if as_given is not None else ids
        before_cmd = self.pyrng.random() < 0.15
        if before_cmd:
            self.random_commands(for_reset=False, envs_pool=ids)
        try:
            self.call("send", self.envs.send, acts, arg)
        except EnvStateError:
            # documented refusal (a mate of these envs is still stepping): nothing sent
            self.c["send-refused (mate stepping)"] += 1
            return
        for a, j in zip(acts, ids, strict=False):
            self.in_flight[j] = True
            self.sent_action[j] = a
        self.c["sends"] += 1
        r = self.pyrng.random()
        if r < 0.12:  # a worker killed with envs in flight
            self.signal_worker(self.pyrng.choice(ids), "kill", "in-flight")
        elif r < 0.15:
            self.signal_worker(self.pyrng.choice(ids), "stop_long", "in-flight")
        elif r < 0.2:
            self.signal_worker(self.pyrng.choice(ids), "stop_short", "in-flight")
        elif r < 0.22:  # two at once
            self.signal_worker(self.pyrng.choice(ids), "kill", "in-flight2")
            self.signal_worker(self.pyrng.randrange(self.n), "kill", "in-flight2")

    def do_recv(self):
        flying = int(self.in_flight.sum())
        r = self.pyrng.random()
        if r < 0.3:
            bs = None
        elif r < 0.6:
            whole = max(1, (flying // self.k) // max(1, self.pyrng.randrange(1, 3))) * self.k
            bs = min(flying, whole)
        else:
            bs = self.pyrng.randrange(1, flying + 1)
        timeout = self.pyrng.choice([None, None, 0.0, 0.01, 0.3])
        # The other ways to form a batch: picked ("auto"), what is ready, and a batch_size
        # above the envs in flight with a min_batch they can meet. ``least``: the fewest
        # envs the call may return, given what is in flight (at most ``most`` of them).
        form = self.pyrng.random()
        extra: dict = {}
        if form < 0.15:
            bs, extra["take"] = "auto", "full"
        elif form < 0.3:
            extra["take"] = "ready"
            extra["min_batch"] = self.pyrng.randrange(1, flying + 1)
            bs = self.pyrng.randrange(extra["min_batch"], self.n + 1)
        elif form < 0.4:
            extra["min_batch"] = self.pyrng.randrange(1, flying + 1)
            bs = self.pyrng.randrange(extra["min_batch"], self.n + 1)
        began = time.monotonic()
        while True:
            try:
                out = self.call(
                    f"recv(batch_size={bs}, {extra})",
                    self.envs.recv,
                    batch_size=bs,
                    timeout=timeout,
                    **extra,
                )
                break
            except WaitTimeoutError:
                self.c["recv-timeouts"] += 1
                if time.monotonic() - began > OP_WATCHDOG_S:
                    self.V("recv-never-done", f"{OP_WATCHDOG_S} s of recv(timeout) retries")
                    timeout = None
            except EnvError as e:
                self.note_executed()
                self.check_phase(e, "step")
                j = int(e.env_index)
                self.settle_raises([j])
                self.in_flight[j] = False  # it is no longer in flight; its state is unchanged
                self.c["recv-EnvError"] += 1
                self.reconcile_flight("recv EnvError")
                if not self.in_flight.any():
                    return None
                flying = int(self.in_flight.sum())
                if "min_batch" in extra:
                    extra["min_batch"] = min(extra["min_batch"], flying)
                elif type(bs) is int and bs > flying:
                    bs = flying
                continue
        self.note_executed()
        obs, rew, term, trunc, infos = out
        ids = infos["env_id"]
        if bs == "auto":
            self.c["recv-auto"] += 1
            least, most = 1, flying
        elif "min_batch" in extra:
            self.c["recv-" + extra.get("take", "full") + "-min-batch"] += 1
            most = min(bs, flying)
            is_early = extra.get("take") == "ready" or timeout is not None
            least = extra["min_batch"] if is_early else most
        else:
            least = most = flying if bs is None else bs
        if not least <= len(ids) <= most:
            self.V("recv-wrong-batch-size", f"{bs} {extra}: {least} to {most}, got {len(ids)}")
        if list(ids) != sorted(ids):
            self.V("recv-ids-not-ascending", f"{list(ids)}")
        for row, j in enumerate(ids.tolist()):
            if not self.in_flight[j]:
                self.V("recv-returned-env-not-in-flight", f"env {j}")
                continue
            self.in_flight[j] = False
            self.check_step(
                j, obs[row], rew[row], term[row], trunc[row], infos, row, self.sent_action[j]
            )
        self.after_result_faults(infos, ids.tolist())
        return ids

    def reconcile_flight(self, where: str) -> None:
        """Envs the model has in flight that the vector no longer has (internal view)."""
        theirs = set(self.envs._in_flight.env_ids())
        for j in np.flatnonzero(self.in_flight).tolist():
            if j not in theirs:
                self.in_flight[j] = False
                if self.pending_raises[j] > 0:
                    self.pending_raises[j] -= 1
                    self.V(
                        "second-env-error-only-logged (env left flight, no EnvError names it)",
                        f"{where}: env {j}",
                    )
                else:
                    self.V("env-vanished-from-flight", f"{where}: env {j}")

    def op_sendrecv(self) -> None:
        if self.mode == DIS and self.ended.any() and self.pyrng.random() < 0.7:
            self.ensure_steppable()
        ids0 = self.sendable()
        if not ids0:
            self.ensure_steppable()
            ids0 = self.sendable()
        r = self.pyrng.random()
        if r < 0.5 and len(ids0) == self.n:
            self.do_send(ids0, as_given=None if self.pyrng.random() < 0.5 else np.arange(self.n))
        elif r < 0.75:
            self.do_send(ids0, as_given=np.array(ids0, dtype=np.int64))
        else:  # an odd subset
            sub = [j for j in ids0 if self.pyrng.random() < 0.6] or ids0[:1]
            self.do_send(sub)
        rounds = self.pyrng.randrange(3, 25)
        for _ in range(rounds):
            if not self.in_flight.any():
                break
            ids = self.do_recv()
            if ids is None:
                continue
            r = self.pyrng.random()
            back = [j for j in ids.tolist() if not (self.mode == DIS and self.ended[j])]
            if r < 0.55 and len(back) == len(ids):
                self.do_send(back, as_given=ids)  # the fast way: infos["env_id"] itself
            elif r < 0.65 and len(back) == len(ids):
                self.do_send(back, as_given=ids.copy())
            elif r < 0.8:
                sub = [j for j in back if self.pyrng.random() < 0.5]
                self.do_send(
                    sub, as_given=sub if self.pyrng.random() < 0.5 else np.array(sub, np.int32)
                )
            elif r < 0.9:  # more than returned: every sendable env
                self.do_send(self.sendable())
            elif r < 0.95 and self.in_flight.any():
                # misuse: an env in flight sent again; must be refused, nothing lost
                j = int(self.pyrng.choice(list(np.flatnonzero(self.in_flight))))
                try:
                    self.call("send(misuse)", self.envs.send, self.actions(1), [j])
                    self.V("send-of-env-in-flight-accepted", f"env {j}")
                except (EnvStateError, ValueError):
                    self.c["misuse-refused"] += 1
                except EnvError as e:  # an adopted worker's error raised here
                    self.note_executed()
                    self.settle_raises([int(e.env_index)])
                    self.in_flight[int(e.env_index)] = False
                    self.c["misuse-raised-EnvError"] += 1
                    self.reconcile_flight("misuse send EnvError")
            # else: send nothing back this round
        # drain
        while self.in_flight.any():
            self.do_recv()
        self.c["sendrecv-bursts"] += 1

    def recover(self) -> bool:
        """After an unexpected exception: nothing pending or in flight, then a full reset."""
        envs = self.envs
        for _ in range(5):
            try:
                if envs._pending is not None:
                    try:
                        self.call("recover step_wait", envs.step_wait, 30)
                    finally:
                        envs._pending = None
                if envs._pending_reset is not None:
                    try:
                        self.call("recover reset_wait", envs.reset_wait, 30)
                    finally:
                        envs._pending_reset = None
                left = 0
                while envs._in_flight.is_busy() and left < 50:
                    left += 1
                    try:
                        self.call("recover recv", envs.recv, timeout=30)
                    except EnvError:
                        pass
                obs, _infos = self.call("recover reset", envs.reset)
            except Exception as exc:  # noqa: BLE001
                self.c["recover-attempt-failed"] += 1
                self.ev(f"recover failed: {type(exc).__name__}: {exc}")
                continue
            self.in_flight[:] = False
            self.last[:] = obs
            self.ended[:] = False
            self.crashed[:] = False
            self.pending_raises.clear()
            self.clear_commands(only_reset_raise=False)
            self.c["recovered"] += 1
            return True
        self.V("recover-failed", "5 attempts")
        return False

    # ------------------------------------------------------------------ run
    def make(self) -> MultiEnv:
        fns = [
            functools.partial(CounterEnv, i, self.ctl_path, self.n, self.a.wait_s)
            for i in range(self.n)
        ]
        kw = dict(
            autoreset_mode=self.mode,
            envs_per_worker=self.k,
            step_timeout=self.a.step_timeout,
            reset_timeout=self.a.step_timeout,
            restart_policy=RestartPolicy(max_restarts=1000, window_s=1),
        )
        if self.a.spin:
            kw["wait"] = "spin"
        return MultiEnv(fns, **kw)

    def run(self) -> int:
        # warm-up: the module server is started, so that the fd baseline includes it
        warm = MultiEnv([functools.partial(CounterEnv, 0, self.ctl_path, self.n)])
        warm.reset()
        warm.close()
        time.sleep(0.5)
        base_fds = len(os.listdir("/proc/self/fd"))
        base_threads = threading.active_count()
        t0 = time.monotonic()
        self.envs = self.call("MultiEnv()", self.make)
        obs, _infos = self.call("reset(seed)", self.envs.reset, seed=self.a.seed)
        self.last[:] = obs
        bg = threading.Thread(target=self.background, daemon=True, name="bg-faults")
        bg.start()
        ends = t0 + self.a.seconds
        ops = ["step", "step_list", "async", "sendrecv", "reset", "call"]
        weights = [30, 5, 15, 25, 13, 8]
        unexpected = 0
        try:
            while time.monotonic() < ends:
                self.op += 1
                name = self.pyrng.choices(ops, weights)[0]
                self.opname = name
                if name in ("step", "step_list", "async") and self.pyrng.random() < 0.25:
                    self.random_commands(for_reset=False)
                if self.pyrng.random() < 0.03:  # two faults at once, just before the call
                    self.signal_worker(self.pyrng.randrange(self.n), "kill", "pair")
                    self.signal_worker(self.pyrng.randrange(self.n), "kill", "pair")
                try:
                    if name == "step":
                        self.op_step()
                    elif name == "step_list":
                        self.op_step(use_list=True)
                    elif name == "async":
                        self.op_async()
                    elif name == "sendrecv":
                        self.op_sendrecv()
                    elif name == "reset":
                        self.op_reset()
                    else:
                        self.op_call()
                except Exception as exc:  # noqa: BLE001
                    unexpected += 1
                    self.V(
                        "unexpected-exception",
                        f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                    )
                    if unexpected > 25 or not self.recover():
                        break
                self.c[f"op:{name}"] += 1
                if self.mode == SAME:
                    self.clear_commands(only_reset_raise=True)
                self.note_executed()
                self.quiescent_checks()
                if self.op % 50 == 0:
                    nw = len(worker_procs())
                    if nw > self.num_workers + 3:
                        self.V("worker-processes-piling-up", f"{nw} workers for {self.num_workers}")
        finally:
            self.bg_stop.set()
            bg.join(timeout=10)
        # let the last faults be seen: a few clean steps, no new faults
        self.quiet = True
        self.clear_commands(only_reset_raise=False)
        for tm in self.timers:
            tm.cancel()
        for p in worker_procs():  # whatever is still stopped goes on
            _cont(p.pid)
        for tm in self.timers:
            tm.join()
        self.timers.clear()
        time.sleep(0.5)
        for _ in range(3):
            self.opname = "final"
            try:
                self.op_step()
            except Exception as exc:  # noqa: BLE001
                self.V("unexpected-exception", f"final step {type(exc).__name__}: {exc}")
        self.note_executed()
        self.quiescent_checks()
        stats = self.envs.stats()
        restarts = np.array([stats[w * self.k]["restarts"] for w in range(self.num_workers)])
        over = restarts - (self.deaths_definite + self.deaths_maybe)
        for w in np.flatnonzero(over > 0):
            self.V(
                "restart-without-injected-death",
                f"worker {w}: restarts {restarts[w]} definite {self.deaths_definite[w]} maybe {self.deaths_maybe[w]}",
            )
        sent_parts = getattr(getattr(self.envs._in_flight, "parts", None), "sent", None)
        resent = getattr(getattr(self.envs._in_flight, "parts", None), "resent", None)
        # close
        t_close = time.monotonic()
        self.call("close()", self.envs.close, _wd=60)
        close_s = time.monotonic() - t_close
        if close_s > 5:
            self.V("close-slow", f"close() took {close_s:.1f} s")
        left = worker_procs()
        deadline = time.monotonic() + 5
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = worker_procs()
        if left:
            self.V("workers-left-after-close", f"{[(p.pid, p.name()) for p in left]}")
        zombies = [p.pid for p in my_descendants() if _status(p) == psutil.STATUS_ZOMBIE]
        if zombies:
            self.V("zombies-after-close", f"{zombies}")
        others = [
            (p.pid, _name(p))
            for p in my_descendants()
            if not _name(p).startswith(("multienv-server", "multienv-spare"))
        ]
        if others:
            self.V("other-descendants-after-close", f"{others}")
        time.sleep(0.3)
        fds = len(os.listdir("/proc/self/fd"))
        if fds != base_fds:
            self.V("fd-leak", f"fds {fds} vs baseline {base_fds}: {fd_list()}")
        threads = threading.active_count()
        extra_threads = [
            t.name for t in threading.enumerate() if t.name not in ("watchdog", "MainThread")
        ]
        if threads > base_threads:
            self.V("thread-leak", f"threads {threads} vs {base_threads}: {extra_threads}")
        os.unlink(self.ctl_path)
        elapsed = time.monotonic() - t0
        log(
            f"RESULT [{self.tag}] {elapsed:.0f}s ops={self.op} results={self.c['results']} "
            f"flags={self.c['flags']} causes={dict(self.causes)} EnvErrors={self.c['EnvError']} "
            f"restarts={restarts.tolist()} deaths(definite)={self.deaths_definite.tolist()} "
            f"(maybe)={self.deaths_maybe.tolist()} parts_sent={sent_parts} resent={resent} "
            f"close={close_s:.2f}s fds={fds}/{base_fds}"
        )
        log("  counts: " + ", ".join(f"{k}={v}" for k, v in sorted(self.c.items())))
        if self.violations:
            log(f"  VIOLATIONS {len(self.violations)}: {dict(self.vkinds)}")
            return 1
        log("  all invariants held")
        return 0


def _short(args) -> str:
    out = []
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(f"array{a.tolist()}" if a.size <= 12 else f"array(shape={a.shape})")
        elif isinstance(a, list) and len(a) <= 12:
            out.append(f"list{a}")
        else:
            out.append(type(a).__name__)
    return ", ".join(out)


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _status(p):
    try:
        return p.status()
    except psutil.Error:
        return None


def _name(p):
    try:
        return p.name()
    except psutil.Error:
        return "?"


def fd_list() -> dict:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default=NEXT, choices=[NEXT, SAME, DIS])
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--spin", action="store_true")
    ap.add_argument("--wait-s", type=float, default=0.0, help="each step sleeps this first")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--step-timeout", type=float, default=2.5)
    ap.add_argument("--bg-every-s", type=float, default=1.5, help="mean gap of background faults")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(3), "little")
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    faulthandler.enable()
    return Chaos(args).run()


if __name__ == "__main__":
    sys.exit(main())
