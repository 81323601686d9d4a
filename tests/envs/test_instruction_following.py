"""instruction_following: every constraint check on responses that meet and miss it (huge and
empty ones included), the judge's fraction, the conflict table, deterministic disjoint splits,
rewards and the all_met metric through a replayed rollout, options errors and the Hydra file."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, register_env_configs, validate_env_config
from ptrain.config.env_verifiable import IF_CONFLICTS, IF_FAMILIES, InstructionFollowingOptions, largest_compatible
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.instruction_following import (
    ARGS,
    CHECKS,
    END_PHRASES,
    FIRST_WORDS,
    FORBIDDEN,
    KEYWORDS,
    TEMPLATES,
    TOPICS,
    compatible_subsets,
    constraint_results,
    count_words,
    describe,
    final_response,
    judge_instruction_following,
)
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "word_count": [
        ({"relation": "at_least", "n": 5}, "one two three four five", True),
        ({"relation": "at_least", "n": 5}, "one two three four", False),
        ({"relation": "at_least", "n": 3}, "don't stop now", True),  # don't is one word
        ({"relation": "at_least", "n": 3}, "* - *** , . !", False),  # markers and punctuation are not words
        ({"relation": "at_most", "n": 3}, "well-known fact", True),  # 3 words: well, known, fact
        ({"relation": "at_most", "n": 3}, "a b c d", False),
        ({"relation": "at_most", "n": 3}, "", True),
    ],
    "bullets": [
        ({"n": 2}, "Intro\n* first\n* second", True),
        ({"n": 2}, "* first\n  - second\nend", True),  # indented and dash bullets count
        ({"n": 2}, "* only one", False),
        ({"n": 2}, "* one\n* two\n* three", False),
        ({"n": 2}, "*no space\n**bold**\n***\n* one\n* two", True),
        ({"n": 1}, "a * b", False),  # not at a line start
    ],
    "keywords": [
        ({"words": ["river", "memory"]}, "The River holds a MEMORY.", True),
        ({"words": ["river", "memory"]}, "The river flows.", False),
        ({"words": ["river", "memory"]}, "rivers and memory", False),  # whole words
    ],
    "forbidden_word": [
        ({"word": "very"}, "Every day is fine.", True),  # 'very' inside 'every' is not the word
        ({"word": "very"}, "It was VERY cold.", False),
        ({"word": "very"}, "very", False),
        ({"word": "thing"}, "anything goes", True),
    ],
    "lowercase": [
        ({}, "all lowercase here, 123.", True),
        ({}, "Not lowercase", False),
        ({}, "123 !!!", False),  # no letters at all
        ({}, "", False),
    ],
    "uppercase": [
        ({}, "ALL CAPS HERE, 123.", True),
        ({}, "ALL CAPS bUT ONE", False),
        ({}, "", False),
    ],
    "end_phrase": [
        ({"phrase": "Any other questions?"}, "Here it is. Any other questions?", True),
        ({"phrase": "Any other questions?"}, "Here it is. Any other questions?  \n", True),
        ({"phrase": "Any other questions?"}, "Any other questions? Bye.", False),
        ({"phrase": "Any other questions?"}, "Here it is. any other questions?", False),  # exact case
        ({"phrase": "Any other questions?"}, "", False),
    ],
    "quotation": [
        ({}, '"Quoted text."', True),
        ({}, '  "Quoted text."\n', True),
        ({}, '"', False),
        ({}, 'Quoted "text"', False),
        ({}, "“Curly quotes”", False),
    ],
    "paragraphs": [
        ({"n": 3}, "One.\n***\nTwo.\n***\nThree.", True),
        ({"n": 3}, "***\nOne.\n***\nTwo.\n***\nThree.\n***", True),  # empty ends are not counted
        ({"n": 3}, "One.\n***\n\n***\nTwo.\n***\nThree.", False),  # an empty paragraph inside
        ({"n": 2}, "One.\n***\nTwo.\n***\nThree.", False),
        ({"n": 2}, "One.\n\nTwo.", False),  # blank lines do not separate
    ],
    "first_word": [
        ({"word": "Today"}, "Today we learn.", True),
        ({"word": "Today"}, '  "today, we learn."', True),  # leading punctuation skipped, any case
        ({"word": "Today"}, "Todays news", False),
        ({"word": "Today"}, "We learn today.", False),
        ({"word": "Today"}, "", False),
    ],
    "title": [
        ({}, "<<A Day Out>>\nText.", True),
        ({}, "Text <<t>> more", True),
        ({}, "<<>>", False),
        ({}, "<<   >>", False),
        ({}, "<<broken\ntitle>>", False),
        ({}, "<single>", False),
    ],
    "no_commas": [
        ({}, "No commas here.", True),
        ({}, "One, two.", False),
        ({}, "", True),
    ],
}


def test_cases_cover_every_family():
    assert set(CASES) == set(IF_FAMILIES) == set(CHECKS) == set(ARGS)


@pytest.mark.parametrize(
    "family, args, response, expected",
    [(f, a, r, e) for f, cases in CASES.items() for a, r, e in cases],
)
def test_checks(family, args, response, expected):
    assert CHECKS[family](response, args) is expected


@pytest.mark.parametrize("family", IF_FAMILIES)
def test_checks_are_fast_on_huge_adversarial_input(family):
    args = ARGS[family](random.Random(0))
    for text in (
        " " * 200_000 + "x",
        "<<" * 100_000,
        "*" * 200_000,
        "\n" * 100_000 + "* a",
        "!" * 200_000,
        "a'" * 100_000,
        "very" * 50_000,
    ):
        start = time.monotonic()
        CHECKS[family](text, args)
        assert time.monotonic() - start < 2.0, (family, text[:10])


def test_judge_is_the_fraction_met_and_refuses_overlong():
    data = {
        "constraints": [
            {"family": "no_commas", "args": {}},
            {"family": "lowercase", "args": {}},
            {"family": "keywords", "args": {"words": ["river", "bridge"]}},
        ],
        "max_answer_chars": 200,
    }
    assert judge_instruction_following("a river under a bridge.", data) == 1.0
    assert judge_instruction_following("a river, under a bridge.", data) == pytest.approx(2 / 3)
    assert judge_instruction_following("A river, under a tree.", data) == 0.0
    assert constraint_results("A river under a bridge", data["constraints"]) == [True, False, True]
    assert judge_instruction_following("a river under a bridge " * 20, data) == 0.0  # over 200 characters


def test_word_count_and_final_response():
    assert count_words("It's a well-known fact: 3 cats.") == 7
    assert final_response("<think>plan, plan</think>\n  the answer  ") == "the answer"
    assert final_response("  no reasoning ") == "no reasoning"


def test_vocabularies_do_not_contradict_themselves():
    """No prompt asks for a banned word: the banned ones occur in no topic, request, keyword,
    first word, end phrase or instruction text; end phrases have no commas and mix cases."""
    texts = [*TOPICS, *TEMPLATES, *KEYWORDS, *FIRST_WORDS, *END_PHRASES]
    texts += [describe(f, ARGS[f](random.Random(i))) for f in IF_FAMILIES for i in range(20)]
    for word in FORBIDDEN:
        for t in texts:
            if not t.startswith("Do not use the word"):
                assert not re.search(rf"\b{word}\b", t, re.IGNORECASE), (word, t)
    assert not set(FORBIDDEN) & set(KEYWORDS)
    assert all("," not in p for p in END_PHRASES)
    assert all(p != p.lower() and p != p.upper() for p in END_PHRASES)


def test_conflicts_and_compatible_subsets():
    assert largest_compatible(["lowercase", "uppercase"]) == 1
    assert largest_compatible(["lowercase", "uppercase", "no_commas"]) == 2
    assert largest_compatible(list(IF_FAMILIES)) >= 3
    subsets = compatible_subsets(list(IF_FAMILIES), range(1, 4))
    assert len(subsets[1]) == len(IF_FAMILIES)
    for k in (2, 3):
        for s in subsets[k]:
            assert all(frozenset((a, b)) not in IF_CONFLICTS for a in s for b in s if a != b)
    assert ("lowercase", "uppercase") not in subsets[2]
    assert all(set(p) <= set(IF_FAMILIES) for p in IF_CONFLICTS)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def test_tasks_deterministic_disjoint_and_conflict_free(tok):
    cfg = EnvConfig(kind="instruction_following", n_train=300, n_eval=50)
    a, b = make_env(cfg, tokenizer=tok), make_env(cfg, tokenizer=tok)
    train, held = a.tasks("train", seed=2), a.tasks("eval", seed=2)
    assert [t.data for t in train] == [t.data for t in b.tasks("train", seed=2)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=3)]
    assert len(train) == 300 and len(held) == 50
    prompts = lambda ts: {t.messages[0]["content"] for t in ts}  # noqa: E731
    assert not prompts(train) & prompts(held) and len(prompts(train)) == 300
    used = set()
    for t in train:
        families = [c["family"] for c in t.data["constraints"]]
        used |= set(families)
        assert 1 <= len(families) <= 3 and len(set(families)) == len(families)
        assert all(frozenset((x, y)) not in IF_CONFLICTS for x in families for y in families if x != y)
        text = t.messages[0]["content"]
        assert text.startswith(t.data["request"])
        assert all(describe(c["family"], c["args"]) in text for c in t.data["constraints"])
    assert used == set(IF_FAMILIES)
    c = make_env(EnvConfig(kind="instruction_following", n_train=400, n_eval=50), tokenizer=tok)
    assert [t.data for t in c.tasks("eval", seed=2)] == [t.data for t in held]


def test_constraint_count_and_families_are_respected(tok):
    opts = {"families": ["no_commas", "title", "lowercase"], "min_constraints": 2, "max_constraints": 2}
    env = make_env(EnvConfig(kind="instruction_following", n_train=20, n_eval=2, options=opts), tokenizer=tok)
    for t in env.tasks("train", seed=0):
        families = {c["family"] for c in t.data["constraints"]}
        assert len(families) == 2 and families <= {"no_commas", "title", "lowercase"}


def test_rewards_and_all_met_through_a_replayed_rollout(tok):
    env = make_env(EnvConfig(kind="instruction_following", n_train=2, n_eval=0, reward_workers=1), tokenizer=tok)
    try:
        constraints = [
            {"family": "lowercase", "args": {}},
            {"family": "no_commas", "args": {}},
            {"family": "bullets", "args": {"n": 2}},
            {"family": "forbidden_word", "args": {"word": "very"}},
        ]
        data = {"request": "Write about kites.", "constraints": constraints, "max_answer_chars": 16000}
        prompt = " ".join([data["request"], *(describe(c["family"], c["args"]) for c in constraints)])
        task = env.task("train", 0, env.user(prompt), data)
        answers = [
            "<think>Plan: Two bullets, no commas.</think>\nkites fly high\n* they need wind\n* they need string",
            "kites fly high\n* they need wind, and string\n* they are very fun",  # 2 of 4
            "Kites, very much.",  # 0 of 4: capital, comma, no bullets, 'very'
            "",
            "<think>only reasoning</think>",
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=512)))
        assert [t.reward for t in out] == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
        assert dict(out[1].reward_components) == pytest.approx({"format": 0.0, "correct": 0.5})
        assert [t.metrics["all_met"] for t in out] == [1, 0, 0, 0, 0]
        assert [t.metrics["formatted"] for t in out] == [1, 1, 1, 0, 0]
        assert [t.metrics["correct"] for t in out] == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
        assert all(t.reward_error is None for t in out)
    finally:
        env.close()


def test_extract_refuses_empty_and_overlong(tok):
    opts = InstructionFollowingOptions(max_answer_chars=100)
    env = make_env(EnvConfig(kind="instruction_following", n_train=1, n_eval=0), tokenizer=tok)
    env.options = opts
    task = env.tasks("train", seed=0)[0]
    assert env.extract(task, "  fine  ") == "fine"
    assert env.extract(task, "   \n") is None
    assert env.extract(task, "x" * 101) is None
    assert env.extract(task, "<think>" + "x" * 500 + "</think>short") == "short"


@pytest.mark.parametrize(
    "options, key",
    [
        ({"families": []}, "families"),
        ({"families": ["rhyme"]}, "families"),
        ({"families": ["title", "title"]}, "families"),
        ({"min_constraints": 0}, "min_constraints"),
        ({"min_constraints": 3, "max_constraints": 2}, "min_constraints"),
        ({"families": ["lowercase", "uppercase"], "max_constraints": 2}, "max_constraints"),
        ({"max_answer_chars": 10}, "max_answer_chars"),
        ({"correct_reward": -1.0}, "correct_reward"),
        ({"format_reward": -1.0}, "format_reward"),
        ({"families": "title"}, "families"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.instruction_following\.options\.{key}'"):
        validate_env_config(EnvConfig(kind="instruction_following", options=options))


def test_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: instruction_following\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        cfg_all = compose(config_name="main", overrides=["envs.instruction_following.n_train=7"])
    node = OmegaConf.select(cfg_all, "envs.instruction_following")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    assert cfg.kind == "instruction_following" and cfg.n_train == 7
    assert validate_env_config(cfg) == InstructionFollowingOptions()
