"""mcqa: letter extraction from \\boxed{} (and what it refuses), the judge, every question
family (one right option, distinct options), deterministic disjoint splits, rewards through a
replayed rollout, options errors and the Hydra file."""

from __future__ import annotations

import asyncio
import os
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, register_env_configs, validate_env_config
from ptrain.config.env_verifiable import MCQA_FAMILIES, McqaOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.mcqa import (
    GENERATORS,
    LETTERS,
    WORDS,
    McqaEnv,
    _is_prime,
    extract_letter,
    judge_mcqa,
    make_question,
)
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "text, letter",
    [
        ("\\boxed{B}", "B"),
        ("Reasoning... so the answer is \\boxed{C}.", "C"),
        ("\\boxed{ [D] }", "D"),
        ("\\boxed{(A)}", "A"),
        ("\\boxed{ A }", "A"),
        ("first \\boxed{A}, on reflection \\boxed{B}", "B"),  # the last box counts
        ("<think>maybe \\boxed{A}</think> \\boxed{D}", "D"),
    ],
)
def test_extract_accepts_one_boxed_letter(text, letter):
    assert extract_letter(text, 4) == letter


@pytest.mark.parametrize(
    "text",
    [
        "",
        "B",
        "The answer is B.",  # the right letter, no format
        "Answer: B",
        "<answer>B</answer>",
        "\\boxed{b}",  # lowercase
        "\\boxed{AB}",
        "\\boxed{E}",  # past the last of 4 options
        "\\boxed{}",
        "\\boxed{564}",  # the option's text, not its letter
        "\\boxed{\\text{B}}",
        "\\boxed{B",  # unclosed
        "\\boxed{A} then \\boxed{B",  # the last box is unclosed
        "\\boxed{[B}",
        "\\boxed " + "{B}",  # not the command
    ],
)
def test_extract_refuses_everything_else(text):
    assert extract_letter(text, 4) is None


def test_extract_is_bounded_on_huge_input():
    text = "\\boxed{" * 200_000 + "x" * 1_000_000
    assert extract_letter(text, 10) is None
    assert extract_letter(text + "\\boxed{J}", 10) == "J"


def test_judge():
    data = {"answer": "C", "options": ["1", "2", "3", "4"]}
    assert judge_mcqa("C", data) == 1.0
    assert judge_mcqa("A", data) == 0.0
    assert judge_mcqa("c", data) == 0.0
    assert judge_mcqa("", data) == 0.0


def _right_text(q):
    return q["options"][LETTERS.index(q["answer"])]


@pytest.mark.parametrize("family", MCQA_FAMILIES)
def test_every_family_has_exactly_one_right_option(family):
    rng = random.Random(1)
    for n in (2, 4, 7, 10):
        for _ in range(100):
            q = make_question(rng, family, n)
            assert len(q["options"]) == n and len(set(q["options"])) == n
            assert q["answer"] in LETTERS[:n]
            right = _right_text(q)
            stem = q["question"]
            if family == "arithmetic":
                a, op, b = stem.removeprefix("What is ").removesuffix("?").split()
                value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
                assert right == str(value)
            elif family == "comparison":
                values = [Fraction(t) for t in q["options"]]
                best = max(values) if "largest" in stem else min(values)
                assert Fraction(right) == best and values.count(best) == 1
            elif family == "prime":
                primes = [t for t in q["options"] if _is_prime(int(t))]
                assert primes == [right]
            elif family == "letter_count":
                letter, word = stem.split("'")[1], stem.split("'")[3]
                assert right == str(word.count(letter))
            elif family == "alphabetical":
                assert right == min(q["options"])
            elif family == "unit_conversion":
                assert int(right) > 0
    assert set(GENERATORS) == set(MCQA_FAMILIES)
    assert len(set(WORDS)) == len(WORDS)


def test_unit_conversion_answers():
    rng = random.Random(0)
    seen = 0
    for _ in range(200):
        q = make_question(rng, "unit_conversion", 4)
        if q["question"] == "How many meters are in 5 kilometers?":
            assert _right_text(q) == "5000"
            seen += 1
        if q["question"].startswith("How many hours are ") and q["question"].endswith(" minutes?"):
            minutes = int(q["question"].split()[4])
            assert int(_right_text(q)) * 60 == minutes
            seen += 1
    assert seen


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def test_tasks_deterministic_disjoint_and_say_the_format(tok):
    cfg = EnvConfig(kind="mcqa", n_train=300, n_eval=60)
    a, b = make_env(cfg, tokenizer=tok), make_env(cfg, tokenizer=tok)
    train, held = a.tasks("train", seed=5), a.tasks("eval", seed=5)
    assert [t.data for t in train] == [t.data for t in b.tasks("train", seed=5)]
    assert [t.messages for t in train] == [t.messages for t in b.tasks("train", seed=5)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=6)]
    assert len(train) == 300 and len(held) == 60
    keys = lambda ts: {t.data["key"] for t in ts}  # noqa: E731
    assert not keys(train) & keys(held) and len(keys(train)) == 300
    assert {t.data["family"] for t in train} == set(MCQA_FAMILIES)
    letters = {t.data["answer"] for t in train}
    assert len(letters) >= 8  # the right option is not always in one place
    text = train[0].messages[0]["content"]
    assert "\\boxed{" in text and train[0].data["question"] in text
    assert all(f"{LETTERS[i]}) {o}" in text for i, o in enumerate(train[0].data["options"]))
    assert all(4 <= len(t.data["options"]) <= 10 for t in train)
    c = make_env(EnvConfig(kind="mcqa", n_train=500, n_eval=60), tokenizer=tok)
    assert [t.data for t in c.tasks("eval", seed=5)] == [t.data for t in held]


def test_choice_range_and_families_are_respected(tok):
    opts = {"families": ["prime"], "min_choices": 5, "max_choices": 5}
    env = make_env(EnvConfig(kind="mcqa", n_train=30, n_eval=5, options=opts), tokenizer=tok)
    for t in env.tasks("train", seed=0):
        assert t.data["family"] == "prime" and len(t.data["options"]) == 5


def test_rewards_through_a_replayed_rollout(tok):
    opts = {"format_reward": 0.2, "correct_reward": 0.8}
    env = make_env(EnvConfig(kind="mcqa", n_train=4, n_eval=0, reward_workers=1, options=opts), tokenizer=tok)
    try:
        task = env.tasks("train", seed=0)[0]
        right = task.data["answer"]
        wrong = next(x for x in LETTERS[: len(task.data["options"])] if x != right)
        answers = [
            f"Let me check each option.\n\\boxed{{{right}}}",
            f"\\boxed{{{wrong}}}",
            f"The answer is {right}.",  # the right letter without the format
            "",
            f"\\boxed{{{right}{right}}}",
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=256)))
        assert [t.reward for t in out] == pytest.approx([1.0, 0.2, 0.0, 0.0, 0.0])
        assert dict(out[0].reward_components) == pytest.approx({"format": 0.2, "correct": 0.8})
        assert dict(out[1].reward_components) == pytest.approx({"format": 0.2, "correct": 0.0})
        assert [t.metrics["formatted"] for t in out] == [1, 1, 0, 0, 0]
        assert [t.metrics["correct"] for t in out] == [1, 0, 0, 0, 0]
        assert all(t.reward_error is None for t in out)
    finally:
        env.close()


def test_extract_uses_the_tasks_option_count(tok):
    env = McqaEnv(EnvConfig(kind="mcqa"), McqaOptions(), tokenizer=tok)
    task = SimpleNamespace(data={"options": ["1", "2", "3", "4", "5"], "answer": "E"})
    assert env.extract(task, "\\boxed{E}") == "E"
    assert env.extract(task, "\\boxed{F}") is None


@pytest.mark.parametrize(
    "options, key",
    [
        ({"families": []}, "families"),
        ({"families": ["trivia"]}, "families"),
        ({"families": ["prime", "prime"]}, "families"),
        ({"min_choices": 1}, "min_choices"),
        ({"min_choices": 6, "max_choices": 5}, "min_choices"),
        ({"max_choices": 11}, "min_choices"),
        ({"format_reward": -0.1}, "format_reward"),
        ({"correct_reward": -1.0}, "correct_reward"),
        ({"max_choices": "5"}, "max_choices"),
        ({"n_choices": 4}, "n_choices"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.mcqa\.options\.{key}'"):
        validate_env_config(EnvConfig(kind="mcqa", options=options))


def test_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: mcqa\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        node = OmegaConf.select(compose(config_name="main", overrides=["envs.mcqa.n_train=7"]), "envs.mcqa")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    assert cfg.kind == "mcqa" and cfg.n_train == 7
    assert validate_env_config(cfg) == McqaOptions()
