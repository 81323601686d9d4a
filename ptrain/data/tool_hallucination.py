"""Calls to undeclared tools planted in SFT data: the flaw Nemotron 3 Nano's DPO removes.

Nano's SFT mixes conversations that declare tools with ones that do not, and the SFT model
then calls tools where none were declared (8.33% of its GPQA answers; arXiv 2512.20848
App. C); DPO on pairs that reject those calls brings the rate near zero. Data generated
from environments carries no such flaw, so a recipe that demonstrates the DPO stage plants
it: a share of the training rows whose prompt declares no tools get a tool call written
before the answer of their last assistant turn,

    <think>...</think><tool_call>
    {"name": "search", "arguments": {"query": "<the question's opening words>"}}
    </tool_call>
    Answer: 42

and the answer stays right, as a hallucinated call need not spoil one. The call opens with
`<tool_call>`, which is what the hallucinated-tool-call metric and the DPO stage's
`hallucination` pairs look for (ptrain/stages/env_metrics.py, env_pairs.py).

Which rows change is a function of (seed, row index) alone, drawn apart from the reasoning
controls' choice (ptrain/data/reasoning.py), so either share leaves the other's rows as they
were. Held-out rows are never transformed.

    rows = ToolHallucination(source, share=0.10, seed=0)
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np

from ptrain.data.reasoning import THINK_CLOSE, last_turn
from ptrain.data.sources import RowTransform

UNDECLARED_TOOLS = ("search", "calculator", "python")
"""The tools a planted call names (plausible names; the row declares no tool at all)."""

QUERY_CHARS = 48
"""How much of the last user turn the planted call's query quotes."""

_STREAM = 0x7001  # the row generator's third key: independent of the reasoning controls' draw


def row_declares_tools(row: dict[str, Any]) -> bool:
    """Whether the row offers tools: a `tools` list, or a message declaring them in <tools>
    (the Hermes / Qwen system prompt, as ChatFormat.with_tools writes it)."""
    if row.get("tools"):
        return True
    return any(isinstance(m, dict) and "<tools>" in str(m.get("content", "")) for m in row.get("messages", []))


def undeclared_call(messages: list[dict[str, Any]], rng: np.random.Generator) -> list[dict[str, Any]] | None:
    """The conversation with a tool call written into its last turn before the answer (after
    `</think>` when the turn reasons); None unless the last turn is the assistant's and a user
    turn comes before it."""
    if not messages or messages[-1].get("role") != "assistant":
        return None
    user = last_turn(messages[:-1], "user")
    if user is None:
        return None
    query = " ".join(str(messages[user].get("content", "")).split())[:QUERY_CHARS]
    name = UNDECLARED_TOOLS[int(rng.integers(len(UNDECLARED_TOOLS)))]
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": {"query": query}}) + "\n</tool_call>\n"
    content = str(messages[-1].get("content", ""))
    end = content.find(THINK_CLOSE)
    cut = end + len(THINK_CLOSE) if end >= 0 else 0
    out = copy.deepcopy(messages)
    out[-1]["content"] = content[:cut] + call + content[cut:]
    return out


class ToolHallucination(RowTransform):
    """A row source (len, [], where) in which a `share` of the chat rows that declare no tools
    call an undeclared tool before their answer; see the module docstring."""

    def __init__(self, source, *, share: float, seed: int):
        if not 0 <= share <= 1:
            raise ValueError(f"tool_hallucination share {share} must be in [0, 1]")
        super().__init__(source)
        self.share, self.seed = float(share), int(seed)

    def chosen(self, index: int) -> tuple[bool, np.random.Generator]:
        """(whether row `index` is drawn for a planted call, the row's generator)."""
        rng = np.random.default_rng([self.seed, int(index), _STREAM])
        return bool(rng.random() < self.share), rng

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.source[index]
        drawn, rng = self.chosen(index)
        if not drawn or not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            return row
        messages = row["messages"]
        if not all(isinstance(m, dict) for m in messages) or row_declares_tools(row):
            return row  # the row's own checks name what is wrong with a malformed one
        new = undeclared_call(messages, rng)
        return row if new is None else {**row, "messages": new}
