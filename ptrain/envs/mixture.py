"""Mixing environments: draw a stage's tasks from several environments by weight, and report
every metric per environment.

    mix = EnvMixture([countdown, math], [2.0, 1.0], seed=0)
    env, task = mix.next_task()                    # countdown about two draws in three
    state = mix.get_state(); mix.set_state(state)  # a resumed stage continues the same order
    metrics = aggregate_metrics(trajectories)      # {"countdown/reward_mean": ..., "math/...": ...}

Draw i picks an environment with a generator seeded by (seed, i) alone, and each
environment walks its tasks in a fresh permutation per epoch seeded by (seed, name,
epoch), so the whole order is a function of the seed and the draw count: the state is a
few integers, and a resumed mixture draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def env_task_seed(env: Any, seed: int) -> int:
    """The seed an environment's tasks are built with: its own (its config's seed), else one
    derived from `seed` and its name. Every stage builds an environment's train and eval
    tasks with it, so they come from one `make_tasks` call and stay disjoint."""
    own = getattr(env, "seed", None)
    if own is not None:
        return int(own)
    return int(np.random.SeedSequence([int(seed), _name_key(env.name)]).generate_state(1)[0] >> 1)


class EnvMixture:
    """Draws (environment, task) pairs from `envs` with probabilities proportional to `weights`.

    envs: environments with distinct `name`s. weights: one per environment (> 0); None: each
    environment's `weight` attribute (its config's weight), else 1. seed: the draw order's
    seed. split: whose tasks ("train" or "eval"). task_seeds: per environment name, the seed
    its `tasks()` are built with; None: each environment's `seed` attribute (its config's
    seed), else one derived from `seed` and the name.
    """

    def __init__(
        self,
        envs: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        seed: int,
        split: str = "train",
        task_seeds: Mapping[str, int] | None = None,
    ):
        if not envs:
            raise ValueError("EnvMixture needs at least one environment")
        names = [env.name for env in envs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"environments {repeated} appear more than once; give each its own name")
        if weights is None:
            weights = [float(getattr(env, "weight", 1.0)) for env in envs]
        if len(weights) != len(envs):
            raise ValueError(f"{len(weights)} weights for {len(envs)} environments")
        bad = [
            (n, w) for n, w in zip(names, weights) if not (isinstance(w, int | float) and w > 0 and math.isfinite(w))
        ]
        if bad:
            raise ValueError(f"environment weights must be finite and > 0, got {bad}")
        self.envs = list(envs)
        self.names = names
        self.seed = int(seed)
        self.split = split
        total = float(sum(weights))
        self.probabilities = [w / total for w in weights]
        self._cumulative = np.cumsum(self.probabilities)
        self._tasks = {}
        for env in envs:
            task_seed = (task_seeds or {}).get(env.name)
            if task_seed is None:
                task_seed = env_task_seed(env, self.seed)
            tasks = list(env.tasks(split, seed=int(task_seed)))
            if not tasks:
                raise ValueError(f"environment {env.name!r} has no {split} tasks; raise its n_{split}")
            self._tasks[env.name] = tasks
        self._draws = 0
        self._cursors = {name: 0 for name in names}
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    def _pick(self, i: int) -> int:
        u = np.random.default_rng([self.seed, i]).random()
        return min(int(np.searchsorted(self._cumulative, u, side="right")), len(self.envs) - 1)

    def _task_at(self, name: str, position: int):
        tasks = self._tasks[name]
        epoch, k = divmod(position, len(tasks))
        key = (name, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, _name_key(name), epoch]).permutation(len(tasks))
        return tasks[int(self._perms[key][k])]

    def next_task(self) -> tuple[Any, Any]:
        """The next (environment, task)."""
        j = self._pick(self._draws)
        self._draws += 1
        name = self.names[j]
        task = self._task_at(name, self._cursors[name])
        self._cursors[name] += 1
        return self.envs[j], task

    def next_tasks(self, k: int) -> list[tuple[Any, Any]]:
        """The next k (environment, task) pairs."""
        return [self.next_task() for _ in range(k)]

    def get_state(self) -> dict[str, Any]:
        """JSON-ready state: draws so far, each environment's position, and what they refer to."""
        return {
            "draws": self._draws,
            "cursors": dict(self._cursors),
            "seed": self.seed,
            "split": self.split,
            "tasks": {name: len(tasks) for name, tasks in self._tasks.items()},
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `get_state()`'s result; refuses a state of another mixture."""
        now = self.get_state()
        for key in ("seed", "split", "tasks"):
            if state.get(key) != now[key]:
                raise ValueError(
                    f"mixture state has {key}={state.get(key)!r} but this mixture has {now[key]!r}: the environments, "
                    "their task counts or the seed changed since it was saved, so the order cannot continue; "
                    "restore the old config or start the stage afresh"
                )
        self._draws = int(state["draws"])
        self._cursors = {name: int(state["cursors"][name]) for name in self.names}

    def aggregate(self, trajectories: Iterable[Any]) -> dict[str, float]:
        """aggregate_metrics over these trajectories."""
        return aggregate_metrics(trajectories)


def _mean_std(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std())


def _summary(trajs: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {"episodes": float(len(trajs))}
    out["reward_mean"], out["reward_std"] = _mean_std([t.reward for t in trajs])
    components: dict[str, list[float]] = defaultdict(list)
    metrics: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for k, v in t.reward_components.items():
            components[k].append(float(v))
        for k, v in t.metrics.items():
            metrics[k].append(float(v))
    for k, values in sorted(components.items()):
        out[f"reward/{k}_mean"], out[f"reward/{k}_std"] = _mean_std(values)
    for k, values in sorted(metrics.items()):
        out[f"{k}_mean"] = float(np.mean(values))
    correct = [float(t.metrics["correct"]) for t in trajs if "correct" in t.metrics]
    if correct:
        out["pass_rate"] = float(np.mean([c >= 1.0 for c in correct]))
    groups: dict[str, list[Any]] = defaultdict(list)
    for t in trajs:
        groups[t.task.id].append(t)
    out["tasks"] = float(len(groups))
    out["solved_tasks"] = float(
        np.mean([any(float(t.metrics.get("correct", 0.0)) >= 1.0 for t in g) for g in groups.values()])
    )
    out["zero_variance_groups"] = float(np.mean([len({t.reward for t in g}) == 1 for g in groups.values()]))
    lengths = [t.response_length for t in trajs]
    out["response_length_mean"] = float(np.mean(lengths))
    out["response_length_max"] = float(np.max(lengths))
    out["prompt_length_mean"] = float(np.mean([t.prompt_length for t in trajs]))
    out["truncated_rate"] = float(np.mean([t.finish_reason == "length" for t in trajs]))
    errors = sum(t.reward_error is not None for t in trajs)
    out["reward_errors"] = float(errors)
    out["reward_error_rate"] = errors / len(trajs)
    out["env_errors"] = float(sum(t.finish_reason == "error" for t in trajs))
    out["tokens/prompt_uncached"] = float(sum(t.tokens.prompt_uncached for t in trajs))
    out["tokens/prompt_cached"] = float(sum(t.tokens.prompt_cached for t in trajs))
    out["tokens/output"] = float(sum(t.tokens.output for t in trajs))
    return out


def aggregate_metrics(trajectories: Iterable[Any]) -> dict[str, float]:
    """Per-environment metrics of a batch of trajectories, keyed "<env>/<metric>": episodes,
    reward mean/std overall and per component, the mean of every episode metric, pass rate
    (episodes with correct >= 1), solved tasks (any sample correct: pass@n), groups whose
    rewards are all equal (no GRPO signal), response and prompt lengths, truncation rate,
    reward errors, environment errors, and token totals by tier. With more than one
    environment, the same under "all/"."""
    by_env: dict[str, list[Any]] = defaultdict(list)
    everything = []
    for t in trajectories:
        by_env[t.task.env].append(t)
        everything.append(t)
    out: dict[str, float] = {}
    for name, trajs in sorted(by_env.items()):
        out.update({f"{name}/{k}": v for k, v in _summary(trajs).items()})
    if len(by_env) > 1:
        out.update({f"all/{k}": v for k, v in _summary(everything).items()})
    return out
