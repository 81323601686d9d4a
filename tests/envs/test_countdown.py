"""Countdown: the expression parser (never eval), exact rational scoring, number use,
adversarial answers, task generation (deterministic, solvable, disjoint splits), rewards."""

from __future__ import annotations

import asyncio
from fractions import Fraction
from types import SimpleNamespace

import pytest

from ptrain.config.env import CountdownOptions, EnvConfig
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.countdown import (
    CountdownEnv,
    ExpressionError,
    evaluate,
    judge_countdown,
    literals,
    make_problem,
    parse_expression,
)
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

DATA = {"numbers": [3, 5, 2, 7], "target": 16, "use_all_numbers": False, "max_answer_chars": 256}


@pytest.mark.parametrize(
    "text, value",
    [
        ("(3 + 5) * 2", 16),
        ("3 + 5 * 2", 13),
        ("7 / 2 * 2", 7),  # exact: 3.5 * 2, not integer division
        ("((7))", 7),
        ("7 - 5 - 2", 0),  # left associative
        ("12 / 3 / 2", 2),
        (" 3\n+\t5 ", 8),
    ],
)
def test_parser_values(text, value):
    assert evaluate(parse_expression(text)) == Fraction(value)


def test_rationals_are_exact():
    assert evaluate(parse_expression("1 / 3 + 1 / 3 + 1 / 3")) == 1
    assert evaluate(parse_expression("2 / 3")) == Fraction(2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo hacked')",
        "2 ** 99999",
        "9 ^ 9",
        "1e9",
        "3.5 + 1",
        "-3 + 5",  # no unary minus
        "(3 + 5",
        "3 + 5)",
        "3 5",
        "",
        "3 +",
        "abs(3)",
        "3 + 5 = 8",
        "٣ + 5",  # a non-ASCII digit
        "1" * 13,  # longer than any given number
        "(" * 40 + "3" + ")" * 40,  # nesting past the limit
    ],
)
def test_malformed_answers_are_refused_unevaluated(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)
    assert judge_countdown(text, DATA) == 0.0


def test_overlong_answer_is_refused_before_parsing():
    text = "+".join(["3"] * 200)
    with pytest.raises(ExpressionError, match="characters"):
        parse_expression(text, max_chars=256)


def test_judge_right_wrong_and_number_use():
    assert judge_countdown("(3 + 5) * 2", DATA) == 1.0
    assert judge_countdown("2 * (5 + 3)", DATA) == 1.0
    assert judge_countdown("3 + 5 + 2", DATA) == 0.0  # wrong value
    assert judge_countdown("(3 + 5) * 2 * 1", DATA) == 0.0  # 1 is not given
    assert judge_countdown("(5 + 3) * 2 + 7 - 7", DATA) == 0.0  # 7 used twice
    assert judge_countdown("16", DATA) == 0.0  # the target is not a given number
    assert judge_countdown("7 / (5 - 5)", DATA) == 0.0  # division by zero: wrong, no exception
    assert judge_countdown("(3 + 5) / (7 - 7)", DATA) == 0.0
    twice = {**DATA, "numbers": [8, 8, 3], "target": 16}
    assert judge_countdown("8 + 8", twice) == 1.0  # a number given twice may be used twice
    exact = {**DATA, "use_all_numbers": True}
    assert judge_countdown("(3 + 5) * 2", exact) == 0.0  # 7 unused
    assert judge_countdown("(3 + 5) * 2 + 7 - 7", exact) == 0.0
    assert judge_countdown("(7 - 5 + 3 + 3) * 2", {**exact, "numbers": [7, 5, 3, 3, 2]}) == 1.0
    assert literals(parse_expression("(3 + 5) * 2")) == [3, 5, 2]


def test_generated_problems_are_solvable_and_in_range():
    import random

    o = CountdownOptions()
    rng = random.Random(0)
    found = 0
    for _ in range(300):
        got = make_problem(rng, o)
        if got is None:
            continue
        numbers, target, solution = got
        found += 1
        assert o.min_numbers <= len(numbers) <= o.max_numbers
        assert all(o.min_value <= n <= o.max_value for n in numbers)
        assert o.min_target <= target <= o.max_target
        data = {"numbers": numbers, "target": target}
        assert judge_countdown(solution, data) == 1.0, (numbers, target, solution)
    assert found > 50


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def test_tasks_deterministic_disjoint_and_say_the_format(tok):
    cfg = EnvConfig(kind="countdown", n_train=40, n_eval=10)
    a = make_env(cfg, tokenizer=tok)
    b = make_env(cfg, tokenizer=tok)
    train, held = a.tasks("train", seed=3), a.tasks("eval", seed=3)
    assert [t.data for t in train] == [t.data for t in b.tasks("train", seed=3)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=4)]
    assert len(train) == 40 and len(held) == 10
    key = lambda t: (tuple(sorted(t.data["numbers"])), t.data["target"])  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in held}
    assert len({key(t) for t in train}) == 40
    text = train[0].messages[0]["content"]
    assert "<answer>" in text and str(train[0].data["target"]) in text
    assert "solution" not in text and train[0].data["solution"] not in text
    assert {t.id for t in held} == {f"eval-{i}" for i in range(10)}
    # The held-out split does not move when n_train changes.
    c = make_env(EnvConfig(kind="countdown", n_train=80, n_eval=10), tokenizer=tok)
    assert [t.data for t in c.tasks("eval", seed=3)] == [t.data for t in held]


def test_use_all_numbers_tasks_use_every_number(tok):
    env = make_env(EnvConfig(kind="countdown", n_train=20, n_eval=0, options={"use_all_numbers": True}), tokenizer=tok)
    for t in env.tasks("train", seed=0):
        assert sorted(literals(parse_expression(t.data["solution"]))) == sorted(t.data["numbers"])
        assert "exactly once" in t.messages[0]["content"]


def test_rewards_follow_tinyzero(tok):
    """0 without an answer, 0.1 for a well-formed wrong one, 1.0 for a right one."""
    env = make_env(EnvConfig(kind="countdown", n_train=4, n_eval=0, reward_workers=1), tokenizer=tok)
    try:
        task = env.tasks("train", seed=0)[0]
        solution = task.data["solution"]
        answers = [
            f"Let me think.\n<answer>{solution}</answer>",
            "<answer>1 + 1</answer>",
            "<answer>__import__('os').system('touch /tmp/pwned')</answer>",
            "the answer is 42",
            f"<answer>{solution}",  # unclosed tag
            "<answer>(1 + 1</answer>",
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=256)))
        assert [t.reward for t in out] == pytest.approx([1.0, 0.1, 0.0, 0.0, 0.0, 0.0])
        assert dict(out[0].reward_components) == pytest.approx({"format": 0.1, "correct": 0.9})
        assert [t.metrics["formatted"] for t in out] == [1, 1, 0, 0, 0, 0]
        assert [t.metrics["correct"] for t in out] == [1, 0, 0, 0, 0, 0]
        assert all(t.reward_error is None for t in out)
    finally:
        env.close()


def test_extract_refuses_overlong_answers(tok):
    opts = CountdownOptions(max_answer_chars=32)
    env = CountdownEnv(EnvConfig(kind="countdown"), opts, tokenizer=tok)
    task = SimpleNamespace(data=DATA)
    assert env.extract(task, "<answer>(3 + 5) * 2</answer>") == "(3 + 5) * 2"
    assert env.extract(task, "<answer>" + "+".join(["3"] * 40) + "</answer>") is None
