"""long_context: deterministic tasks and disjoint splits, prompts that grow with context_tokens
(counted with the embedded tokenizer, or in words), the fact at the requested depth and in
exactly one document, rewards through a replayed rollout (right value 1, a distractor's 0, a
malformed answer 0), options errors, make_env and the Hydra file."""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, register_env_configs, validate_env_config
from ptrain.config.env_verifiable import LongContextOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.long_context import LongContextEnv, fact_sentence, judge_long_context, make_task, normalize_answer
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTENCE = 100
"""Tokens one filler sentence may take with the embedded tokenizer (about 50): how far below
context_tokens a prompt may end."""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


def env_of(tok, n_train=20, n_eval=5, name=None, reward_workers=2, **options):
    cfg = EnvConfig(kind="long_context", name=name, n_train=n_train, n_eval=n_eval, reward_workers=reward_workers,
                    options=options)  # fmt: skip
    return make_env(cfg, tokenizer=tok)


def content(task) -> str:
    return task.messages[-1]["content"]


def depth_of(text: str, sentence: str) -> float:
    """Where `sentence` starts in the documents of a prompt, as a fraction of their characters."""
    start, end = text.index("Document 1:"), text.index("\n\nQuestion:")
    return (text.index(sentence) - start) / (end - start)


def test_make_env_builds_it(tok):
    env = env_of(tok, name="lc", n_train=3, n_eval=1, context_tokens=1024)
    assert isinstance(env, LongContextEnv) and env.name == "lc"
    assert [t.env for t in env.tasks("train", seed=0)] == ["lc"] * 3 and len(env.tasks("eval", seed=0)) == 1


def test_tasks_are_deterministic_and_splits_disjoint(tok):
    a, b = (env_of(tok, n_train=30, n_eval=10, context_tokens=1024) for _ in range(2))
    train, held = a.tasks("train", seed=5), a.tasks("eval", seed=5)
    assert [(t.messages, t.data) for t in train] == [(t.messages, t.data) for t in b.tasks("train", seed=5)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=6)]
    keys = lambda ts: {t.data["key"] for t in ts}  # noqa: E731
    assert len(keys(train)) == 30 and len(keys(held)) == 10 and not keys(train) & keys(held)
    assert not {t.data["question"] for t in train} & {t.data["question"] for t in held}
    more = env_of(tok, n_train=60, n_eval=10, context_tokens=1024)  # the held-out split does not move with n_train
    assert [(t.messages, t.data) for t in more.tasks("eval", seed=5)] == [(t.messages, t.data) for t in held]


def test_tasks_do_not_depend_on_the_hash_seed():
    code = (
        "import hashlib\n"
        "from ptrain.config.env import EnvConfig\n"
        "from ptrain.data.tokenizer import build_tokenizer\n"
        "from ptrain.envs.registry import make_env\n"
        "env = make_env(EnvConfig(kind='long_context', n_train=4, n_eval=1, options={'context_tokens': 1024}),\n"
        "               tokenizer=build_tokenizer(vocab_size=512))\n"
        "text = ''.join(t.messages[-1]['content'] for t in env.tasks('train', seed=1))\n"
        "print(hashlib.sha256(text.encode()).hexdigest())\n"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": h},
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for h in ("1", "2")
    ]
    out = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0] and out[0] == out[1] and out[0].strip()


def test_prompt_length_tracks_context_tokens(tok):
    means = []
    for length in (1024, 2048, 4096):
        env = env_of(tok, n_train=10, n_eval=0, context_tokens=length)
        got = [len(env.prompt_ids(t)) for t in env.tasks("train", seed=0)]
        assert all(length - SENTENCE <= n <= length for n in got), (length, got)
        assert got == [t.data["prompt_tokens"] for t in env.tasks("train", seed=0)]
        means.append(sum(got) / len(got))
    assert means == sorted(means) and means[-1] > 3.5 * means[0]


def test_length_in_words_without_a_tokenizer():
    opts = LongContextOptions(context_tokens=3000)
    prompt, data = make_task(random.Random(0), ("access code", "Vantor archive"), opts, lambda p: len(p.split()))
    assert 3000 - 40 <= len(prompt.split()) <= 3000 and data["prompt_tokens"] == len(prompt.split())
    assert fact_sentence("access code", "Vantor archive", data["answer"]) in prompt


@pytest.mark.parametrize("depth", [0, 0.25, 0.5, 0.8, 1.0])
def test_fact_lies_at_the_requested_depth(tok, depth):
    n = 4
    env = env_of(tok, n_train=6, n_eval=0, context_tokens=4096, needle_depth=depth, n_documents=n)
    for t in env.tasks("train", seed=0):
        d = t.data
        needle = fact_sentence(d["attribute"], d["entity"], d["answer"])
        assert abs(depth_of(content(t), needle) - depth) <= 0.04, (t.id, depth_of(content(t), needle))
        assert d["depth"] == depth and d["document"] == min(n, int(depth * n) + 1)


def test_random_depth_is_drawn_per_task_and_recorded(tok):
    env = env_of(tok, n_train=20, n_eval=0, context_tokens=2048)
    depths = []
    for t in env.tasks("train", seed=0):
        d = t.data
        needle = fact_sentence(d["attribute"], d["entity"], d["answer"])
        assert abs(depth_of(content(t), needle) - d["depth"]) <= 0.06
        depths.append(d["depth"])
    assert min(depths) < 0.25 and max(depths) > 0.75


@pytest.mark.parametrize("options", [{}, {"n_documents": 7, "facts_per_document": 3}, {"n_documents": 1},
                                     {"attributes": ["head keeper"], "name_title": True}])  # fmt: skip
def test_exactly_one_document_answers(tok, options):
    env = env_of(tok, n_train=10, n_eval=0, context_tokens=2048, **options)
    o = env.options
    for t in env.tasks("train", seed=0):
        d, text = t.data, content(t)
        docs = re.split(r"\n\nDocument \d+: ", text.split("\n\nQuestion:")[0])[1:]
        assert len(docs) == o.n_documents and docs[d["document"] - 1].startswith(d["title"])
        facts = re.findall(r"The ([a-z ]+) of the (\w+ \w+) is ([^.]+)\.", text)
        assert len(facts) == o.n_documents * o.facts_per_document
        values = [v for _, _, v in facts]
        assert len(set(values)) == len(values) and sorted(values) == sorted([d["answer"], *d["distractors"]])
        assert [(a, e) for a, e, _ in facts].count((d["attribute"], d["entity"])) == 1
        assert len(re.findall(rf"\b{re.escape(d['answer'])}\b", text)) == 1
        right = [i for i, doc in enumerate(docs) if fact_sentence(d["attribute"], d["entity"], d["answer"]) in doc]
        assert right == [d["document"] - 1]
        # Every document states the asked attribute; the others about other entities.
        assert all(f"The {d['attribute']} of the " in doc for doc in docs)
        # Filler states nothing: no digits outside the facts.
        assert not re.search(r"\d", re.sub(r"The [a-z ]+ of the \w+ \w+ is [^.]+\.", "", "".join(docs)))
        assert d["question"] in text and text.rstrip().endswith("\\boxed{}.")
        if o.name_title:
            assert f"Document {d['document']} ({d['title']})" in d["question"]


def test_judge_normalises_case_space_and_a_final_period():
    data = {"answer": "Dalia Eskova"}
    for ok in ("Dalia Eskova", "  dalia   ESKOVA. ", "\\text{Dalia Eskova}"):
        assert judge_long_context(ok, data) == 1.0, ok
    for bad in ("Dalia", "Dalia Eskovas", "", "Eskova Dalia"):
        assert judge_long_context(bad, data) == 0.0, bad
    assert normalize_answer(" KR-417. ") == "kr-417"


def test_rewards_through_a_replayed_rollout(tok):
    env = env_of(tok, n_train=4, n_eval=0, reward_workers=1, context_tokens=1024,
                 format_reward=0.2, correct_reward=0.8)  # fmt: skip
    try:
        task = env.tasks("train", seed=0)[0]
        right, other = task.data["answer"], task.data["distractors"][0]
        answers = [
            f"Document {task.data['document']} says so.\n\\boxed{{{right}}}",
            f"<answer>{right.lower()}</answer>",
            f"\\boxed{{{other}}}",  # a distractor's value
            f"The answer is {right}.",  # right, but not in the format
            f"\\boxed{{{right}",  # unclosed
            "",
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=64)))
        assert [t.reward for t in out] == pytest.approx([1.0, 1.0, 0.2, 0.0, 0.0, 0.0])
        assert dict(out[0].reward_components) == pytest.approx({"format": 0.2, "correct": 0.8})
        assert [t.metrics["correct"] for t in out] == [1, 1, 0, 0, 0, 0]
        assert [t.metrics["formatted"] for t in out] == [1, 1, 1, 0, 0, 0]
        assert [t.metrics["distractor"] for t in out] == [0, 0, 1, 0, 0, 0]
        assert all(t.reward_error is None for t in out)
    finally:
        env.close()


@pytest.mark.parametrize(
    "options, key, fix",
    [
        ({"n_documents": 0}, "n_documents", "need 1 <= n_documents <= 64"),
        ({"n_documents": 65}, "n_documents", "need 1 <= n_documents <= 64"),
        ({"facts_per_document": 0}, "facts_per_document", "need 1 <= facts_per_document <= 8"),
        ({"context_tokens": 100}, "context_tokens", "must be between 256 and 1048576"),
        ({"context_tokens": 1 << 21}, "context_tokens", "must be between 256 and 1048576"),
        ({"context_tokens": 4096.0}, "context_tokens", "must be an integer"),
        ({"needle_depth": 1.5}, "needle_depth", 'pass "random" or a number from 0'),
        ({"needle_depth": -0.1}, "needle_depth", 'pass "random" or a number from 0'),
        ({"needle_depth": "middle"}, "needle_depth", 'pass "random" or a number from 0'),
        ({"needle_depth": True}, "needle_depth", 'pass "random" or a number from 0'),
        ({"attributes": []}, "attributes", "pass at least one of"),
        ({"attributes": ["colour"]}, "attributes", "unknown name"),
        ({"format_reward": -0.1}, "format_reward", "must be >= 0"),
        ({"context_length": 4096}, "context_length", "not an option of this kind; valid keys: n_documents"),
    ],
)
def test_bad_options_name_the_key_and_the_fix(options, key, fix):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.long_context\.options\.{key}': .*{re.escape(fix)}"):
        validate_env_config(EnvConfig(kind="long_context", options=options))


def test_a_context_too_short_for_the_documents_is_a_config_error(tok):
    env = env_of(tok, name="lc", context_tokens=512, n_documents=8, facts_per_document=4)
    with pytest.raises(
        EnvConfigError, match=r"'envs\.lc\.options\.context_tokens': 512 is below the \d+ tokens.*raise"
    ):
        env.tasks("train", seed=0)


def test_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: long_context\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    overrides = ["envs.long_context.n_train=7", "envs.long_context.options.needle_depth=0.5"]
    with initialize_config_dir(str(tmp_path), version_base=None):
        node = OmegaConf.select(compose(config_name="main", overrides=overrides), "envs.long_context")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    assert cfg.kind == "long_context" and cfg.n_train == 7
    assert validate_env_config(cfg) == LongContextOptions(needle_depth=0.5)
