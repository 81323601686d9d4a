"""Math: answer extraction (\\boxed, <answer>), equivalence by math-verify, generated and
JSONL tasks, and the signal.alarm trap: from a worker thread a correct answer scores 1 (not
0) and a comparison that hangs is cut at the timeout with a reason."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.math import extract_math_answer, judge_math, last_boxed
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

HANG = "9^{9^{9^{9}}}"
"""An answer whose comparison with 1 runs for minutes in sympy (math-verify, no timeout)."""


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so x = \\boxed{5}.", "5"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 9 is it", "9"),
        ("<answer>42</answer>", "42"),
        ("<answer>so \\boxed{3}</answer> and later \\boxed{4}", "3"),
        ("<answer> \\frac12 </answer>", "\\frac12"),
        ("no answer at all", None),
        ("\\boxed{12", None),  # cut inside the box
        ("<answer></answer>", None),
    ],
)
def test_extraction(text, answer):
    assert extract_math_answer(text) == answer


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}} end") == "\\frac{1}{\\sqrt{2}}"


@pytest.mark.parametrize(
    "answer, reference, expected",
    [
        ("0.75", "\\frac{3}{4}", 1.0),
        ("\\frac{6}{8}", "3/4", 1.0),
        ("5.0", "5", 1.0),
        ("-\\frac{29}{21}", "-\\frac{29}{21}", 1.0),
        ("x = 3", "3", 1.0),
        ("\\dfrac12", "1/2", 1.0),
        ("7", "8", 0.0),
        ("\\frac{3}{5}", "\\frac{3}{4}", 0.0),
        ("banana", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_judge_equivalence(answer, reference, expected):
    assert judge_math(answer, reference) == expected


def test_unparsable_reference_raises():
    with pytest.raises(ValueError, match="reference"):
        judge_math("3", "")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def test_generated_tasks_answer_themselves(tok):
    """Every generated family's reference answer is equivalent to itself and parses."""
    env = make_env(EnvConfig(kind="math", n_train=30, n_eval=6), tokenizer=tok)
    train, held = env.tasks("train", seed=1), env.tasks("eval", seed=1)
    assert {t.data["family"] for t in train} == {"linear", "fractions", "word"}
    assert not {t.messages[0]["content"] for t in train} & {t.messages[0]["content"] for t in held}
    for t in train[:12]:
        assert "\\boxed{}" in t.messages[0]["content"]
        assert judge_math(t.data["answer"], t.data["answer"]) == 1.0
    assert [t.data for t in train] == [t.data for t in make_env(env.cfg, tokenizer=tok).tasks("train", seed=1)]


def test_jsonl_rows_and_bad_rows(tok, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "id": f"q{i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = make_env(
        EnvConfig(kind="math", n_eval=2, options={"path": str(path), "answer_format": "answer_tag"}), tokenizer=tok
    )
    held, train = env.tasks("eval", seed=0), env.tasks("train", seed=0)
    assert [t.data["answer"] for t in held] == ["0", "2"]
    assert [t.data["row_id"] for t in train] == ["q2", "q3", "q4"]
    assert "<answer></answer>" in train[0].messages[0]["content"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": "1"}\n{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field\(s\) \['answer'\]"):
        make_env(EnvConfig(kind="math", n_eval=0, options={"path": str(bad)}), tokenizer=tok).tasks("train", seed=0)
    with pytest.raises(EnvConfigError, match="envs.math.options.path"):
        validate_env_config(EnvConfig(kind="math", options={"path": str(tmp_path / "missing.jsonl")}))


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {"question": "What is 2 + 2?", "answer": None},
            r"answer must be a non-empty string \(or a number\), got None",
        ),
        ({"question": "What is 2 + 2?", "answer": " "}, r"answer must be a non-empty string"),
        ({"question": None, "answer": "4"}, r"question must be a non-empty string, got None"),
        ({"question": ["What is 2 + 2?"], "answer": "4"}, r"question must be a non-empty string"),
    ],
)
def test_rows_with_unusable_values_name_the_line(tok, tmp_path, row, match):
    """A null answer became the reference "None", which no completion matches: every sample
    scored 0 without a reward error. A null question became the prompt "None"."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "What is 1 + 1?", "answer": 2}) + "\n" + json.dumps(row) + "\n")
    env = make_env(EnvConfig(kind="math", n_eval=0, options={"path": str(path)}), tokenizer=tok)
    with pytest.raises(ValueError, match=r"rows.jsonl:2: " + match):
        env.tasks("train", seed=0)


def test_a_file_that_is_not_utf8_names_the_line(tok, tmp_path):
    """It was ptrain: error: 'utf-8' codec can't decode byte 0x89 ..., naming no file."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps({"question": "q", "answer": "1"}).encode() + b"\n\x89PNG\n")
    env = make_env(EnvConfig(kind="math", n_eval=0, options={"path": str(path)}), tokenizer=tok)
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not UTF-8 text"):
        env.tasks("train", seed=0)


def test_worker_thread_scores_correct_one_and_cuts_a_hang(tok):
    """verl's trap: math-verify's signal.alarm raises off the main thread and every score
    silently became 0. Here, from a worker thread: the right answer scores 1, the wrong 0,
    the hanging comparison is cut at the timeout with a reason, and the rest are unaffected."""
    env = make_env(EnvConfig(kind="math", n_train=3, n_eval=0, reward_timeout_s=3.0), tokenizer=tok)
    try:
        task = env.task("train", 0, env.user("What is 1/2 + 1/4?"), {"answer": "\\frac{3}{4}"})
        answers = ["\\boxed{0.75}", "\\boxed{5}", f"\\boxed{{{HANG}}}", "<answer>3/4</answer>"]
        result: dict = {}

        def worker():
            engine = ReplayEngine(answers, tokenizer=tok)
            start = time.monotonic()
            result["out"] = asyncio.run(env.rollout(task, engine, SamplingParams(n=4, max_new_tokens=64)))
            result["wall"] = time.monotonic() - start

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
        out = result["out"]
        assert [t.reward for t in out] == [1.0, 0.0, 0.0, 1.0]
        assert out[2].reward_error is not None and "timeout" in out[2].reward_error
        assert out[2].metrics["reward_error"] == 1.0
        assert [t.reward_error for t in (out[0], out[1], out[3])] == [None, None, None]
        assert env.stats["reward_errors"] == 1
        assert env.runner.stats["timeout"] == 1
        assert result["wall"] < 60
        # The worker that hung was replaced: the next judgement works.
        again = asyncio.run(env.rollout(task, ReplayEngine(["\\boxed{3/4}"], tokenizer=tok), SamplingParams(n=1)))
        assert again[0].reward == 1.0
    finally:
        env.close()


def test_think_answer_pays_format_only_for_r1s_shape(tok):
    """answer_format think_answer (DeepSeek-R1-Zero's template): the prompt asks for the
    reasoning in <think></think> and then the answer in <answer></answer>; the format reward is
    paid only for exactly that shape, and the answer is graded for correctness either way."""
    env = make_env(
        EnvConfig(
            kind="math",
            n_train=4,
            n_eval=0,
            options={"answer_format": "think_answer", "format_reward": 1.0, "correct_reward": 1.0},
        ),
        tokenizer=tok,
    )
    try:
        (task, *_) = env.tasks("train", seed=0)
        assert "<think></think>" in task.messages[0]["content"] and "<answer></answer>" in task.messages[0]["content"]
        (demo,) = env.demonstration(task)
        right, wrong = task.data["answer"], "-987654"
        texts = [
            demo["content"],  # what SFT would teach: both parts
            f"<think>so</think>\n<answer>{wrong}</answer>\n",  # the shape, a wrong answer
            f"<answer>{right}</answer>",  # right, no reasoning block
            f"<think>a</think><think>b</think><answer>{right}</answer>",  # two reasoning blocks
            f"<think>so</think><answer>{right}</answer> trailing words",
            "<think>no answer</think>",
        ]
        out = asyncio.run(env.rollout(task, ReplayEngine(texts, tokenizer=tok), SamplingParams(n=len(texts))))
        got = [(t.reward_components["format"], t.reward_components["correct"]) for t in out]
        assert got == [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 0.0)]
        assert [t.metrics["formatted"] for t in out] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    finally:
        env.close()
    with pytest.raises(EnvConfigError, match="'boxed', 'answer_tag', 'think_answer'"):
        validate_env_config(EnvConfig(kind="math", options={"answer_format": "think"}))
