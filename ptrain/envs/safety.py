"""Reward code that raises or hangs scores 0 with a reason, is logged and counted; the run goes on.

    outcome = run_reward_fn(math_reward, completion, answer, timeout_s=5)
    outcome.reward, outcome.reason          # 1.0, None  |  0.0, "timeout after 5.0 s"

In-process reward code (a math verifier, a parser, a user's scoring function) runs in a
small pool of worker processes, because a separate process is the only thing that bounds a
hang reliably: a thread cannot be stopped, and `signal.alarm` (which math-verify uses for
its timeouts) only works on the main thread, so called from an environment's worker thread
it fails and, in verl, silently zeroes every score. Here the function runs on a worker's
main thread (its own alarms work), the caller may be any thread, and a worker that overruns
its timeout is killed and replaced. Measured cost of a call on warm workers: a pipe round
trip plus pickling, about 0.1 ms on the build machine (`tools/bench_sandbox.py --reward`
prints it); a replacement worker costs a fork from the forkserver plus its first import of
the function's module.

The function must be picklable (defined at module level); a lambda or a nested function is
a configuration error, raised as TypeError at once rather than scored 0 on every sample.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "raised", "timeout", "crashed", "bad_value")
"""Keys of RewardRunner.stats: how each call ended."""


@dataclass(frozen=True)
class RewardOutcome:
    """reward: the function's value as a float, or 0.0 when it failed; reason: None when it
    returned a finite number, else what went wrong; kind: one of OUTCOMES; elapsed_s: wall
    seconds of the call, queueing for a free worker included."""

    reward: float
    reason: str | None
    kind: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        """The function returned a finite number."""
        return self.kind == "ok"


def _worker_main(conn) -> None:
    """Worker loop: receive (fn, args, kwargs), send back ('ok', value) or ('raised', text)."""
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:
            return
        except Exception as e:  # the message arrived whole, but its function does not import here
            conn.send(("raised", f"the worker could not load the call: {type(e).__name__}: {e}"))
            continue
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", value)
        except BaseException as e:  # the caller wants a reason, whatever it raised
            last = traceback.extract_tb(e.__traceback__)[-1:]
            where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
            reply = ("raised", f"{type(e).__name__}: {e}{where}")
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable return value
            conn.send(("bad_value", f"returned an unpicklable {type(reply[1]).__name__} ({e})"))


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="ptrain-reward-worker")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardRunner:
    """Runs reward functions in `workers` worker processes with a timeout per call.

    Thread-safe: each call takes a free worker (waiting for one if all are busy). A call
    that overruns its timeout, or whose worker dies, kills that worker and a fresh one is
    started for the next call. `stats` counts how calls ended (keys: OUTCOMES).
    """

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, start_method: str | None = None):
        if workers < 1:
            raise ValueError(f"workers={workers}: need at least one worker process")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        methods = multiprocessing.get_all_start_methods()
        # Never fork the trainer itself: it holds threads (JAX, the event loop) whose locks a
        # forked child would inherit held.
        method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        self._ctx = multiprocessing.get_context(method)
        self.timeout_s = timeout_s
        self.workers = workers
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot whose worker starts on first use
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter({k: 0 for k in OUTCOMES})
        self._closed = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> RewardOutcome:
        """Call fn(*args, **kwargs) in a worker; a finite number comes back as the reward,
        anything else (an exception, a hang past timeout_s, a crash, a non-number) as 0.0
        with the reason."""
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        limit = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        worker = self._idle.get()
        try:
            if worker is None:
                worker = _Worker(self._ctx)
            try:
                worker.conn.send((fn, args, kwargs))
            except (AttributeError, TypeError, ValueError) as e:  # pickling errors
                # A half-written message would desynchronise the pipe; start over.
                worker.kill()
                worker = None
                raise TypeError(
                    f"reward function {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to a "
                    f"worker process ({e}); define the function at module level"
                ) from None
            if worker.conn.poll(limit):
                try:
                    kind, value = worker.conn.recv()
                except (EOFError, OSError):
                    worker.proc.join(1)  # EOF can come before the exit status
                    code = worker.proc.exitcode
                    worker.kill()
                    worker = None
                    return self._fail(fn, "crashed", f"worker process died (exit code {code})", start)
            else:
                worker.kill()
                worker = None
                return self._fail(fn, "timeout", f"timeout after {limit:g} s", start)
        finally:
            self._idle.put(worker)
        if kind == "ok":
            try:
                reward = float(value)
            except (TypeError, ValueError):
                return self._fail(
                    fn, "bad_value", f"returned {type(value).__name__} {value!r:.80}, not a number", start
                )
            except OverflowError:  # an int past float's range
                return self._fail(fn, "bad_value", f"returned an int of {value.bit_length()} bits, past float's range",
                                  start)  # fmt: skip
            if not math.isfinite(reward):
                return self._fail(fn, "bad_value", f"returned {reward}", start)
            with self._lock:
                self.stats["ok"] += 1
            return RewardOutcome(reward, None, "ok", time.monotonic() - start)
        return self._fail(fn, kind, value, start)

    def _fail(self, fn, kind: str, reason: str, start: float) -> RewardOutcome:
        with self._lock:
            self.stats[kind] += 1
        logger.warning("reward %s scored 0: %s", getattr(fn, "__qualname__", fn), reason)
        return RewardOutcome(0.0, reason, kind, time.monotonic() - start)

    def close(self) -> None:
        """Stop the worker processes (calls in flight finish first)."""
        self._closed = True
        for _ in range(self.workers):
            worker = self._idle.get()
            if worker is not None:
                worker.kill()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DEFAULT: RewardRunner | None = None
_DEFAULT_LOCK = threading.Lock()


def default_runner() -> RewardRunner:
    """The process-wide runner that run_reward_fn uses (two workers, started on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = RewardRunner(workers=2)
        return _DEFAULT


def run_reward_fn(fn: Callable[..., Any], *args: Any, timeout_s: float = 10.0, **kwargs: Any) -> RewardOutcome:
    """Score with fn(*args, **kwargs) in the shared worker pool: reward 0 with a reason when
    it raises, hangs past timeout_s, crashes its worker or returns a non-number. Callable
    from any thread. Counts are in default_runner().stats."""
    return default_runner().run(fn, *args, timeout_s=timeout_s, **kwargs)


__all__ = ["OUTCOMES", "RewardOutcome", "RewardRunner", "default_runner", "run_reward_fn"]
