"""The `reasoning_gym` environment: any dataset of the reasoning-gym package, by name.

reasoning-gym generates its tasks procedurally (about a hundred datasets: arithmetic,
algebra, logic puzzles, graphs, ciphers, games...), so nothing is downloaded. Tasks come
from `reasoning_gym.create_dataset(name, size=..., seed=..., **config)` and each answer is
scored by that dataset's own `score_answer(answer, entry)` (a value in [0, 1]; some give
partial credit), run in a worker process with env.reward_timeout_s. The answer is the
completion's last <answer>...</answer>.

Several datasets share the environment's tasks by options.dataset_weights. The held-out
and training tasks of a dataset come from two unrelated seeds, and a training task whose
question is also held out is dropped, so the splits are disjoint.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, extract_tag


@lru_cache(maxsize=64)
def scorer_dataset(name: str, config_json: str):
    """A dataset object of `name` with this config, kept for its score_answer."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))


def judge_reasoning_gym(answer: str, entry: dict[str, Any], name: str, config_json: str) -> float:
    """The dataset's own score of `answer` for `entry` (in [0, 1])."""
    return float(scorer_dataset(name, config_json).score_answer(answer, entry))


def allocate(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to weights (largest remainders; sums to total)."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class ReasoningGymEnv(SingleTurnEnv):
    """reasoning-gym datasets (options: ReasoningGymOptions)."""

    kind = "reasoning_gym"
    warm_modules = ("reasoning_gym",)
    judge = staticmethod(judge_reasoning_gym)

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        import reasoning_gym

        from ptrain.config.seeds import derive_seed

        o = self.options
        weights = [float(o.dataset_weights.get(d, 1.0)) for d in o.datasets]
        n_train = allocate(self.cfg.n_train, weights)
        n_eval = allocate(self.cfg.n_eval, weights)
        train: list[tuple[str, str, dict]] = []
        held: list[tuple[str, str, dict]] = []
        for name, nt, ne in zip(o.datasets, n_train, n_eval):
            config = dict(o.dataset_configs.get(name, {}))
            config_json = json.dumps(config, sort_keys=True)
            held_questions = set()
            if ne:
                ds = reasoning_gym.create_dataset(name, size=ne, seed=derive_seed(seed, f"{name}.eval"), **config)
                for entry in ds:
                    held.append((name, config_json, entry))
                    held_questions.add(entry["question"])
            if nt:
                # Extra entries make up for training questions that are also held out.
                ds = reasoning_gym.create_dataset(name, size=nt + ne, seed=derive_seed(seed, f"{name}.train"), **config)
                kept = [e for e in ds if e["question"] not in held_questions][:nt]
                if len(kept) < nt:
                    raise ValueError(
                        f"envs.{self.name}: reasoning-gym dataset {name!r} gave only {len(kept)} training tasks distinct "
                        f"from its {ne} held-out ones; lower n_train / n_eval or widen its config"
                    )
                train.extend((name, config_json, e) for e in kept)
        rng = random.Random(seed)
        rng.shuffle(train)
        rng.shuffle(held)

        def make(split: str, entries) -> list[Task]:
            out = []
            for i, (name, config_json, entry) in enumerate(entries):
                content = f"{entry['question'].rstrip()}\n\n{o.instruction}"
                data = {"dataset": name, "config": config_json, "entry": entry, "answer": entry.get("answer")}
                out.append(self.task(split, i, self.user(content), data))
            return out

        return make("train", train), make("eval", held)

    def extract(self, task: Task, text: str) -> str | None:
        return extract_tag(text)

    def judge_args(self, task: Task, answer: str) -> tuple:
        return (answer, task.data["entry"], task.data["dataset"], task.data["config"])
