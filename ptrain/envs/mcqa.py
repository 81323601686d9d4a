"""The `mcqa` environment: multiple-choice questions with one right option, answered by letter.

A scaled-down, locally generated stand-in for Nemotron 3 Nano's MCQA environment (NeMo Gym's
`mcqa` resources server, whose default grading is strict_single_letter_boxed). Each question
has 2 to 10 options lettered A to J, exactly one of them right, and the policy answers with
that letter in \\boxed{}:

    What is 47 * 12?

    A) 564
    B) 554
    C) 574
    D) 611

    ... \\boxed{A}

Extraction takes the last `\\boxed{...}` of the completion (after any reasoning) and accepts a
single capital letter in it, optionally in brackets (`\\boxed{ [C] }`), that names one of the
question's options; anything else (no box, `\\boxed{564}`, `\\boxed{AB}`, a letter past the
last option, "The answer is A" without a box) is unformatted: reward 0, the judge is not
called. The judge compares the letter with the right one.

Questions come from families (options.families, MCQA_FAMILIES), each built so that exactly
one option is right and the options are distinct:

    arithmetic       a + b, a - b or a * b; distractors near the result and off-by-one products
    unit_conversion  km/m, kg/g, hours/minutes, feet/inches, ... in either direction
    comparison       the largest or smallest of some decimals with 1-3 places
    prime            the one prime among odd composites that are not multiples of 5
    letter_count     how often a letter occurs in a word
    alphabetical     which word comes first in alphabetical order

`demonstration(task)` works the question out from its stem and options (the sum column by
column, the conversion factor, the decimals in order, a factor of every composite, the
letter's positions, the words sorted), names the option that holds the result, and answers
with its letter in \\boxed{}.

A question's stem decides the split: no stem (with its option set, for the families whose
options are the question) is in both train and eval. The eval tasks are drawn first, so the
held-out split does not change with n_train.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from ptrain.config.env_verifiable import MCQA_MAX_CHOICES
from ptrain.data.tasks import Problem, worked_solution
from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, draw_distinct

LETTERS = "ABCDEFGHIJ"[:MCQA_MAX_CHOICES]
"""Option letters, in order."""
BOX = "\\boxed{"

Question = tuple[str, str, list[str], str]
"""(stem, right option, candidate distractors or exactly the wrong options, split key)."""

WORDS = (
    "apple", "banana", "cherry", "strawberry", "mississippi", "committee", "balloon", "bookkeeper",
    "address", "assessment", "coffee", "parallel", "necessary", "occurrence", "success",
    "tomorrow", "umbrella", "excellence", "possession", "referee", "engineer", "pepper", "bubble",
    "giraffe", "kangaroo", "elephant", "chocolate", "dinosaur", "penguin", "alligator", "butterfly",
    "harmony", "lantern", "meadow", "orchard", "pyramid", "quartz", "raccoon", "saddle", "teapot",
    "velvet", "walrus", "yogurt", "zeppelin", "acorn", "beacon", "candle", "dolphin", "ember",
    "falcon", "glacier", "horizon", "island", "jungle", "kettle", "lemon", "marble", "nectar",
    "oyster", "pebble", "quill", "ribbon", "spiral", "tunnel", "violet", "willow", "anchor",
    "basket", "cactus", "desert", "engine", "forest", "garden", "hammer", "igloo", "jacket",
)  # fmt: skip
"""Words of the letter_count and alphabetical questions (distinct)."""
UNITS = (
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("centimeters", "millimeters", 10),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("feet", "inches", 12),
    ("yards", "feet", 3),
)
"""(larger unit, smaller unit, how many of the smaller make one larger)."""
SINGULAR = {"feet": "foot", "inches": "inch"}
"""Unit names whose singular is not the plural without its s."""
FACTORS = sorted({f for _, _, f in UNITS} | {1, 2, 5, 36, 100, 3600})
"""Factors that make a unit_conversion distractor: the result of a wrong conversion."""


def _near(value: int, spread: int) -> list[int]:
    """Integers within `spread` of value, value itself excluded, none negative."""
    return [value + d for d in range(-spread, spread + 1) if d and value + d >= 0]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n**0.5) + 1))


def _arithmetic(rng: random.Random, n: int) -> Question:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(12, 99), rng.randint(3, 19)
        c = a * b
        pool = _near(c, 12) + [a * (b + 1), a * (b - 1), (a + 1) * b, (a - 1) * b, c + 10, c - 10]
    else:
        a, b = rng.randint(100, 999), rng.randint(10, 999)
        if op == "-" and b > a:
            a, b = b, a
        c = a + b if op == "+" else a - b
        pool = _near(c, 9) + [c + 10, c - 10, c + 100, c - 100, c + 20, c - 20]
    stem = f"What is {a} {op} {b}?"
    return stem, str(c), [str(x) for x in pool if x >= 0], stem


def _unit_conversion(rng: random.Random, n: int) -> Question:
    big, small, f = rng.choice(UNITS)
    v = rng.randint(2, 99)
    if rng.random() < 0.5:
        stem, right = f"How many {small} are in {v} {big}?", v * f
        pool = [v * g for g in FACTORS if g != f] + _near(v * f, 6) + [v * f * 10]
    else:
        stem, right = f"How many {big} are {v * f} {small}?", v
        pool = _near(v, 8) + [v * 10, v * f] + [v * f // g for g in FACTORS if g != f and (v * f) % g == 0]
    return stem, str(right), [str(x) for x in pool if x > 0], stem


def _decimal(rng: random.Random) -> tuple[Fraction, str]:
    places = rng.randint(1, 3)
    k = rng.randint(1, 9999)
    value = Fraction(k, 10**places)
    return value, f"{k / 10**places:.{places}f}"


def _comparison(rng: random.Random, n: int) -> Question:
    values: dict[Fraction, str] = {}
    while len(values) < n:
        v, text = _decimal(rng)
        values.setdefault(v, text)
    which = rng.choice(("largest", "smallest"))
    right = values[max(values) if which == "largest" else min(values)]
    wrong = [t for t in values.values() if t != right]
    stem = f"Which of these numbers is the {which}?"
    return stem, right, wrong, stem + "|" + ",".join(sorted(values.values()))


PRIMES = [p for p in range(11, 200) if _is_prime(p)]
ODD_COMPOSITES = [m for m in range(9, 200, 2) if not _is_prime(m) and m % 5]
"""Distractors of prime questions: odd, not multiples of 5, so no last-digit shortcut."""


def _prime(rng: random.Random, n: int) -> Question:
    right = rng.choice(PRIMES)
    wrong = [str(m) for m in rng.sample(ODD_COMPOSITES, n - 1)]
    stem = "Which of these numbers is prime?"
    return stem, str(right), wrong, stem + "|" + ",".join(sorted([str(right), *wrong]))


def _letter_count(rng: random.Random, n: int) -> Question:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    right = word.count(letter)
    stem = f"How many times does the letter '{letter}' appear in the word '{word}'?"
    return stem, str(right), [str(x) for x in range(0, 13) if x != right], stem


def _alphabetical(rng: random.Random, n: int) -> Question:
    words = rng.sample(WORDS, n)
    right = min(words)
    stem = "Which of these words comes first in alphabetical order?"
    return stem, right, [w for w in words if w != right], stem + "|" + ",".join(sorted(words))


GENERATORS: dict[str, Callable[[random.Random, int], Question]] = {
    "arithmetic": _arithmetic,
    "unit_conversion": _unit_conversion,
    "comparison": _comparison,
    "prime": _prime,
    "letter_count": _letter_count,
    "alphabetical": _alphabetical,
}
"""Question family -> generator(rng, number of options)."""


def make_question(rng: random.Random, family: str, n: int) -> dict[str, Any]:
    """One question of `family` with `n` options, the right one at a random letter: a dict with
    family, question (the stem), options (texts in letter order), answer (the right letter)
    and key (what makes two questions the same, for disjoint splits)."""
    stem, right, pool, key = GENERATORS[family](rng, n)
    distinct = sorted(set(pool) - {right})
    if len(distinct) < n - 1:  # every generator gives enough; a guard against a future one
        raise ValueError(f"mcqa family {family!r} gave {len(distinct)} distractors for {n} options")
    options = [right, *rng.sample(distinct, n - 1)]
    rng.shuffle(options)
    return {
        "family": family,
        "question": stem,
        "options": options,
        "answer": LETTERS[options.index(right)],
        "key": key,
    }


def prompt_text(question: str, options: list[str]) -> str:
    """The prompt of one question: the stem, the lettered options and the answer format."""
    lines = "\n".join(f"{LETTERS[i]}) {text}" for i, text in enumerate(options))
    return (
        "Answer the following multiple-choice question. Exactly one option is right.\n\n"
        f"{question}\n\n{lines}\n\n"
        "Think it through, then end with the letter of the right option in \\boxed{}, for example \\boxed{A}."
    )


def extract_letter(text: str, n_options: int) -> str | None:
    """The letter in the last \\boxed{...} of text when it names one of the first n_options
    options (one capital letter, optionally in [] or ()), else None."""
    start = text.rfind(BOX)
    if start < 0:
        return None
    close = text.find("}", start + len(BOX))
    if close < 0:
        return None
    inner = text[start + len(BOX) : close].strip()
    if len(inner) == 3 and (inner[0], inner[2]) in (("[", "]"), ("(", ")")):
        inner = inner[1]
    inner = inner.strip()
    if len(inner) == 1 and inner in LETTERS[:n_options]:
        return inner
    return None


def _smallest_factor(n: int) -> int | None:
    return next((d for d in range(2, int(n**0.5) + 1) if n % d == 0), None)


def working(data: dict[str, Any]) -> str:
    """How to find the right option of a generated question (data: a make_question dict), up to
    the value it names; ValueError for a family or stem it does not know."""
    family, stem, options = data["family"], data["question"], data["options"]
    if family == "arithmetic":
        a, op, b = stem.removeprefix("What is ").removesuffix("?").split()
        x, y = int(a), int(b)
        if op != "*":
            *columns, _ = worked_solution(Problem(op, x, y)).split("\n")
            return "\n".join(columns) + f"\nSo {x} {op} {y} = {x + y if op == '+' else x - y}."
        if y <= 10:
            return f"{x} * {y} = {x * y}."
        return f"{x} * {y} = {x} * 10 + {x} * {y - 10} = {x * 10} + {x * (y - 10)} = {x * y}."
    if family == "unit_conversion":
        words = stem.removeprefix("How many ").removesuffix("?").split()
        into = words[1:3] == ["are", "in"]  # "How many small are in v big?", else "How many big are n small?"
        small, big = (words[0], words[-1]) if into else (words[-1], words[0])
        f = next((f for b, s, f in UNITS if (b, s) == (big, small)), None)
        if f is not None:
            n = int(words[-2])
            one = f"1 {SINGULAR.get(big, big.removesuffix('s'))} = {f} {small}"
            if into:
                return f"{one}, so {n} {big} = {n} * {f} = {n * f} {small}."
            return f"{one}, so {n} {small} = {n} / {f} = {n // f} {big}."
    if family == "comparison":
        order = sorted(options, key=Fraction)
        if "largest" in stem:
            return f"In order: {' < '.join(order)}. The largest is {order[-1]}."
        return f"In order: {' < '.join(order)}. The smallest is {order[0]}."
    if family == "prime":
        parts = []
        for text in options:
            n = int(text)
            d = _smallest_factor(n)
            parts.append(f"{text} = {d} * {n // d}" if d else f"{text} has no divisor from 2 to {int(n**0.5)}")
        prime = next(t for t in options if _is_prime(int(t)))
        return "; ".join(parts) + f". So {prime} is prime."
    if family == "letter_count":
        letter, word = stem.split("'")[1], stem.split("'")[3]
        at = [str(i + 1) for i, c in enumerate(word) if c == letter]
        where = f"position{'s' if len(at) > 1 else ''} {', '.join(at)}"
        return f"{' '.join(word)}: '{letter}' is at {where}, so {len(at)} time{'' if len(at) == 1 else 's'}."
    if family == "alphabetical":
        order = sorted(options)
        return f"Sorted: {', '.join(order)}. First: {order[0]}."
    raise ValueError(f"mcqa cannot work out a {family!r} question: {stem!r}")


def judge_mcqa(letter: str, data: dict[str, Any]) -> float:
    """1.0 when `letter` is the question's right letter, else 0.0."""
    return 1.0 if isinstance(letter, str) and letter == data["answer"] else 0.0


class McqaEnv(SingleTurnEnv):
    """Generated multiple-choice questions (options: McqaOptions)."""

    kind = "mcqa"
    judge = staticmethod(judge_mcqa)

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval
        drawn = draw_distinct(
            lambda: make_question(rng, rng.choice(o.families), rng.randint(o.min_choices, o.max_choices)),
            lambda q: q["key"],
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct questions of families "
                f"{o.families}; add families or lower n_train / n_eval"
            ),
        )

        def make(split: str, questions: list[dict[str, Any]]) -> list[Task]:
            return [
                self.task(split, i, self.user(prompt_text(q["question"], q["options"])), q)
                for i, q in enumerate(questions)
            ]

        return make("train", drawn[self.cfg.n_eval :]), make("eval", drawn[: self.cfg.n_eval])

    def extract(self, task: Task, text: str) -> str | None:
        return extract_letter(text, len(task.data["options"]))

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the working (`working`) and the option it points to `</think>` the
        right letter in \\boxed{}."""
        d = task.data
        letter = d["answer"]
        right = d["options"][LETTERS.index(letter)]
        steps = working(dict(d))
        if right not in steps:
            raise ValueError(
                f"env {self.name} task {task.id}: the working of {d['question']!r} does not reach the right option "
                f"{right!r}; the task's options or answer do not match its question"
            )
        reasoning = f"{steps}\nThat is option {letter}) {right}."
        return [{"role": "assistant", "content": f"<think>{reasoning}</think>\\boxed{{{letter}}}"}]
