"""The `countdown` environment: reach a target with the given numbers and + - * / ( ).

As in TinyZero's Countdown (after Jiayi Pan): 3 or 4 numbers and a target; the policy
answers with an expression in <answer>...</answer>, e.g. `<answer>(95 - 11) / 4 + 2</answer>`.
Each given number may be used at most once (as often as it is given), or exactly once with
options.use_all_numbers.

The expression is never evaluated as Python: a recursive-descent parser accepts only
decimal integers, the four operators and parentheses (no unary minus, no exponent, no
names), at most options.max_answer_chars characters and 32 levels of parentheses, and the
value is computed with exact rationals (`fractions.Fraction`), so 7 / 2 * 2 is 7 and a
division by zero is a wrong answer, not an exception. Anything else (`__import__('os')`,
`2 ** 99999`, `1e9`) is malformed: no format reward either.

Every task is built by combining some of its numbers with random operations until the
value is an integer in [min_target, max_target], so each task has a solution
(task.data["solution"], never shown to the policy). `demonstration(task)` writes that
solution's steps, innermost first (`95 - 11 = 84`, `84 / 4 = 21`, ...), as reasoning, then the
expression in <answer></answer>.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, draw_distinct, extract_tag

MAX_DEPTH = 32
"""Deepest parenthesis nesting the parser accepts."""
MAX_LITERAL_DIGITS = 12
"""Longest integer literal the parser accepts (no given number is longer)."""


class ExpressionError(ValueError):
    """The answer is not an expression of integers, + - * / and parentheses."""


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in " \t\n":
            i += 1
        elif "0" <= ch <= "9":
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"number at {i} has more than {MAX_LITERAL_DIGITS} digits")
            out.append(text[i:j])
            i = j
        elif ch in "+-*/()":
            out.append(ch)
            i += 1
        else:
            raise ExpressionError(f"unexpected character {ch!r} at {i}; only digits, + - * / ( ) are allowed")
    return out


class _Parser:
    """expr := term (('+' | '-') term)* ; term := factor (('*' | '/') factor)* ;
    factor := INTEGER | '(' expr ')'. Builds (op, left, right) / ('num', n) tuples."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExpressionError("the expression ends early")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> tuple:
        node = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            node = (op, node, self.term(depth))
        return node

    def term(self, depth: int) -> tuple:
        node = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            node = (op, node, self.factor(depth))
        return node

    def factor(self, depth: int) -> tuple:
        tok = self.take()
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            node = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("a '(' is not closed")
            return node
        if tok.isdigit():
            return ("num", int(tok))
        raise ExpressionError(f"expected a number or '(', got {tok!r}")


def parse_expression(text: str, max_chars: int = 256) -> tuple:
    """The expression tree of `text` (ExpressionError when it is not a countdown expression)."""
    if len(text) > max_chars:
        raise ExpressionError(f"answer of {len(text)} characters, more than {max_chars}")
    tokens = _tokens(text)
    if not tokens:
        raise ExpressionError("the answer is empty")
    parser = _Parser(tokens)
    node = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return node


def literals(node: tuple) -> list[int]:
    """The integers an expression tree uses, left to right."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n[0] == "num":
            out.append(n[1])
        else:
            stack.extend((n[2], n[1]))
    return out


def evaluate(node: tuple) -> Fraction:
    """Exact value of an expression tree; ZeroDivisionError on a division by zero."""
    if node[0] == "num":
        return Fraction(node[1])
    a, b = evaluate(node[1]), evaluate(node[2])
    op = node[0]
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def numbers_allowed(used: list[int], numbers: list[int], use_all: bool) -> bool:
    """Whether `used` takes each given number at most as often as given (exactly, with use_all)."""
    have, want = Counter(numbers), Counter(used)
    if use_all:
        return have == want
    return all(want[k] <= have[k] for k in want)


def judge_countdown(expression: str, data: dict[str, Any]) -> float:
    """1.0 when `expression` uses allowed numbers and equals data["target"] exactly, else 0.0."""
    try:
        node = parse_expression(expression, data.get("max_answer_chars", 256))
    except ExpressionError:
        return 0.0
    if not numbers_allowed(literals(node), list(data["numbers"]), bool(data.get("use_all_numbers", False))):
        return 0.0
    try:
        value = evaluate(node)
    except ZeroDivisionError:
        return 0.0
    return 1.0 if value == data["target"] else 0.0


def _number_text(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def steps(node: tuple) -> list[str]:
    """The operations of an expression tree in the order they are computed, each as
    `a op b = value` (ZeroDivisionError on a division by zero)."""
    out: list[str] = []

    def walk(n: tuple) -> Fraction:
        if n[0] == "num":
            return Fraction(n[1])
        a, b = walk(n[1]), walk(n[2])
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[n[0]]
        if value is None:
            raise ZeroDivisionError(f"{_number_text(a)} / 0")
        out.append(f"{_number_text(a)} {n[0]} {_number_text(b)} = {_number_text(value)}")
        return value

    walk(node)
    return out


def make_problem(rng: random.Random, o: Any) -> tuple[list[int], int, str] | None:
    """(numbers, target, a solution) drawn with options `o`, or None when this draw missed."""
    k = rng.randint(o.min_numbers, o.max_numbers)
    numbers = [rng.randint(o.min_value, o.max_value) for _ in range(k)]
    used = k if o.use_all_numbers else rng.randint(2, k)
    items = [(Fraction(v), str(v)) for v in rng.sample(numbers, used)]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b != 0 and a % b == 0 and b != 1 else [])
        op = rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        items = [x for n, x in enumerate(items) if n not in (i, j)] + [(value, f"({ea} {op} {eb})")]
    value, expr = items[0]
    if value.denominator != 1 or not o.min_target <= value <= o.max_target:
        return None
    return numbers, int(value), expr[1:-1] if expr.startswith("(") else expr


def prompt_text(numbers: list[int], target: int, use_all: bool) -> str:
    """The question of one task, with the answer format."""
    rule = "each number exactly once" if use_all else "each number at most once"
    return (
        f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. You may use "
        f"+, -, *, / and parentheses, {rule}. Think it through, then give only the expression inside "
        "<answer></answer> tags, for example <answer>(1 + 2) * 3</answer>."
    )


class CountdownEnv(SingleTurnEnv):
    """Countdown tasks (options: CountdownOptions)."""

    kind = "countdown"
    judge = staticmethod(judge_countdown)

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval
        drawn = draw_distinct(
            lambda: make_problem(rng, o),
            lambda got: (tuple(sorted(got[0])), got[1]),
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct countdown tasks with targets "
                f"in [{o.min_target}, {o.max_target}]; widen the target range or lower n_train / n_eval"
            ),
        )

        def make(split: str, problems) -> list[Task]:
            out = []
            for i, (numbers, target, solution) in enumerate(problems):
                data = {
                    "numbers": numbers,
                    "target": target,
                    "solution": solution,
                    "use_all_numbers": o.use_all_numbers,
                    "max_answer_chars": o.max_answer_chars,
                }
                out.append(self.task(split, i, self.user(prompt_text(numbers, target, o.use_all_numbers)), data))
            return out

        held, train = drawn[: self.cfg.n_eval], drawn[self.cfg.n_eval :]
        return make("train", train), make("eval", held)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the solution's steps `</think><answer>` the solution `</answer>`."""
        d = task.data
        solution = d["solution"]
        if judge_countdown(solution, dict(d)) != 1.0:
            raise ValueError(
                f"env {self.name} task {task.id}: the stored solution {solution!r} does not reach {d['target']} "
                f"with {list(d['numbers'])}; the task's data is inconsistent"
            )
        reasoning = f"Reach {d['target']} with {list(d['numbers'])}.\n" + "\n".join(steps(parse_expression(solution)))
        return [{"role": "assistant", "content": f"<think>{reasoning}</think><answer>{solution}</answer>"}]

    def extract(self, task: Task, text: str) -> str | None:
        answer = extract_tag(text)
        if answer is None:
            return None
        try:
            parse_expression(answer, self.options.max_answer_chars)
        except ExpressionError:
            return None
        return answer
