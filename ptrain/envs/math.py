"""The `math` environment: a final answer, checked for equivalence by math-verify.

The answer is read from the completion's last \\boxed{...} (inside the last <answer> tag
when there is one), else from the last <answer>...</answer> itself. It is compared with the
reference by `math_verify` (parse both, then verify: numbers, fractions, expressions, sets,
intervals, equations, so 0.75, 3/4 and \\frac{6}{8} all match \\frac{3}{4}).

math-verify bounds its own work with `signal.alarm`, which only works on a process's main
thread (called from any other thread it raises, and verl's scores silently became 0).
Here its timeouts are switched off, and the comparison runs on a worker process of
`ptrain.envs.safety` instead, which kills it after env.reward_timeout_s: a comparison that
hangs (`9^{9^{9^{9}}}` against 1 runs for minutes in sympy) scores 0 with the reason kept,
and a correct answer scores 1 from whatever thread the environment runs on.

Tasks: generated families (options.families: linear equations, fraction arithmetic, word
problems from templates) or JSONL rows {"question", "answer"} (options.path), optionally with
"solution", the working that reaches the answer.

`demonstration(task)` writes the SFT row of a task: the working as reasoning (a generated
task's computation, kept in task.data["solution"] and never shown to the policy), then the
answer in the prompt's format.

answer_format think_answer asks for DeepSeek-R1-Zero's template, reasoning in <think></think>
and then the answer in <answer></answer>: the `format` component pays only a completion of
exactly that shape (R1's format reward), while correctness is graded from any answer found.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, extract_tag

_BOXED = ("\\boxed", "\\fbox")

THINK_ANSWER = re.compile(
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*", re.DOTALL
)
"""DeepSeek-R1's completion shape (answer_format think_answer): one <think> block, then one
<answer> block, nothing around them but whitespace."""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`) in text; None if none."""
    best, name = -1, ""
    for cmd in _BOXED:
        at = text.rfind(cmd)
        if at > best:
            best, name = at, cmd
    if best < 0:
        return None
    i = best + len(name)
    if i < len(text) and text[i] == " ":  # \boxed 5
        j = i + 1
        while j < len(text) and not text[j].isspace() and text[j] not in "$":
            j += 1
        return text[i + 1 : j].strip() or None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip() or None
        j += 1
    return None  # unbalanced: the completion was cut inside the box


def extract_math_answer(text: str) -> str | None:
    """The final answer of a completion (module docstring), or None."""
    tagged = extract_tag(text)
    boxed = last_boxed(tagged if tagged is not None else text)
    if boxed is not None:
        return boxed
    return tagged or None


@lru_cache(maxsize=4096)
def _parse(answer: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # Boxed, so the LaTeX extractor takes the whole answer; the expression extractor reads
    # plain forms (0.75, 3/4). parsing_timeout=None: no signal.alarm (module docstring).
    return parse(
        f"\\boxed{{{answer}}}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
    )


def judge_math(answer: str, reference: str) -> float:
    """1.0 when math-verify finds `answer` equivalent to `reference`, else 0.0 (runs in a
    worker process: no timeout of its own)."""
    from math_verify import verify

    gold = _parse(str(reference))
    if not gold:
        raise ValueError(f"the reference answer {reference!r:.80} does not parse as math; fix the task's answer")
    pred = _parse(answer)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


# ----------------------------------------------------------------------------- generated tasks


def latex_number(x: Fraction) -> str:
    """An integer as digits, a fraction as \\frac{p}{q} (sign in front)."""
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _plain(x: Fraction) -> str:
    """A number as plain text: 7, -7/3."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _linear(rng: random.Random) -> tuple[str, str, str]:
    a = rng.choice([-1, 1]) * rng.randint(2, 12)
    b = rng.randint(-40, 40)
    c = rng.randint(-60, 60)
    x = Fraction(c - b, a)
    lhs = f"{'-' if a < 0 else ''}{abs(a)}x"
    if b:
        lhs += f" {'+' if b > 0 else '-'} {abs(b)}"
    steps = [f"{lhs} = {c}."]
    if b:
        steps.append(f"{'Subtract' if b > 0 else 'Add'} {abs(b)}: {a}x = {c - b}.")
    divisor = f"({a})" if a < 0 else str(a)
    steps.append(f"Divide by {a}: x = {c - b} / {divisor} = {_plain(x)}.")
    return f"Solve for x: {lhs} = {c}.", latex_number(x), " ".join(steps)


def _fractions(rng: random.Random) -> tuple[str, str, str]:
    p, q = rng.randint(1, 12), rng.randint(2, 12)
    r, s = rng.randint(1, 12), rng.randint(2, 12)
    op = rng.choice(["+", "-", "\\times", "\\div"])
    x, y = Fraction(p, q), Fraction(r, s)
    value = {"+": x + y, "-": x - y, "\\times": x * y, "\\div": x / y}[op]
    if op in ("+", "-"):
        top = p * s + r * q if op == "+" else p * s - r * q
        steps, last = f"{p}/{q} {op} {r}/{s} = {p * s}/{q * s} {op} {r * q}/{q * s}", f"{top}/{q * s}"
    elif op == "\\times":
        steps, last = f"{p}/{q} * {r}/{s}", f"{p * r}/{q * s}"
    else:
        steps, last = f"{p}/{q} / ({r}/{s}) = {p}/{q} * {s}/{r}", f"{p * s}/{q * r}"
    lowest = _plain(value)
    return (
        f"Compute $\\frac{{{p}}}{{{q}}} {op} \\frac{{{r}}}{{{s}}}$. Give the result as a fraction in lowest terms "
        "(or an integer).",
        latex_number(value),
        f"{steps} = {last}" + (f" = {lowest}." if lowest != last else "."),
    )


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")


def _word(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.randrange(5)
    name = rng.choice(_NAMES)
    if kind == 0:
        a, d = rng.randint(12, 60), rng.randint(2, 9)
        s = rng.randint(1, a * d - 1)
        q = (
            f"A bakery bakes {a} loaves of bread every day for {d} days and sells {s} of them. "
            "How many loaves are left?"
        )
        return q, str(a * d - s), f"Baked: {a} * {d} = {a * d}. Left: {a * d} - {s} = {a * d - s}."
    if kind == 1:
        a, b, c = rng.randint(5, 50), rng.randint(2, 9), rng.randint(3, 15)
        g = rng.randint(1, a + b * c - 1)
        q = (
            f"{name} has {a} marbles, buys {b} bags of {c} marbles each, then gives away {g} marbles. "
            f"How many marbles does {name} have now?"
        )
        steps = (
            f"Bought: {b} * {c} = {b * c}. Then {a} + {b * c} = {a + b * c}, and {a + b * c} - {g} = {a + b * c - g}."
        )
        return q, str(a + b * c - g), steps
    if kind == 2:
        v, h, w, k = rng.randint(40, 120), rng.randint(1, 6), rng.randint(40, 120), rng.randint(1, 6)
        q = (
            f"A train runs at {v} km per hour for {h} hours, then at {w} km per hour for {k} hours. "
            "How many kilometres does it cover in total?"
        )
        steps = f"{v} * {h} = {v * h} km, then {w} * {k} = {w * k} km. Total: {v * h} + {w * k} = {v * h + w * k}."
        return q, str(v * h + w * k), steps
    if kind == 3:
        p, c, m, n = rng.randint(8, 30), rng.randint(3, 15), rng.randint(1, 9), rng.randint(1, 9)
        q = (
            f"A museum ticket costs {p} dollars for an adult and {c} dollars for a child. How many dollars do "
            f"{m} adults and {n} children pay together?"
        )
        steps = (
            f"Adults: {m} * {p} = {p * m}. Children: {n} * {c} = {c * n}. Total: {p * m} + {c * n} = {p * m + c * n}."
        )
        return q, str(p * m + c * n), steps
    n, k, e = rng.randint(2, 9), rng.randint(3, 20), rng.randint(1, 9)
    q = (
        f"{n} friends share {n * k} stickers equally, then each gets {e} more from their teacher. "
        "How many stickers does each friend have now?"
    )
    return q, str(k + e), f"Each gets {n * k} / {n} = {k}, then {k} + {e} = {k + e}."


FAMILIES = {"linear": _linear, "fractions": _fractions, "word": _word}
"""Generated family -> (rng -> (question, reference answer, the working that reaches it))."""


def check_row(row: dict[str, Any]) -> str | None:
    """What is wrong with a JSONL row's question or answer, or None. A null or empty answer
    would be the reference "None" or nothing, which no completion matches."""
    if not isinstance(row["question"], str) or not row["question"].strip():
        return f"question must be a non-empty string, got {row['question']!r}"
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        return f"answer must be a non-empty string (or a number), got {answer!r}"
    solution = row.get("solution")
    if solution is not None and (not isinstance(solution, str) or "think>" in solution):
        return (
            "solution (optional: the working, for demonstrations) must be a string without <think> tags, got "
            f"{solution!r:.80}"
        )
    return None


class MathEnv(SingleTurnEnv):
    """Math problems with a final answer (options: MathOptions)."""

    kind = "math"
    warm_modules = ("math_verify",)
    judge = staticmethod(judge_math)

    def instruction(self) -> str:
        if self.options.answer_format == "boxed":
            return "Put your final answer in \\boxed{}."
        if self.options.answer_format == "think_answer":
            return "Reason inside <think></think> tags, then put your final answer inside <answer></answer> tags."
        return "Put your final answer inside <answer></answer> tags."

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        if o.path is not None:
            train_rows, held_rows = self.row_splits(o.path, o.eval_path, ("question", "answer"), check_row)
        else:
            rng = random.Random(seed)
            need = self.cfg.n_train + self.cfg.n_eval
            seen: set[str] = set()
            rows: list[dict[str, Any]] = []
            misses = 0
            while len(rows) < need:
                family = o.families[rng.randrange(len(o.families))]
                question, answer, working = FAMILIES[family](rng)
                if question in seen:
                    misses += 1
                    if misses > 100 * need + 10000:
                        raise ValueError(
                            f"envs.{self.name}: found only {len(rows)} of {need} distinct generated problems in "
                            f"families {o.families}; lower n_train / n_eval or add families"
                        )
                    continue
                seen.add(question)
                rows.append({"question": question, "answer": answer, "family": family, "solution": working})
            held_rows, train_rows = rows[: self.cfg.n_eval], rows[self.cfg.n_eval :]

        def make(split: str, rows: list[dict[str, Any]]) -> list[Task]:
            out = []
            for i, row in enumerate(rows):
                data = {"answer": str(row["answer"]), **({"family": row["family"]} if "family" in row else {})}
                if "id" in row:
                    data["row_id"] = row["id"]
                if row.get("solution") is not None:
                    data["solution"] = row["solution"]
                content = f"{row['question']}\n\n{self.instruction()}"
                out.append(self.task(split, i, self.user(content), data))
            return out

        return make("train", train_rows), make("eval", held_rows)

    def extract(self, task: Task, text: str) -> str | None:
        return extract_math_answer(text)

    def follows_format(self, task: Task, text: str) -> bool:
        return self.options.answer_format != "think_answer" or THINK_ANSWER.fullmatch(text) is not None

    def judge_args(self, task: Task, answer: str) -> tuple:
        return (answer, task.data["answer"])

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the working `</think>` the reference answer in the prompt's format
        (\\boxed{...} or <answer>...</answer>). A generated task's working is its computation;
        a JSONL row's is its optional "solution" field, else one sentence stating the answer."""
        answer = str(task.data["answer"])
        working = task.data.get("solution") or f"The answer to this question is {answer}."
        if self.options.answer_format == "boxed":
            final = f"\\boxed{{{answer}}}"
        else:
            final = f"<answer>{answer}</answer>"
        if extract_math_answer(final) != answer.strip():
            raise ValueError(
                f"env {self.name} task {task.id}: the reference answer {answer!r:.80} does not come back out of "
                f"{final!r:.80} (unbalanced braces?); fix the task's answer"
            )
        return [{"role": "assistant", "content": f"<think>{working}</think>{final}"}]
