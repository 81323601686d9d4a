"""reasoning-gym: tasks of three datasets generated locally, scored by each dataset's own
score_answer on the <answer> tag; weights, configs and bad options."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.reasoning_gym import allocate, judge_reasoning_gym
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

DATASETS = ["leg_counting", "basic_arithmetic", "spell_backward"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def env(tok):
    cfg = EnvConfig(
        kind="reasoning_gym",
        n_train=12,
        n_eval=6,
        reward_workers=1,
        options={
            "datasets": DATASETS,
            "dataset_weights": {"leg_counting": 2.0},
            "dataset_configs": {"basic_arithmetic": {"min_terms": 2, "max_terms": 3}},
        },
    )
    e = make_env(cfg, tokenizer=tok)
    yield e
    e.close()


def test_tasks_by_weight_disjoint_and_deterministic(env, tok):
    train, held = env.tasks("train", seed=0), env.tasks("eval", seed=0)
    assert Counter(t.data["dataset"] for t in train) == {"leg_counting": 6, "basic_arithmetic": 3, "spell_backward": 3}
    assert not {t.messages[0]["content"] for t in train} & {t.messages[0]["content"] for t in held}
    assert all("<answer></answer>" in t.messages[0]["content"] for t in train)
    arithmetic = [t for t in train if t.data["dataset"] == "basic_arithmetic"]
    assert all(t.data["entry"]["metadata"]["num_terms"] <= 3 for t in arithmetic)
    again = make_env(env.cfg, tokenizer=tok).tasks("train", seed=0)
    assert [t.messages for t in again] == [t.messages for t in train]


def test_scored_by_each_datasets_own_scorer(env, tok):
    for task in env.tasks("train", seed=0)[:6]:
        right = task.data["answer"]
        answers = [f"I think...\n<answer>{right}</answer>", "<answer>definitely wrong 123xyz</answer>", "no tags"]
        out = asyncio.run(env.rollout(task, ReplayEngine(answers, tokenizer=tok), SamplingParams(n=3)))
        assert out[0].reward == 1.0, (task.data["dataset"], right)
        assert out[1].reward < 1.0
        assert out[2].reward == 0.0 and out[2].metrics["formatted"] == 0.0
        entry = task.data["entry"]
        assert judge_reasoning_gym(right, entry, task.data["dataset"], task.data["config"]) == 1.0


def test_bad_options_name_the_key():
    def check(options, match):
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(kind="reasoning_gym", options=options))

    check({"datasets": ["no_such_dataset"]}, r"envs\.reasoning_gym\.options\.datasets.*unknown reasoning-gym dataset")
    check({"datasets": ["leg_counting"], "dataset_configs": {"leg_counting": {"bogus": 1}}},
          r"options\.dataset_configs\.leg_counting.*unknown key\(s\) \['bogus'\].*valid keys: .*min_animals")  # fmt: skip
    check({"datasets": ["leg_counting"], "dataset_weights": {"basic_arithmetic": 1}}, r"not in datasets")
    check({"datasets": ["leg_counting"], "dataset_weights": {"leg_counting": 0}}, r"must be a number > 0")
    check({"dataset": ["leg_counting"]}, r"options\.dataset'.*valid keys: datasets, dataset_configs")
    # Values the dataset's own config refuses: an AssertionError or TypeError from
    # reasoning-gym when the stage built the tasks, after the model had loaded.
    check({"datasets": ["leg_counting"], "dataset_configs": {"leg_counting": {"min_animals": -1}}},
          r"'envs\.reasoning_gym\.options\.dataset_configs\.leg_counting': LegCountingConfig refuses it: "
          r"AssertionError: min_animals must be positive")  # fmt: skip
    check({"datasets": ["leg_counting"], "dataset_configs": {"leg_counting": {"min_animals": "two"}}},
          r"dataset_configs\.leg_counting': LegCountingConfig refuses it: TypeError")  # fmt: skip


def test_allocate_sums_and_follows_weights():
    assert allocate(10, [2, 1, 1]) == [5, 3, 2]
    assert sum(allocate(7, [1, 1, 1])) == 7
    assert allocate(0, [1, 2]) == [0, 0]
    assert allocate(4, [3, 1]) == [3, 1]
