"""Reasoning on/off and thinking budgets in SFT data, as Nemotron 3 Nano trains them.

An assistant turn writes its reasoning in `<think>...</think>` and then its answer. Nano's
SFT (arXiv 2512.20848 §3.1) teaches two controls with two transforms of the training rows:

- **reasoning off** (share `strip`, Nano 0.10): the reasoning is removed, leaving
  `<think></think>` and the answer. At inference a prompt whose generation prompt ends in
  `<think></think>` then gets an answer without reasoning.
- **budget** (share `budget`, Nano 0.03): the reasoning is cut to its first N tokens, N
  drawn uniformly below its length, the answer kept, and the last user turn states the
  budget as Nano's template does (`\\n\\n{thinking token budget: N}`). At inference the engine
  forces `</think>` when N reasoning tokens are spent (`SamplingParams.thinking_budget`),
  and the model has seen answers follow cut reasoning.

Which rows change is a function of (seed, row index) alone, so a resumed stage and every
process see the same data. Rows whose last assistant turn holds no closed `<think>` block
are left as they are. Held-out rows are never transformed.

    rows = ReasoningControls(source, tokenizer, strip=0.10, budget=0.03, seed=0)
    rows[i]                                    # source[i], maybe transformed
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ptrain.data.sources import RowTransform

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def budget_tag(budget: int) -> str:
    """What Nano's template appends to the last user turn to state a thinking budget."""
    return f"\n\n{{thinking token budget: {int(budget)}}}"


def split_reasoning(content: str) -> tuple[str, str, str] | None:
    """(text before <think>, the reasoning, the answer after </think>) of an assistant turn,
    or None when it holds no closed <think> block."""
    start = content.find(THINK_OPEN)
    end = content.find(THINK_CLOSE, start + len(THINK_OPEN)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return content[:start], content[start + len(THINK_OPEN) : end], content[end + len(THINK_CLOSE) :]


def join_reasoning(head: str, reasoning: str, answer: str) -> str:
    return f"{head}{THINK_OPEN}{reasoning}{THINK_CLOSE}{answer}"


def last_turn(messages: list[dict[str, Any]], role: str) -> int | None:
    """The index of the last message of `role`, or None."""
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == role), None)


def reasoning_off(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with the last assistant turn's reasoning removed; None if it has none."""
    a = last_turn(messages, "assistant")
    parts = split_reasoning(str(messages[a].get("content", ""))) if a is not None else None
    if parts is None:
        return None
    out = copy.deepcopy(messages)
    out[a]["content"] = join_reasoning(parts[0], "", parts[2])
    return out


def reasoning_budget(
    messages: list[dict[str, Any]], tokenizer, rng: np.random.Generator
) -> list[dict[str, Any]] | None:
    """The conversation with the last assistant turn's reasoning cut to a budget N drawn
    uniformly in [1, its token count - 1], and N stated in the last user turn before it.
    None when there is no reasoning of at least two tokens or no user turn to state N in."""
    a = last_turn(messages, "assistant")
    parts = split_reasoning(str(messages[a].get("content", ""))) if a is not None else None
    u = last_turn(messages[:a], "user") if a is not None else None
    if parts is None or u is None:
        return None
    ids = tokenizer.encode(parts[1], add_special_tokens=False)
    if len(ids) < 2:
        return None
    n = int(rng.integers(1, len(ids)))
    out = copy.deepcopy(messages)
    out[a]["content"] = join_reasoning(parts[0], tokenizer.decode(ids[:n]), parts[2])
    out[u]["content"] = str(out[u].get("content", "")) + budget_tag(n)
    return out


class ReasoningControls(RowTransform):
    """A row source (len, [], where) whose chat rows carry the reasoning-off and budget
    transforms at the given shares; see the module docstring."""

    def __init__(self, source, tokenizer, *, strip: float, budget: float, seed: int):
        if not (0 <= strip and 0 <= budget and strip + budget <= 1):
            raise ValueError(f"reasoning shares strip={strip} budget={budget} must be >= 0 with a sum <= 1")
        super().__init__(source)
        self.tokenizer = tokenizer
        self.strip, self.budget, self.seed = float(strip), float(budget), int(seed)

    def choice(self, index: int) -> tuple[str, np.random.Generator]:
        """("off" | "budget" | "keep", the row's generator) for row `index`."""
        rng = np.random.default_rng([self.seed, int(index)])
        u = rng.random()
        return ("off" if u < self.strip else "budget" if u < self.strip + self.budget else "keep"), rng

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.source[index]
        what, rng = self.choice(index)
        if what == "keep" or not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            return row
        messages = row["messages"]
        if not all(isinstance(m, dict) for m in messages):
            return row  # the row's own checks name what is wrong with it
        new = reasoning_off(messages) if what == "off" else reasoning_budget(messages, self.tokenizer, rng)
        return row if new is None else {**row, "messages": new}
