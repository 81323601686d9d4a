"""Groups of scored trajectories for an RL stage, collected synchronously or ahead of training.

    collector = RolloutCollector(envs, tasks, engine, sampling, group_size=8, seed=0)
    groups = collector.collect(8, version=3)             # sync: 8 tasks x 8 samples, on version 3
    collector.start(); groups = collector.take(8, version=3, max_staleness=1)   # async

A *group* is the n samples of one task (the GRPO group). Episodes run as asyncio tasks on
one event loop in a background thread, so many run at once and a slow environment holds
only its own episodes; the engine batches whatever they submit.

Sampling seeds: group k (counting every group this collector ever started) samples with
sampling_seed = seed_of(seed, k), so a resumed stage that draws the same tasks in the same
order on the same weights samples the same tokens.

Asynchronous mode (`start`): the producer keeps up to `ahead` groups started or finished
but not yet taken, each tagged with the weight version it started on; `take` hands out
the oldest finished groups whose version is at most `max_staleness` behind and drops (and
counts) older ones, whose tasks are drawn again later by the task source as it sees fit.
Weight updates happen meanwhile through the engine (in place or drained, by the stage).

Checkpoints (`get_state` / `set_state`, JSON): the task source's state, the group counter,
the finished groups not yet taken, and the tasks still running (restarted on resume), so
no sample is lost or used twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ptrain.envs.base import Environment, Task, TokenCounts, Trajectory, Turn
from ptrain.rollout.protocol import EngineUnavailable, RolloutEngine, SamplingParams


class TaskSource(Protocol):
    """Where an RL stage's tasks come from (ptrain.envs.mixture.EnvMixture)."""

    def next_task(self) -> tuple[Environment, Task]: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


@dataclasses.dataclass
class Group:
    """The samples of one task, and when and on which weights they were made."""

    task: Task
    trajectories: list[Trajectory]
    version: int
    """Weight version (optimizer steps taken) the group started on."""
    index: int
    """Order in which the collector started it."""
    seconds: float = 0.0
    """Wall time from start to the last sample's reward."""


def seed_of(seed: int, index: int) -> int:
    """The sampling seed of group `index` (31-bit, decorrelated from neighbours)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] & 0x7FFFFFFF)


class RolloutCollector:
    """Runs environments' episodes on an engine (module docstring)."""

    def __init__(
        self,
        envs: Mapping[str, Environment],
        tasks: TaskSource,
        engine: RolloutEngine,
        sampling: SamplingParams,
        *,
        group_size: int,
        seed: int,
        ahead: int = 0,
        audit=None,
    ):
        self.envs = dict(envs)
        self.tasks = tasks
        self.engine = engine
        self.sampling = dataclasses.replace(sampling, n=group_size)
        self.seed = seed
        self.ahead = ahead
        self.audit = audit
        self._count = 0
        self._resume: list[Task] = []
        self._ready: deque[Group] = deque()
        self._running: dict[int, Task] = {}
        self._version = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._producing = False
        self.stats = {"groups": 0, "dropped_stale": 0, "env_errors": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ptrain-rollouts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ episodes

    def _next_task(self) -> tuple[Task, int]:
        task = self._resume.pop(0) if self._resume else self.tasks.next_task()[1]
        index = self._count
        self._count += 1
        return task, index

    async def _run_group(self, task: Task, index: int, version: int) -> Group:
        t0 = time.time()
        env = self.envs.get(task.env)
        if env is None:
            raise KeyError(f"task {task.id!r} names environment {task.env!r}, which this stage does not have")
        sampling = dataclasses.replace(self.sampling, sampling_seed=seed_of(self.seed, index))
        try:
            trajectories = await env.rollout(task, self.engine, sampling)
        except EngineUnavailable:  # nothing can sample: the stage checkpoints and stops
            raise
        except Exception as e:  # one environment's failure must not end the stage
            self.stats["env_errors"] += 1
            trajectories = [_failed(task, j, f"{type(e).__name__}: {e}") for j in range(sampling.n)]
        group = Group(task, list(trajectories), version, index, time.time() - t0)
        if self.audit is not None:
            for t in group.trajectories:
                self.audit.write(t, group=index, version=version)
        return group

    def _submit(self, task: Task, index: int, version: int) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._run_group(task, index, version), self._loop)

    # ------------------------------------------------------------------ sync

    def collect(self, n_groups: int, *, version: int) -> list[Group]:
        """Start n_groups tasks now and wait for all of them (strictly on-policy)."""
        futures = [self._submit(*self._next_task(), version) for _ in range(n_groups)]
        groups = [f.result() for f in futures]
        self.stats["groups"] += len(groups)
        return groups

    # ------------------------------------------------------------------ async

    def start(self) -> None:
        """Begin producing ahead (asynchronous mode)."""
        with self._cv:
            self._producing = True
            self._fill()

    def set_version(self, version: int) -> None:
        """The weight version new groups start on (call after each engine weight update)."""
        with self._cv:
            self._version = version

    def _fill(self) -> None:
        while self._producing and len(self._ready) + len(self._running) < self.ahead:
            task, index = self._next_task()
            self._running[index] = task
            future = self._submit(task, index, self._version)
            future.add_done_callback(lambda f, i=index: self._done(i, f))

    def _done(self, index: int, future: concurrent.futures.Future) -> None:
        with self._cv:
            self._running.pop(index, None)
            try:
                self._ready.append(future.result())
            except BaseException as e:  # the collector's own failure: surfaced by take()
                self._error = e
            self._fill()
            self._cv.notify_all()

    def take(self, n_groups: int, *, version: int, max_staleness: int, timeout_s: float | None = None) -> list[Group]:
        """The n oldest finished groups at most max_staleness versions behind `version`."""
        out: list[Group] = []
        deadline = None if timeout_s is None else time.time() + timeout_s
        with self._cv:
            while len(out) < n_groups:
                if isinstance(self._error, EngineUnavailable):
                    raise self._error
                if self._error is not None:
                    raise RuntimeError(f"rollout collection failed: {self._error!r}") from self._error
                while self._ready and len(out) < n_groups:
                    g = self._ready.popleft()
                    if version - g.version > max_staleness:
                        self.stats["dropped_stale"] += 1
                        continue
                    out.append(g)
                self._fill()
                if len(out) < n_groups:
                    left = None if deadline is None else deadline - time.time()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"only {len(out)} of {n_groups} rollout groups after {timeout_s} s")
                    self._cv.wait(left)
        self.stats["groups"] += len(out)
        return sorted(out, key=lambda g: g.index)

    # ------------------------------------------------------------------ checkpoints

    def get_state(self) -> dict[str, Any]:
        with self._cv:
            return {
                "tasks": self.tasks.get_state(),
                "count": self._count,
                "resume": [_task_to_json(t) for t in self._resume]
                + [_task_to_json(t) for _, t in sorted(self._running.items())],
                "ready": [_group_to_json(g) for g in self._ready],
            }

    def set_state(self, state: dict[str, Any]) -> None:
        with self._cv:
            self.tasks.set_state(state["tasks"])
            self._count = int(state["count"])
            self._resume = [_task_from_json(t) for t in state.get("resume", [])]
            self._ready = deque(_group_from_json(g) for g in state.get("ready", []))

    def close(self) -> None:
        with self._cv:
            self._producing = False
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


# ----------------------------------------------------------------------------- helpers


def _failed(task: Task, index: int, error: str) -> Trajectory:
    return Trajectory(
        task=task,
        sample_index=index,
        token_ids=(),
        prompt_length=0,
        loss_mask=(),
        logprobs=(),
        reward=0.0,
        finish_reason="error",
        error=error,
    )


def _task_to_json(t: Task) -> dict:
    return {"env": t.env, "id": t.id, "messages": [dict(m) for m in t.messages], "data": dict(t.data)}


def _task_from_json(d: dict) -> Task:
    return Task(env=d["env"], id=d["id"], messages=tuple(d["messages"]), data=d.get("data", {}))


def _traj_to_json(t: Trajectory) -> dict:
    d = dataclasses.asdict(t)
    d["task"] = None  # the group holds it
    return d


def _traj_from_json(d: dict, task: Task) -> Trajectory:
    d = dict(d)
    d["task"] = task
    d["turns"] = tuple(Turn(**x) for x in d.get("turns", ()))
    d["tokens"] = TokenCounts(**d.get("tokens", {}))
    for k in ("token_ids", "loss_mask", "logprobs", "weight_versions"):
        d[k] = tuple(d.get(k, ()))
    return Trajectory(**d)


def _group_to_json(g: Group) -> dict:
    return {
        "task": _task_to_json(g.task),
        "trajectories": [_traj_to_json(t) for t in g.trajectories],
        "version": g.version,
        "index": g.index,
        "seconds": g.seconds,
    }


def _group_from_json(d: dict) -> Group:
    task = _task_from_json(d["task"])
    return Group(task, [_traj_from_json(t, task) for t in d["trajectories"]], d["version"], d["index"], d["seconds"])
