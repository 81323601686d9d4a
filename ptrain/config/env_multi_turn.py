"""Options of the multi-turn environment kinds: tool_use, long_horizon, terminal.

    env:
      kind: tool_use
      n_train: 512
      options:
        tools: [calculator, python, read_file, list_files, search]
        max_turns: 6
        invalid_call_penalty: 0.5

The fields every environment shares (name, n_train, n_eval, seed, reward_timeout_s, ...)
live in `ptrain.config.env.EnvConfig`; these dataclasses are the kinds' `options`, which
`validate_env_config` builds and checks (EnvConfigError names `envs.<name>.options.<key>`).
The tool loop's limits are in `MultiTurnOptions`, which each kind extends. Sandboxed tools
(python, bash) and test runs use the stage's sandbox (`make_env(..., sandbox=)`).

Jax-free, like the rest of ptrain.config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ptrain.config.env_options import MAX_TIMEOUT_S, EnvConfigError, register_options

TOOL_NAMES = ("python", "bash", "calculator", "read_file", "write_file", "list_files", "search")
"""Tools a multi-turn kind may declare (ptrain/envs/tools.py builds them)."""
TOOL_USE_FAMILIES = ("calculator", "file", "search", "python")
"""tool_use task families: arithmetic too long to do by heart; a sum over a CSV file in the
workspace; a fact from the search corpus; a number that takes a small program to compute."""
FAMILY_TOOLS = {"calculator": "calculator", "file": "read_file", "search": "search", "python": "python"}
"""The tool each tool_use family needs."""
LONG_HORIZON_CONSTRAINTS = ("end_word", "no_letter", "brackets")
"""long_horizon rules that every answer after them must keep: end with a given word; never
use a given letter; wrap the whole answer in square brackets."""
TERMINAL_FAMILIES = ("off_by_one", "wrong_operator", "boundary", "missing_case", "wrong_default")
"""terminal bug families of the generated module (its tests show the bug)."""


def _fail(where: str, key: str, msg: str) -> None:
    raise EnvConfigError(f"config key '{where}.{key}': {msg}")


def _int_at_least(opts: Any, where: str, key: str, lo: int) -> None:
    value = getattr(opts, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        _fail(where, key, f"must be an integer >= {lo}, got {value!r}")


SANDBOX_MARGIN_S = 10.0
"""Wall seconds the tool runner's sandbox allows past a command's own timeout (tools.tool_sandbox)."""


def _seconds(opts: Any, where: str, key: str) -> None:
    """A command's timeout: > 0, and short enough that the sandbox's limit (it plus the margin)
    stays within a day."""
    value, most = getattr(opts, key), MAX_TIMEOUT_S - SANDBOX_MARGIN_S
    if not 0 < value <= most:
        _fail(where, key, f"must be > 0 and at most {most:g} seconds, got {value!r}")


def _non_negative(opts: Any, where: str, *keys: str) -> None:
    for key in keys:
        if not getattr(opts, key) >= 0:
            _fail(where, key, f"must be >= 0, got {getattr(opts, key)!r}")


def _subset(opts: Any, where: str, key: str, allowed: tuple[str, ...], *, empty_ok: bool = False) -> None:
    values = list(getattr(opts, key))
    bad = [v for v in values if v not in allowed]
    if bad or (not values and not empty_ok):
        _fail(where, key, f"unknown {bad}; pick {'zero' if empty_ok else 'one'} or more of {', '.join(allowed)}")
    if len(set(values)) != len(values):
        _fail(where, key, f"names repeat in {values}")


@dataclass
class MultiTurnOptions:
    """The tool loop's limits and where its episodes are kept (shared by the three kinds)."""

    max_turns: int = 8
    """Policy turns per episode at most (>= 1). An episode that still calls tools, or that the
    environment would answer again, after its last turn ends with finish_reason turn_limit."""
    max_episode_tokens: int = 2048
    """Tokens per episode at most, prompt and every turn together (>= 2). Each policy turn's
    max_new_tokens is cut to what is left (the engine's context length caps it too); an
    episode that runs out ends with finish_reason token_limit."""
    max_tool_calls_per_turn: int = 4
    """Tool calls run per policy turn (>= 1); calls past it are answered with an error and
    counted as invalid."""
    max_tool_output_chars: int = 2000
    """Characters of one tool result the policy sees (>= 100); the rest is cut with a note."""
    tool_timeout_s: float = 10.0
    """Wall seconds (> 0) one sandboxed tool call (python, bash) may run; then it is killed
    and its output so far comes back with a note."""
    invalid_call_penalty: float = 0.0
    """Taken from the reward of an episode with at least one malformed or unknown tool call,
    or one whose arguments do not fit the tool (>= 0; reward component invalid_tool_call).
    The GRPO stage can instead set such a trajectory's advantage
    (algo.grpo.invalid_tool_call_advantage; Nemotron 3 uses -5)."""
    workspace_mb: int = 4
    """Size cap of an episode's workspace files in MiB (>= 1)."""
    episode_dir: str | None = None
    """Folder of per-episode checkpoints (one JSON file each, rewritten after every turn);
    a rollout given a folder holding an unfinished episode resumes it without re-running
    its recorded tool calls. null: no checkpoints (the stage sets one per rollout batch)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3."""

    def validate(self, where: str) -> None:
        """EnvConfigError naming `<where>.<key>` for a value the loop cannot use."""
        _int_at_least(self, where, "max_turns", 1)
        _int_at_least(self, where, "max_episode_tokens", 2)
        _int_at_least(self, where, "max_tool_calls_per_turn", 1)
        _int_at_least(self, where, "max_tool_output_chars", 100)
        _int_at_least(self, where, "workspace_mb", 1)
        _seconds(self, where, "tool_timeout_s")
        _non_negative(self, where, "invalid_call_penalty")


@register_options("tool_use")
@dataclass
class ToolUseOptions(MultiTurnOptions):
    """tool_use: generated questions whose answers need a tool (answered as `Answer: ...`)."""

    max_turns: int = 6
    max_episode_tokens: int = 4096
    families: list[str] = field(default_factory=lambda: list(TOOL_USE_FAMILIES))
    """Task families, in turn (TOOL_USE_FAMILIES); each needs its tool in `tools`."""
    tools: list[str] = field(default_factory=lambda: ["calculator", "python", "read_file", "list_files", "search"])
    """Tools declared to the policy (TOOL_NAMES), the same for every task of the environment."""
    corpus_path: str | None = None
    """JSONL search corpus ({"id", "title", "text", "facts"} per line); null: the bundled one
    (ptrain/envs/data/corpus.jsonl). The search family asks about its documents' facts."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for the right final answer."""

    def validate(self, where: str) -> None:
        super().validate(where)
        _subset(self, where, "families", TOOL_USE_FAMILIES)
        _subset(self, where, "tools", TOOL_NAMES)
        if self.corpus_path is not None and not os.path.isfile(self.corpus_path):
            _fail(
                where, "corpus_path", f"no file '{self.corpus_path}'; pass a JSONL corpus, or null for the bundled one"
            )
        missing = sorted({FAMILY_TOOLS[f] for f in self.families} - set(self.tools))
        if missing:
            _fail(where, "tools", f"{self.tools} lacks {missing}, which families {self.families} need")
        _non_negative(self, where, "correct_reward")


@register_options("long_horizon")
@dataclass
class LongHorizonOptions(MultiTurnOptions):
    """long_horizon: keep a running total over tens of turns under a rule stated early."""

    max_turns: int = 40
    max_episode_tokens: int = 8192
    steps: int = 20
    """Numbers the environment gives, one per turn (>= 1). The episode has steps + 2 policy
    turns (the starting total, one per number, the final total), so max_turns >= steps + 2."""
    constraint_turn: int = 0
    """When the rule is stated: 0 in the first message; k in [1, steps] with the k-th number
    (a rule from turn k must still hold in the final answer, tens of turns later)."""
    constraints: list[str] = field(default_factory=lambda: list(LONG_HORIZON_CONSTRAINTS))
    """Rules drawn from, in turn (LONG_HORIZON_CONSTRAINTS)."""
    max_step: int = 20
    """Numbers given are in [1, max_step] (>= 1)."""
    correct_reward: float = 0.5
    """Reward component `correct` (>= 0) for the right final total."""
    constraint_reward: float = 0.3
    """Reward component `constraint` (>= 0) for a final answer that keeps the rule."""
    steps_reward: float = 0.2
    """Reward component `steps` (>= 0): times the fraction of the other answers that are right
    (and keep the rule once it was stated)."""
    tools: list[str] = field(default_factory=list)
    """Tools declared to the policy; none by default (the task is memory, not lookup)."""

    def validate(self, where: str) -> None:
        super().validate(where)
        _subset(self, where, "constraints", LONG_HORIZON_CONSTRAINTS)
        _subset(self, where, "tools", TOOL_NAMES, empty_ok=True)
        _int_at_least(self, where, "steps", 1)
        _int_at_least(self, where, "max_step", 1)
        if not 0 <= self.constraint_turn <= self.steps:
            _fail(where, "constraint_turn", f"must be in [0, steps={self.steps}], got {self.constraint_turn}")
        if self.max_turns < self.steps + 2:
            _fail(where, "max_turns", f"{self.max_turns} is below steps + 2 = {self.steps + 2} (the starting "
                  "total, one answer per number, the final total); raise it or lower steps")  # fmt: skip
        _non_negative(self, where, "correct_reward", "constraint_reward", "steps_reward")


@register_options("terminal")
@dataclass
class TerminalOptions(MultiTurnOptions):
    """terminal: fix a generated repository's bug with a bash tool; its own tests decide."""

    max_turns: int = 12
    max_episode_tokens: int = 4096
    families: list[str] = field(default_factory=lambda: list(TERMINAL_FAMILIES))
    """Bug families, in turn (TERMINAL_FAMILIES)."""
    tools: list[str] = field(default_factory=lambda: ["bash"])
    """Tools declared to the policy (TOOL_NAMES); bash is required."""
    tests_reward: float = 1.0
    """Reward component `tests_passed` (>= 0) when the repository's tests all pass after the
    episode (the original test files are put back first, so editing them does not help)."""
    format_reward: float = 0.1
    """Reward component `format` (>= 0) for an episode that the policy ended itself (a final
    answer without a tool call) with no invalid call."""
    test_timeout_s: float = 30.0
    """Wall seconds (> 0) of the final test run."""

    def validate(self, where: str) -> None:
        super().validate(where)
        _subset(self, where, "families", TERMINAL_FAMILIES)
        _subset(self, where, "tools", TOOL_NAMES)
        if "bash" not in self.tools:
            _fail(where, "tools", f"{self.tools}: the terminal kind needs bash")
        _seconds(self, where, "test_timeout_s")
        _non_negative(self, where, "tests_reward", "format_reward")


__all__ = [
    "FAMILY_TOOLS",
    "LONG_HORIZON_CONSTRAINTS",
    "TERMINAL_FAMILIES",
    "TOOL_NAMES",
    "TOOL_USE_FAMILIES",
    "LongHorizonOptions",
    "MultiTurnOptions",
    "TerminalOptions",
    "ToolUseOptions",
]
