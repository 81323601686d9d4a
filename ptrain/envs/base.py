"""The environment protocol: a task plus a rollout engine -> scored trajectories.

    env = make_env(EnvConfig(kind="countdown"), tokenizer=tok)       # ptrain.envs.registry
    tasks = env.tasks("train", seed=0)                                 # a Sequence[Task]
    trajectories = await env.rollout(tasks[0], engine, SamplingParams(n=8, temperature=1.0))

A `Trajectory` holds the tokens exactly as the engine produced them and as the environment
appended its own turns (tool results, user follow-ups): nothing is ever re-tokenised, so
the trainer computes log-probs on the very ids that were sampled. `loss_mask` keeps the
policy's tokens only; `logprobs` are the engine's (full-vocabulary, tempered) log-probs of
those tokens. The reward has named components that sum to it, and an audit record
(`turns`) says what happened at each step.

Reward code that raises or hangs never crashes or blocks a run: the trajectory gets reward
0, `reward_error` says why, and the stage counts it (`ptrain.envs.safety`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ptrain.rollout.protocol import RolloutEngine, SamplingParams

TRAJECTORY_FINISH = ("stop", "length", "abort", "turn_limit", "token_limit", "error")
"""Why an episode ended: the policy stopped; a sample hit max_new_tokens or the context;
the engine aborted it; the environment's turn or token budget ran out; the environment
failed (its reason is in `Trajectory.error`)."""


@dataclass(frozen=True)
class Task:
    """One episode's starting point, as the environment made it."""

    env: str
    """Name of the environment that made the task (its metrics are reported under it)."""
    id: str
    """Stable id within the environment and split (audit records, pass@k, resume)."""
    messages: tuple[Mapping[str, Any], ...]
    """The chat the policy sees first (role/content dicts, tools declared by the env)."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """What the verifier needs (answer, hidden tests, target, ...); never shown to the policy."""


@dataclass(frozen=True)
class Turn:
    """One step of an episode, for the audit log (JSONL) and for replay."""

    role: Literal["policy", "tool", "env"]
    """Who produced the tokens: the policy (sampled), a tool call's result, or the env (user)."""
    start: int
    """First token of this turn in `Trajectory.token_ids`."""
    end: int
    """One past its last token."""
    text: str = ""
    """The turn as text (decoded policy tokens; the rendered tool or env message)."""
    tool: str | None = None
    """Tool name of a tool result turn."""
    arguments: Mapping[str, Any] | None = None
    """Parsed arguments of that tool call."""
    exit_code: int | None = None
    """Exit code of a sandboxed tool (python, bash)."""
    duration_s: float = 0.0
    """Wall time of the tool call or of the policy's generation."""
    error: str | None = None
    """A malformed or unknown tool call, or a failing tool: what went wrong."""


@dataclass(frozen=True)
class TokenCounts:
    """Token accounting of one episode, in the three tiers API providers price."""

    prompt_uncached: int = 0
    """Prompt tokens the engine computed (prefilled)."""
    prompt_cached: int = 0
    """Prompt tokens served from the engine's prefix cache."""
    output: int = 0
    """Tokens the policy generated."""


@dataclass(frozen=True)
class Trajectory:
    """One scored episode: token ids, masks and engine log-probs aligned one to one."""

    task: Task
    sample_index: int
    """Which of the task's n samples (a GRPO group is the n samples of one task)."""
    token_ids: tuple[int, ...]
    """The whole episode: prompt, then every policy and environment turn."""
    prompt_length: int
    """Tokens before the first policy token."""
    loss_mask: tuple[int, ...]
    """1 where token_ids[i] was sampled by the policy, else 0 (same length as token_ids)."""
    logprobs: tuple[float, ...]
    """Engine log-prob of token_ids[i] where loss_mask is 1, else 0 (same length)."""
    reward: float
    reward_components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of the reward (they sum to `reward`)."""
    finish_reason: str = "stop"
    """One of TRAJECTORY_FINISH."""
    reward_error: str | None = None
    """Why the reward is 0 when the reward code raised, hung or returned garbage."""
    error: str | None = None
    """Why the environment failed (finish_reason "error")."""
    masked: bool = False
    """The environment says the reward is no measurement (its judge did not answer, its
    sandbox died: NeMo Gym's mask_sample): an RL stage neither trains on the sample nor counts
    its reward in the group's baseline; `reward_error` says why."""
    failure_kind: str | None = None
    """What went wrong in scoring, as a short low-cardinality name (NeMo Gym's failure_kind,
    e.g. judge_failed), masked or not; metrics count episodes per kind."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Per-episode numbers the environment reports (turns, tool calls, correct, ...)."""
    turns: tuple[Turn, ...] = ()
    weight_versions: tuple[str, ...] = ()
    """Weight versions the policy's tokens were sampled with, in order."""
    tokens: TokenCounts = field(default_factory=TokenCounts)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory of task {self.task.id!r}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"logprobs ({len(self.logprobs)}) must have the same length"
            )
        if not 0 <= self.prompt_length <= n:
            raise ValueError(
                f"trajectory of task {self.task.id!r}: prompt_length {self.prompt_length} outside [0, {n}]"
            )

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (policy and environment turns)."""
        return len(self.token_ids) - self.prompt_length

    def audit_record(self) -> dict[str, Any]:
        """A JSON-ready record of the episode (the audit log's line)."""
        return {
            "env": self.task.env,
            "task_id": self.task.id,
            "sample": self.sample_index,
            "reward": self.reward,
            "reward_components": dict(self.reward_components),
            "finish_reason": self.finish_reason,
            "reward_error": self.reward_error,
            "error": self.error,
            "metrics": dict(self.metrics),
            "weight_versions": list(self.weight_versions),
            "tokens": dataclasses.asdict(self.tokens),
            "turns": [_turn_record(t) for t in self.turns],
            **({"masked": True} if self.masked else {}),
            **({"failure_kind": self.failure_kind} if self.failure_kind is not None else {}),
        }


def _turn_record(turn: Turn) -> dict[str, Any]:
    """A turn's fields, leaving out optional ones at their defaults (start 0 and exit code 0 stay)."""
    return {
        f.name: getattr(turn, f.name)
        for f in dataclasses.fields(turn)
        if f.default is dataclasses.MISSING or getattr(turn, f.name) != f.default
    }


SPLITS = ("train", "eval")


class TaskSplits:
    """`tasks(split, seed=)` over a kind's `make_tasks(seed)` (train and eval lists, built once
    per seed), and `task(...)`, which gives a task its environment name and an id
    '<split>-<index>'. Environment kinds build on it; it needs `self.name`."""

    name: str

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        """(train, eval) tasks for `seed`: disjoint and deterministic."""
        raise NotImplementedError

    def tasks(self, split: str, *, seed: int) -> Sequence[Task]:
        """The tasks of split "train" or "eval" (Environment.tasks), built once per seed."""
        if split not in SPLITS:
            raise ValueError(f"environment {self.name!r}: unknown split {split!r}; pass one of {', '.join(SPLITS)}")
        built = self.__dict__.setdefault("_task_splits", {})
        if seed not in built:
            built[seed] = self.make_tasks(int(seed))
        train, held = built[seed]
        return train if split == "train" else held

    def task(self, split: str, index: int, messages: Sequence[Mapping[str, Any]], data: Mapping[str, Any]) -> Task:
        """A Task of this environment with id '<split>-<index>'."""
        return Task(env=self.name, id=f"{split}-{index}", messages=tuple(dict(m) for m in messages), data=dict(data))


def is_correct(t: Trajectory) -> bool:
    """Whether an episode solved its task. The environment's judged value (the `correct`
    metric, 1 = right) decides, whatever reward it is scaled to (countdown pays 0.9 for it);
    without that metric, a `correct` reward component of at least 1, else any positive reward."""
    if "correct" in t.metrics:
        return float(t.metrics["correct"]) >= 1.0
    return float(t.reward_components.get("correct", 1.0 if t.reward > 0 else 0.0)) >= 1.0


@runtime_checkable
class Environment(Protocol):
    """What a stage needs of an environment kind (`ptrain.envs.registry` builds them)."""

    name: str
    """The environment's name in metrics (its config's `name`, default the kind)."""

    def tasks(self, split: str, *, seed: int) -> Sequence[Task]:
        """The tasks of a split ("train" or "eval"), deterministic given the seed."""
        ...

    async def rollout(self, task: Task, engine: RolloutEngine, sampling: SamplingParams) -> list[Trajectory]:
        """`sampling.n` scored episodes of one task. Many run at once (asyncio); an
        environment never blocks the event loop (reward code and tools run off it)."""
        ...
