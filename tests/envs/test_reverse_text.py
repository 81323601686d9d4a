"""reverse_text: the similarity ratio (hand-computed values), extraction of the last
<reversed_text> tag, task generation (deterministic, in range, disjoint splits), rewards and the
exact-match metric through a replayed rollout, the demonstration, options errors and the Hydra
file."""

from __future__ import annotations

import asyncio
import difflib
import os
import random

import pytest

from ptrain.config.env import (
    REVERSE_TEXT_MAX_WORD_CHARS,
    EnvConfig,
    EnvConfigError,
    ReverseTextOptions,
    register_env_configs,
    validate_env_config,
)
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.base import Task
from ptrain.envs.mixture import aggregate_metrics
from ptrain.envs.registry import make_env
from ptrain.envs.reverse_text import WORDS, ReverseTextEnv, judge_reverse_text, make_text, prompt_text, similarity
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from ptrain.stages.env_metrics import is_correct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "answer, target, ratio",
    [
        ("abcd", "abcd", 1.0),
        ("abdc", "abcd", 0.75),  # "ab" and one of c/d match: 2 * 3 / 8
        ("abcd", "abdc", 0.75),
        ("tac eh", "tac eht", 12 / 13),  # one character short: 2 * 6 / 13
        ("xyz", "abc", 0.0),
        ("", "abc", 0.0),
        ("dcba", "abcd", 0.25),  # the text not reversed: one character matches, 2 * 1 / 8
    ],
)
def test_similarity_by_hand(answer, target, ratio):
    assert similarity(answer, target) == pytest.approx(ratio)
    assert similarity(answer, target) == pytest.approx(difflib.SequenceMatcher(None, answer, target).ratio())
    assert judge_reverse_text(answer, {"text": target[::-1], "target": target}) == pytest.approx(ratio)


def test_judge_is_one_only_for_the_exact_reversal():
    data = {"text": "the cat", "target": "tac eht"}
    assert judge_reverse_text("tac eht", data) == 1.0
    assert judge_reverse_text("tac eht ", data) < 1.0
    assert judge_reverse_text("Tac eht", data) < 1.0
    assert judge_reverse_text(None, data) == 0.0  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def env_of(tok, **options) -> ReverseTextEnv:
    return ReverseTextEnv(EnvConfig(kind="reverse_text"), ReverseTextOptions(**options), tokenizer=tok)


def test_extract_mirrors_extract_tag(tok):
    env = env_of(tok)
    task = env.task("train", 0, env.user(prompt_text("the cat")), {"text": "the cat", "target": "tac eht"})
    assert env.extract(task, "<reversed_text>tac eht</reversed_text>") == "tac eht"
    assert env.extract(task, "<think>hmm</think>\n<reversed_text> tac eht \n</reversed_text>") == "tac eht"
    # The last complete tag counts.
    assert (
        env.extract(task, "<reversed_text>x</reversed_text> then <reversed_text>tac eht</reversed_text>") == "tac eht"
    )
    for text in ("tac eht", "<reversed_text>tac eht", "<reversed_text>  </reversed_text>", "<answer>tac eht</answer>",
                 "tac eht</reversed_text>", ""):  # fmt: skip
        assert env.extract(task, text) is None, text


def test_make_text_is_words_in_range():
    rng = random.Random(0)
    texts = [t for t in (make_text(rng, 20, 60) for _ in range(500)) if t is not None]
    assert len(texts) > 300
    for t in texts:
        assert 20 <= len(t) <= 60 and t == t.strip() and "  " not in t
        assert all(w in WORDS for w in t.split(" "))
    assert len(set(WORDS)) == len(WORDS) >= 200
    assert all(w.isalpha() and w.islower() and w.isascii() and len(w) <= REVERSE_TEXT_MAX_WORD_CHARS for w in WORDS)


def test_tasks_deterministic_disjoint_and_say_the_format(tok):
    cfg = EnvConfig(kind="reverse_text", n_train=200, n_eval=40)
    a, b = make_env(cfg, tokenizer=tok), make_env(cfg, tokenizer=tok)
    assert isinstance(a, ReverseTextEnv) and a.name == "reverse_text"
    train, held = a.tasks("train", seed=7), a.tasks("eval", seed=7)
    assert [t.data for t in train] == [t.data for t in b.tasks("train", seed=7)]
    assert [t.messages for t in train] == [t.messages for t in b.tasks("train", seed=7)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=8)]
    assert len(train) == 200 and len(held) == 40
    texts = lambda ts: {t.data["text"] for t in ts}  # noqa: E731
    assert not texts(train) & texts(held) and len(texts(train)) == 200 and len(texts(held)) == 40
    for t in [*train, *held]:
        assert t.data["target"] == t.data["text"][::-1] and 20 <= len(t.data["text"]) <= 60
    prompt = train[0].messages[0]["content"]
    assert "<reversed_text></reversed_text>" in prompt and train[0].data["text"] in prompt
    assert train[0].data["target"] not in prompt
    assert {t.id for t in held} == {f"eval-{i}" for i in range(40)}
    # The held-out split does not move when n_train changes.
    c = make_env(EnvConfig(kind="reverse_text", n_train=400, n_eval=40), tokenizer=tok)
    assert [t.data for t in c.tasks("eval", seed=7)] == [t.data for t in held]


def test_length_options_are_respected(tok):
    opts = {"min_chars": 100, "max_chars": 120}
    env = make_env(EnvConfig(kind="reverse_text", n_train=30, n_eval=5, options=opts), tokenizer=tok)
    for t in [*env.tasks("train", seed=0), *env.tasks("eval", seed=0)]:
        assert 100 <= len(t.data["text"]) <= 120


def test_rewards_and_exact_match_through_a_replayed_rollout(tok):
    opts = {"format_reward": 0.1, "correct_reward": 1.0}
    env = make_env(EnvConfig(kind="reverse_text", n_train=2, n_eval=0, reward_workers=1, options=opts), tokenizer=tok)
    try:
        task = env.task("train", 0, env.user(prompt_text("the cat")), {"text": "the cat", "target": "tac eht"})
        answers = [
            "<think>Last character first.</think><reversed_text>tac eht</reversed_text>",
            "<reversed_text>tac eh</reversed_text>",  # one character short
            "<reversed_text>the cat</reversed_text>",  # not reversed
            "tac eht",  # no tag
            "<reversed_text>tac eht",  # unclosed
            "<reversed_text>wrong</reversed_text> <reversed_text>tac eht</reversed_text>",  # the last tag counts
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=256)))
        assert [t.turns[0].text for t in out] == answers
        unreversed = difflib.SequenceMatcher(None, "the cat", "tac eht").ratio()
        assert unreversed == pytest.approx(3 / 7)  # "t", "h", "t" match in order: 2 * 3 / 14
        ratios = [1.0, 12 / 13, unreversed, 0.0, 0.0, 1.0]
        assert [t.metrics["correct"] for t in out] == pytest.approx(ratios)
        assert [t.reward for t in out] == pytest.approx([1.1, 0.1 + 12 / 13, 0.1 + unreversed, 0.0, 0.0, 1.1])
        assert dict(out[0].reward_components) == pytest.approx({"format": 0.1, "correct": 1.0})
        assert dict(out[1].reward_components) == pytest.approx({"format": 0.1, "correct": 12 / 13})
        assert dict(out[3].reward_components) == {"format": 0.0, "correct": 0.0}
        assert [t.metrics["formatted"] for t in out] == [1, 1, 1, 0, 0, 1]
        assert [t.metrics["exact"] for t in out] == [1, 0, 0, 0, 0, 1]
        assert all(t.reward_error is None for t in out)
        # Pass rate, solved tasks and eval accuracy count the exact reversals only.
        assert [is_correct(t) for t in out] == [True, False, False, False, False, True]
        m = aggregate_metrics(out)
        assert m["reverse_text/pass_rate"] == pytest.approx(2 / 6) and m["reverse_text/solved_tasks"] == 1.0
        assert m["reverse_text/exact_mean"] == pytest.approx(2 / 6)
    finally:
        env.close()


def test_demonstration_is_the_exact_reversal(tok):
    env = make_env(EnvConfig(kind="reverse_text", n_train=10, n_eval=2), tokenizer=tok)
    for t in env.tasks("train", seed=0):
        (turn,) = env.demonstration(t)
        assert turn["role"] == "assistant"
        content = turn["content"]
        assert content.startswith("<think>") and content.count("</think>") == 1
        assert content.endswith(f"</think><reversed_text>{t.data['text'][::-1]}</reversed_text>")
        assert env.extract(t, content) == t.data["target"]
        assert judge_reverse_text(env.extract(t, content), dict(t.data)) == 1.0
    task = env.tasks("train", seed=0)[0]
    bad = Task(task.env, task.id, task.messages, {**task.data, "target": task.data["text"]})
    with pytest.raises(ValueError, match="not the reversal"):
        env.demonstration(bad)


@pytest.mark.parametrize(
    "options, key",
    [
        ({"min_chars": 61}, "min_chars"),  # > max_chars 60
        ({"min_chars": 50, "max_chars": 40}, "min_chars"),
        ({"min_chars": 0}, "min_chars"),
        ({"min_chars": 1, "max_chars": 5}, "max_chars"),  # no word fits
        ({"max_chars": 5000}, "max_chars"),
        ({"format_reward": -0.1}, "format_reward"),
        ({"correct_reward": -1.0}, "correct_reward"),
        ({"max_chars": "60"}, "max_chars"),
        ({"similarity_reward": 1.0}, "similarity_reward"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.reverse_text\.options\.{key}'"):
        validate_env_config(EnvConfig(kind="reverse_text", options=options))


def test_min_above_max_says_the_fix():
    with pytest.raises(EnvConfigError, match=r"need 1 <= min_chars <= max_chars, got 80 and 60; lower min_chars"):
        validate_env_config(EnvConfig(kind="reverse_text", options={"min_chars": 80}))
    with pytest.raises(EnvConfigError, match=r"'envs\.rt\.options\.correct_reward': must be >= 0, got -1"):
        validate_env_config(EnvConfig(kind="reverse_text", name="rt", options={"correct_reward": -1}))


def test_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: reverse_text\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        node = OmegaConf.select(
            compose(config_name="main", overrides=["envs.reverse_text.n_train=7"]), "envs.reverse_text"
        )
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    assert cfg.kind == "reverse_text" and cfg.n_train == 7
    assert validate_env_config(cfg) == ReverseTextOptions()
