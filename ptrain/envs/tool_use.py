"""tool_use: multi-turn questions whose answers need a tool, with verifiable answers.

    env = make_env(EnvConfig(kind="tool_use", n_train=512), tokenizer=tok)

Families (options.families, drawn in turn), every answer computed when the task is made:
  calculator  a product-and-sum of multi-digit numbers ("What is 4817 * 293 - 77 * 61?")
  file        a CSV of orders in the workspace (data/orders_<k>.csv); the total quantity of
              one item (read_file, then add up: by hand, with the calculator or with python)
  search      a fact about a fictional town, inventor or creature of the search corpus (the
              bundled corpus is made up, so the answer is not something a model already knows)
  python      a number that takes a short program: the sum of the digits of a^b, the count of
              primes below n, the n-th Fibonacci number modulo m

The policy ends with a line `Answer: <answer>`; the reward component `correct` is
options.correct_reward when the last such line matches (numbers by value, text ignoring case,
articles and punctuation), judged in a reward worker (ptrain.envs.safety). Metrics: correct,
answered (an Answer line at all), used_tool (the family's tool was called at least once).

`demonstration(task)` is the episode a correct policy has: a turn with reasoning and one call
of the family's tool (task.data["call"], made with the task and never shown to the policy),
the tool's result as the loop appends it (the call really runs, the python one in the
sandbox), and a last turn that reads the answer off that result (the file's rows of the item
added up) and ends with `Answer: ...`. A result that does not support the answer (a file cut at
max_tool_output_chars, a corpus whose top hit misses the fact) is a ValueError, not a
demonstration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import io
import json
import math
import os
import random
import re
import shutil
import tempfile
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.multi_turn import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MultiTurnEnv,
    Score,
    final_answer,
    parse_tool_calls,
)
from ptrain.envs.tools import Corpus, ToolContext, Workspace

SYSTEM_PROMPT = (
    "You are a careful assistant with tools. Call a tool whenever a question needs exact arithmetic, a file "
    "or a fact from the reference corpus; do not guess. When you know the answer, reply without a tool call "
    "and end with a line 'Answer: <answer>'."
)
_ANSWER_RE = re.compile(r"Answer:\s*(.+)")
_ITEMS = ("bolts", "washers", "hinges", "springs", "rivets", "gaskets", "valves", "brackets")
_FACT_QUESTIONS = {
    "founded": "In what year was the town of {title} founded?",
    "population": "How many people live in the town of {title}?",
    "river": "On which river does the town of {title} lie?",
    "born": "In what year was the inventor {title} born?",
    "patents": "How many patents did the inventor {title} hold?",
    "hometown": "In which town was the inventor {title} born?",
    "length_cm": "How long, in cm, does the {title} grow?",
    "lifespan_years": "For how many years can the {title} live?",
    "first_described": "In what year was the {title} first described?",
}


def extract_answer(text: str) -> str | None:
    """The text after the last 'Answer:' of a reply (first line only, stripped), or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _normalise(text: str) -> str:
    text = re.sub(r"[^\w\s-]", " ", text.casefold())
    words = [w for w in text.split() if w not in ("the", "a", "an")]
    return " ".join(words)


def _number(text: str) -> float | None:
    m = re.fullmatch(r"\s*(-?\d[\d,]*(?:\.\d+)?)\s*[a-zA-Z%]*\s*\.?\s*", text)
    if not m:
        return None
    return float(m.group(1).replace(",", ""))


def judge_answer(reply: str, expected: str) -> float:
    """1.0 when the reply's last `Answer:` matches `expected` (numbers by value, text by
    normalised words), else 0.0. Module-level: runs in a reward worker."""
    got = extract_answer(reply)
    if got is None:
        return 0.0
    want = _number(expected)
    if want is not None:
        value = _number(got)
        return float(value is not None and math.isclose(value, want, rel_tol=0, abs_tol=1e-9))
    return float(_normalise(got) == _normalise(expected))


# ---------------------------------------------------------------------------------------- task families


def _calculator_task(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randint(1000, 9999), rng.randint(100, 999)
    c, d = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-")
    expr = f"{a} * {b} {op} {c} * {d}"
    value = a * b + (c * d if op == "+" else -c * d)
    return {"question": f"What is {expr}? Give the exact integer.", "answer": str(value), "tool": "calculator",
            "call": {"name": "calculator", "arguments": {"expression": expr}},
            "plan": "Exact arithmetic on large numbers: use the calculator."}  # fmt: skip


def _file_task(rng: random.Random, k: int) -> dict[str, Any]:
    items = rng.sample(_ITEMS, 4)
    target = items[0]
    rows, total = [], 0
    for i in range(rng.randint(8, 14)):
        item = rng.choice(items) if i else target
        qty = rng.randint(1, 60)
        total += qty if item == target else 0
        rows.append(f"{1000 + i},{item},{qty},{rng.randint(1, 90)}.{rng.randint(0, 99):02d}")
    path = f"data/orders_{k}.csv"
    content = "order_id,item,quantity,unit_price\n" + "\n".join(rows) + "\n"
    return {
        "question": f"The workspace file {path} lists orders. What is the total quantity of {target} ordered?",
        "answer": str(total),
        "tool": "read_file",
        "files": {path: content, "README.txt": "Order exports, one CSV per warehouse.\n"},
        "call": {"name": "read_file", "arguments": {"path": path}},
        "plan": f"The orders are in {path}: read it, then add up the quantities of {target}.",
        "item": target,
    }


def _search_task(rng: random.Random, corpus: Corpus) -> dict[str, Any]:
    candidates = [(d, key) for d in corpus.documents for key in d.facts if key in _FACT_QUESTIONS]
    if not candidates:
        raise ValueError(
            "the search corpus has no document with a fact the search family asks about "
            f"({', '.join(_FACT_QUESTIONS)}); add facts to its rows or drop the search family"
        )
    doc, key = rng.choice(candidates)
    question = _FACT_QUESTIONS[key].format(title=doc.title)
    return {"question": f"{question} Look it up in the reference corpus.", "answer": str(doc.facts[key]),
            "tool": "search", "call": {"name": "search", "arguments": {"query": question, "k": 1}},
            "plan": f"A fact about {doc.title}: search the corpus for it."}  # fmt: skip


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"[: min(n, 2)]
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)


def _python_spec(question: str, answer: Any, code: str, plan: str) -> dict[str, Any]:
    return {"question": question, "answer": str(answer), "tool": "python", "plan": plan,
            "call": {"name": "python", "arguments": {"code": code}}}  # fmt: skip


def _python_task(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(3, 9), rng.randint(40, 120)
        return _python_spec(
            f"What is the sum of the decimal digits of {a}**{b}?", sum(map(int, str(a**b))),
            f"print(sum(int(d) for d in str({a} ** {b})))",
            f"{a}**{b} has too many digits to add by hand: sum them in python.",
        )  # fmt: skip
    if kind == 1:
        n = rng.randint(2_000, 50_000)
        code = (
            f"n = {n}\nsieve = [True] * n\nsieve[0] = sieve[1] = False\n"
            "for p in range(2, int(n ** 0.5) + 1):\n    if sieve[p]:\n"
            "        sieve[p * p :: p] = [False] * len(range(p * p, n, p))\nprint(sum(sieve))"
        )
        return _python_spec(f"How many prime numbers are smaller than {n}?", _primes_below(n), code,
                            f"Count the primes below {n} with a sieve in python.")  # fmt: skip
    n, m = rng.randint(200, 2000), rng.randint(1000, 9999)
    x, y = 0, 1
    for _ in range(n):
        x, y = y, (x + y) % m
    return _python_spec(
        f"With F(0) = 0 and F(1) = 1, what is the Fibonacci number F({n}) modulo {m}?", x,
        f"x, y = 0, 1\nfor _ in range({n}):\n    x, y = y, (x + y) % {m}\nprint(x)",
        f"Step the Fibonacci pair {n} times modulo {m} in python.",
    )  # fmt: skip


def _blocking(coro):
    """Run a coroutine to completion from sync code, on a thread of its own when this thread
    already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ToolUseEnv(MultiTurnEnv):
    """The tool_use kind (module docstring)."""

    kind = "tool_use"
    component_names = ("correct",)
    metric_names = ("correct", "answered", "used_tool")

    def __init__(self, cfg, options, *, tokenizer, sandbox=None, runner=None):
        corpus = Corpus.load(options.corpus_path)
        self.corpus = corpus
        super().__init__(cfg, options, tokenizer=tokenizer, sandbox=sandbox, runner=runner, corpus=corpus)

    def make_tasks(self, seed: int):
        out = []
        for split, n in (("train", self.cfg.n_train), ("eval", self.cfg.n_eval)):
            rng = random.Random(f"tool_use/{split}/{seed}")
            tasks = []
            for i in range(n):
                family = self.options.families[i % len(self.options.families)]
                if family == "calculator":
                    spec = _calculator_task(rng)
                elif family == "file":
                    spec = _file_task(rng, i)
                elif family == "search":
                    spec = _search_task(rng, self.corpus)
                else:
                    spec = _python_task(rng)
                data = {"family": family, "answer": spec["answer"], "tool": spec["tool"],
                        "files": spec.get("files", {}), "call": spec["call"], "plan": spec["plan"]}  # fmt: skip
                if "item" in spec:
                    data["item"] = spec["item"]
                messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": spec["question"]}]
                tasks.append(self.task(split, i, messages, data))
            out.append(tasks)
        return out[0], out[1]

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): an assistant turn
        `<think>` plan `</think>` one tool call; the tool message the loop appends (the call is
        run, blocking); an assistant turn `<think>` what the result shows `</think>Answer: ...`.
        ValueError when the result does not give the answer."""
        return _blocking(self._demonstrate(task))

    async def _demonstrate(self, task: Task) -> list[dict[str, Any]]:
        d = task.data
        if "call" not in d:
            raise ValueError(f"env {self.name} task {task.id}: the task has no tool call to demonstrate; make it "
                             "with this environment's tasks()")  # fmt: skip
        call = d["call"]
        first = f"<think>{d['plan']}</think>{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}"
        (parsed,) = parse_tool_calls(first)
        folder = tempfile.mkdtemp(prefix="ptrain-demonstration-")
        try:
            workspace = Workspace(os.path.join(folder, "workspace"), max_bytes=self.options.workspace_mb << 20)
            await self.setup_workspace(task, workspace)
            ctx = ToolContext(workspace, self.sandbox, self.options.max_tool_output_chars, self.options.tool_timeout_s)
            result = await self._answer(parsed.to_dict(), 0, tuple(self.tools), ctx)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        output = result["output"]
        if result["error"]:
            raise ValueError(f"env {self.name} task {task.id}: the demonstration's {call['name']} call failed: "
                             f"{result['error']}")  # fmt: skip
        answer = str(d["answer"])
        reasoning = self._reading(task, output)
        return [
            {"role": "assistant", "content": first},
            {"role": "tool", "name": call["name"], "content": output},
            {"role": "assistant", "content": f"<think>{reasoning}</think>Answer: {answer}"},
        ]

    def _reading(self, task: Task, output: str) -> str:
        """What the tool's output shows, up to the answer; ValueError when it does not show it."""
        d = task.data
        answer, family = str(d["answer"]), d["family"]
        if family == "file":
            try:
                rows = list(csv.DictReader(io.StringIO(output)))
                quantities = [int(r["quantity"]) for r in rows if r.get("item") == d["item"]]
            except (KeyError, TypeError, ValueError):
                quantities = []
            if quantities and str(sum(quantities)) == answer:
                added = " + ".join(map(str, quantities)) + (f" = {answer}" if len(quantities) > 1 else "")
                return f"Quantities of {d['item']}: {added}."
        elif family == "search":
            if re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", output):
                return f"The result states it: {answer}."
        elif output.strip() == answer:
            return f"The {'calculator gives' if family == 'calculator' else 'program printed'} {answer}."
        raise ValueError(
            f"env {self.name} task {task.id}: the {d['call']['name']} result does not give the answer {answer!r} "
            f"(cut at options.max_tool_output_chars={self.options.max_tool_output_chars}?): {output[:200]!r}"
        )

    async def score(self, task, state, workspace) -> Score:
        reply = final_answer(state) if state.finish_reason == "stop" else ""
        value, reason = await self.judge(judge_answer, reply, str(task.data["answer"]))
        used = any(
            t["role"] == "tool" and t.get("tool") == task.data["tool"] and t.get("error") is None for t in state.turns
        )
        metrics = {"correct": value, "answered": float(extract_answer(reply) is not None), "used_tool": float(used)}
        return Score({"correct": self.options.correct_reward * value}, metrics, reason)


__all__ = ["SYSTEM_PROMPT", "ToolUseEnv", "extract_answer", "judge_answer"]
