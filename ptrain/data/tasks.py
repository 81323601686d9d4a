"""The embedded task: multi-digit arithmetic with worked solutions and verifiable answers.

A problem is `a op b` with op in {+, -, *}. The assistant's answer works column by
column from the right, one line per column, and ends with `Answer: <n>`:

    What is 347 + 589?
    7+9+0=16 c1 6          column digits + carry in = sum, carry out, result digits so far
    4+8+1=13 c1 36
    3+5+1=9 c0 936
    Answer: 936

Subtraction (a >= b, so the result is never negative) writes the borrowed digit:
`17-9-0=8 b1 8` means 7 - 9 - 0 needs a borrow, 17 - 9 = 8, borrow 1 into the next
column. Multiplication (multi-digit times one digit) writes `7*6+0=42 c4 2`.

Why this format: a tiny decoder cannot add 3-digit numbers "in its head", but it can
learn each line, since every line only needs two operand digits, the previous line's
carry and a copy of the previous partial result. The answer line is a copy of the last
partial result (with the last carry in front and leading zeros dropped).

Records (one JSON object per line) carry the verification metadata in `task`, so the
same files feed SFT (messages), evaluation and RL (prompt + expected answer):

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}],
     "task": {"kind": "arithmetic", "op": "+", "a": 347, "b": 589, "answer": "936"}}

Preference records (DPO) pair the correct worked solution with a plausible wrong one
(a dropped carry or borrow, or one column's digit off by one), with the same prompt:

    {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}],
     "rejected": [{"role": "assistant", ...}], "task": {...}}

The verifier lives here too, beside the format it reads: `check_answer` grades a
completion's final `Answer: n` against the task metadata a row carries; evaluation,
on-policy DPO pairs and the arithmetic environment (ptrain.envs.arithmetic_env) call it.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

ANSWER_PREFIX = "Answer:"
"""What precedes the final answer in a worked solution."""
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


def extract_answer(completion: str) -> str | None:
    """The integer after the last `Answer:` in completion, normalised ('007' -> '7'); None if absent."""
    found = _ANSWER_RE.findall(completion)
    if not found:
        return None
    if len(found[-1]) > 4000:
        # int() refuses strings past 4300 digits, and a completion can hold them; no task's
        # answer is that long, so the text as it stands grades the same.
        return found[-1]
    return str(int(found[-1]))


def check_answer(task: dict[str, Any], completion: str) -> bool:
    """True when completion's final `Answer: n` equals the task's expected answer."""
    got = extract_answer(completion)
    return got is not None and got == str(int(task["answer"]))


@dataclass(frozen=True)
class Problem:
    op: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    def metadata(self) -> dict[str, Any]:
        return {"kind": "arithmetic", "op": self.op, "a": self.a, "b": self.b, "answer": str(self.answer)}


# --------------------------------------------------------------------------- solutions


def _width(p: Problem) -> int:
    """Columns of the worked solution: the longer operand (the multi-digit one for *)."""
    return len(str(p.a)) if p.op == "*" else max(len(str(p.a)), len(str(p.b)))


def _digits_rev(n: int, width: int) -> list[int]:
    """Decimal digits of n, least significant first, zero-padded to width."""
    return [(n // 10**i) % 10 for i in range(width)]


def worked_solution(p: Problem, fault: tuple[str, int] | None = None) -> str:
    """The column-by-column solution text of p, ending in `Answer: <n>`.

    fault: None for the correct solution, or (kind, column) to inject one plausible slip
    that propagates like a real one: ("carry", i) drops the carry (or borrow) out of
    column i; ("digit", i) writes column i's result digit one too high (wrapping 9 -> 8).
    """
    width = _width(p)
    xs = _digits_rev(p.a, width)
    ys = _digits_rev(p.b, width) if p.op != "*" else [p.b] * width
    lines, partial, carry = [], "", 0
    for i in range(width):
        x, y = xs[i], ys[i]
        if p.op == "-":
            r = x - y - carry
            out = 1 if r < 0 else 0
            r += 10 * out
            lhs, total = f"{x + 10 * out}-{y}-{carry}", r
            flag = "b"
        else:
            total = x + y + carry if p.op == "+" else x * y + carry
            r, out = total % 10, total // 10
            lhs = f"{x}{p.op}{y}+{carry}" if p.op == "+" else f"{x}*{y}+{carry}"
            flag = "c"
        if fault == ("carry", i):
            out = 0
        if fault == ("digit", i):
            r = r + 1 if r < 9 else 8
        partial = f"{r}{partial}"
        lines.append(f"{lhs}={total} {flag}{out} {partial}")
        carry = out
    # A leftover carry (+, *) leads the number. Subtraction has a >= b, so its last borrow
    # is 0 (a dropped borrow only makes the result larger).
    full = (str(carry) if carry and p.op != "-" else "") + partial
    answer = full.lstrip("0") or "0"
    lines.append(f"{ANSWER_PREFIX} {answer}")
    return "\n".join(lines)


def _faults(p: Problem) -> list[tuple[str, int]]:
    """Faults that change the final answer of p (dropping a zero carry changes nothing)."""
    correct = str(p.answer)
    out = []
    for kind in ("carry", "digit"):
        for i in range(_width(p)):
            if extract_answer(worked_solution(p, (kind, i))) != correct:
                out.append((kind, i))
    return out


# --------------------------------------------------------------------------- generation


def _draw(rng: random.Random, ops: Sequence[str], min_digits: int, max_digits: int) -> Problem:
    op = ops[rng.randrange(len(ops))]
    nd = rng.randint(min_digits, max_digits)
    a = rng.randint(10 ** (nd - 1) if nd > 1 else 0, 10**nd - 1)
    if op == "*":
        return Problem(op, a, rng.randint(2, 9))
    nb = rng.randint(min_digits, max_digits)
    b = rng.randint(10 ** (nb - 1) if nb > 1 else 0, 10**nb - 1)
    if op == "-" and b > a:
        a, b = b, a
    return Problem(op, a, b)


def _space_size(ops: Sequence[str], min_digits: int, max_digits: int) -> int:
    """Upper bound on distinct problems for these knobs (to refuse impossible requests)."""
    n_numbers = 10**max_digits - (10 ** (min_digits - 1) if min_digits > 1 else 0)
    total = 0
    for op in set(ops):
        total += n_numbers * 8 if op == "*" else n_numbers * n_numbers
    return total


def generate_problems(
    n_train: int,
    n_eval: int,
    *,
    ops: Sequence[str] = ("+", "-"),
    min_digits: int = 2,
    max_digits: int = 3,
    seed: int = 0,
) -> tuple[list[Problem], list[Problem]]:
    """Draw n_eval held-out then n_train training problems, all distinct, deterministically.

    The held-out set is drawn first, so it does not change when n_train changes.
    """
    need = n_train + n_eval
    space = _space_size(ops, min_digits, max_digits)
    if need > space // 2:
        # Drawing distinct problems by rejection stays quick up to half of the space.
        raise ValueError(
            f"at most {space // 2} distinct problems are drawn for ops={list(ops)} digits {min_digits}..{max_digits} "
            f"(half of the about {space} there are); n_train + n_eval = {need} is too many. Lower "
            "data.generated.n_train or raise data.generated.max_digits"
        )
    rng = random.Random(seed)
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < need:
        p = _draw(rng, ops, min_digits, max_digits)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out[n_eval:], out[:n_eval]


def chat_record(p: Problem, fault: tuple[str, int] | None = None) -> dict[str, Any]:
    """SFT / eval / RL record: user question, assistant worked solution, task metadata. With
    `fault` the solution holds that slip (a noisy demonstration); the metadata keeps the
    correct answer and names the fault."""
    task = p.metadata() if fault is None else {**p.metadata(), "fault": f"{fault[0]}@{fault[1]}"}
    return {
        "messages": [
            {"role": "user", "content": p.question()},
            {"role": "assistant", "content": worked_solution(p, fault)},
        ],
        "task": task,
    }


def preference_record(p: Problem, rng: random.Random) -> dict[str, Any]:
    """DPO record: same prompt, chosen = correct solution, rejected = one plausible slip."""
    faults = _faults(p)
    fault = faults[rng.randrange(len(faults))]
    return {
        "prompt": [{"role": "user", "content": p.question()}],
        "chosen": [{"role": "assistant", "content": worked_solution(p)}],
        "rejected": [{"role": "assistant", "content": worked_solution(p, fault)}],
        "task": {**p.metadata(), "fault": f"{fault[0]}@{fault[1]}"},
    }


def generate_records(
    n_train: int,
    n_eval: int,
    *,
    kind: str = "chat",
    ops: Sequence[str] = ("+", "-"),
    min_digits: int = 2,
    max_digits: int = 3,
    seed: int = 0,
    noise: float = 0.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records of kind 'chat' (SFT) or 'preference' (DPO), deterministic in all
    arguments. noise: share of chat training records whose worked solution holds one slip."""
    train, held = generate_problems(n_train, n_eval, ops=ops, min_digits=min_digits, max_digits=max_digits, seed=seed)
    if kind == "chat":
        rng = random.Random(seed + 2)

        def noisy(p: Problem) -> dict[str, Any]:
            faults = _faults(p) if noise and rng.random() < noise else []
            return chat_record(p, faults[rng.randrange(len(faults))] if faults else None)

        return [noisy(p) for p in train], [chat_record(p) for p in held]
    if kind == "preference":
        rng = random.Random(seed + 1)
        return [preference_record(p, rng) for p in train], [preference_record(p, rng) for p in held]
    raise ValueError(f"unknown record kind '{kind}'; pass chat or preference")


def write_jsonl(records: Iterable[dict[str, Any]], path: str, *, if_changed: bool = False) -> str:
    """Write records one JSON object per line (atomically: temp file, then rename).

    if_changed: leave an existing file with exactly this content untouched.
    """
    text = "".join(json.dumps(r, ensure_ascii=False, separators=(", ", ": ")) + "\n" for r in records)
    data = text.encode("utf-8")
    if if_changed and os.path.isfile(path) and os.path.getsize(path) == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def sample_text(n: int = 2000, seed: int = 1234) -> list[str]:
    """Task text (questions and solutions, all ops, 1-4 digits) to train the embedded tokenizer on.

    Independent of the run's task knobs, so the tokenizer is the same for every run.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = _draw(rng, ("+", "-", "*"), 1, 4)
        out.append(p.question())
        out.append(worked_solution(p))
    return out
