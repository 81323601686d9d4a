"""Task selection by pass rate: skip what the policy always solves, or aim at a difficulty.

    tasks = Curriculum(EnvMixture(envs, weights, seed=0), drop_solved=True, seed=0)
    env, task = tasks.next_task()
    tasks.record(task, pass_rate=0.75)           # after the task's group was scored

Each task's pass rate is the share of correct samples in its most recent group. A task never
seen yet is always taken. With `drop_solved`, a task last solved by every sample is skipped
(Nemotron 3 drops prompts the SFT model solves every time; DAPO's dynamic sampling drops
such groups after sampling, this avoids sampling them). With `target`, a task with pass
rate p is taken with probability exp(-(p - target)^2 / (2 width^2)): the Gaussian pass-rate
schedule that keeps training on tasks of about that difficulty. With `target_end` the target
moves linearly from `target` to `target_end` over the first `schedule_draws` draws, and
stays there: Nemotron 3 Nano's schedule moves it from easy (a high pass rate) to hard.
Acceptance draws are seeded
by (seed, draw count), so the order is a function of the seed and the recorded rates, and
`get_state` carries both for an exact resume. After `max_tries` refusals in a row the next
task is taken anyway, so selection never stalls a stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


class Curriculum:
    """A task source (next_task / get_state / set_state) over another one (module docstring)."""

    def __init__(
        self,
        source,
        *,
        drop_solved: bool = False,
        target: float | None = None,
        width: float = 0.25,
        target_end: float | None = None,
        schedule_draws: int = 0,
        seed: int = 0,
        max_tries: int = 64,
    ):
        for name, value in (("target", target), ("target_end", target_end)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"pass-rate {name} must be in [0, 1], got {value}")
        if target_end is not None and (target is None or schedule_draws < 1):
            raise ValueError(
                f"a moving pass-rate target needs a start target and schedule_draws >= 1, got target={target} "
                f"schedule_draws={schedule_draws}"
            )
        if width <= 0:
            raise ValueError(f"pass-rate width must be > 0, got {width}")
        self.source = source
        self.drop_solved = drop_solved
        self.target = target
        self.width = width
        self.target_end = target_end
        self.schedule_draws = int(schedule_draws)
        self.seed = int(seed)
        self.max_tries = max_tries
        self.rates: dict[str, float] = {}
        self.draws = 0
        self.stats = {"skipped_solved": 0, "skipped_schedule": 0}

    @staticmethod
    def key(task) -> str:
        return f"{task.env}/{task.id}"

    def record(self, task, pass_rate: float) -> None:
        """The share of correct samples in the task's latest group."""
        self.rates[self.key(task)] = float(pass_rate)

    def current_target(self) -> float | None:
        """The pass-rate target at the current draw count."""
        if self.target is None or self.target_end is None:
            return self.target
        frac = min(self.draws / self.schedule_draws, 1.0)
        return self.target + (self.target_end - self.target) * frac

    def _accept(self, task) -> bool:
        p = self.rates.get(self.key(task))
        if p is None:
            return True
        if self.drop_solved and p >= 1.0:
            self.stats["skipped_solved"] += 1
            return False
        target = self.current_target()
        if target is not None:
            weight = math.exp(-((p - target) ** 2) / (2 * self.width**2))
            if np.random.default_rng([self.seed, self.draws]).random() > weight:
                self.stats["skipped_schedule"] += 1
                return False
        return True

    def next_task(self):
        """The next (environment, task) the curriculum accepts."""
        for _ in range(self.max_tries):
            env, task = self.source.next_task()
            self.draws += 1
            if self._accept(task):
                return env, task
        return env, task

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.get_state(), "rates": dict(self.rates), "draws": self.draws,
                "stats": dict(self.stats)}  # fmt: skip

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.source.set_state(state["source"])
        self.rates = {k: float(v) for k, v in state.get("rates", {}).items()}
        self.draws = int(state.get("draws", 0))
        self.stats.update(state.get("stats", {}))
