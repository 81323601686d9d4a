"""EnvMixture: weighted, deterministic draws; every task once per epoch; exact resume from
get_state; per-environment metrics of a batch of trajectories."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ptrain.config.env import EnvConfig
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.base import Task, TokenCounts, Trajectory
from ptrain.envs.mixture import EnvMixture, aggregate_metrics
from ptrain.envs.registry import make_env


@pytest.fixture(scope="module")
def envs():
    tok = build_tokenizer(vocab_size=300)
    return [
        make_env(EnvConfig(kind="countdown", n_train=30, n_eval=2, weight=2.0), tokenizer=tok),
        make_env(EnvConfig(kind="arithmetic", n_train=20, n_eval=2, seed=5), tokenizer=tok),
        make_env(
            EnvConfig(kind="countdown", name="countdown_all", n_train=10, n_eval=2, options={"use_all_numbers": True}),
            tokenizer=tok,
        ),  # fmt: skip
    ]


def order(mix, k):
    return [(env.name, task.id) for env, task in mix.next_tasks(k)]


def test_deterministic_and_weighted(envs):
    a, b = EnvMixture(envs, seed=1), EnvMixture(envs, seed=1)
    assert order(a, 200) == order(b, 200)
    assert order(EnvMixture(envs, seed=2), 200) != order(EnvMixture(envs, seed=1), 200)
    counts = Counter(name for name, _ in order(EnvMixture(envs, seed=3), 4000))
    assert counts["countdown"] / 4000 == pytest.approx(0.5, abs=0.03)
    assert counts["arithmetic"] / 4000 == pytest.approx(0.25, abs=0.03)
    counts = Counter(name for name, _ in order(EnvMixture(envs, [1.0, 1.0, 8.0], seed=3), 2000))
    assert counts["countdown_all"] / 2000 == pytest.approx(0.8, abs=0.03)


def test_each_task_once_per_epoch(envs):
    mix = EnvMixture(envs[1:2], seed=0)
    first, second = order(mix, 20), order(mix, 20)
    assert sorted(first) == sorted(second) == sorted(("arithmetic", f"train-{i}") for i in range(20))
    assert first != second  # a new permutation each epoch
    # The environment's own seed (EnvConfig.seed=5) picks its tasks.
    assert mix.envs[0].tasks("train", seed=5)[0] in [t for _, t in EnvMixture(envs[1:2], seed=9).next_tasks(20)]


def test_resume_continues_the_same_order(envs):
    whole = order(EnvMixture(envs, seed=4), 90)
    first = EnvMixture(envs, seed=4)
    head = order(first, 37)
    state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
    resumed = EnvMixture(envs, seed=4)
    resumed.set_state(state)
    assert head + order(resumed, 53) == whole
    with pytest.raises(ValueError, match="seed"):
        EnvMixture(envs, seed=5).set_state(state)
    with pytest.raises(ValueError, match="tasks"):
        EnvMixture(envs[:2], seed=4).set_state(state)


def test_bad_mixtures(envs):
    with pytest.raises(ValueError, match="more than once"):
        EnvMixture([envs[0], envs[0]], seed=0)
    with pytest.raises(ValueError, match="> 0"):
        EnvMixture(envs[:2], [1.0, 0.0], seed=0)
    with pytest.raises(ValueError, match="2 weights for 3"):
        EnvMixture(envs, [1.0, 1.0], seed=0)


def traj(env, task_id, reward, *, correct, components, finish="stop", error=None, out=3, cached=0):
    task = Task(env=env, id=task_id, messages=({"role": "user", "content": "q"},))
    n = 2 + out
    return Trajectory(
        task=task,
        sample_index=0,
        token_ids=(1,) * n,
        prompt_length=2,
        loss_mask=(0, 0) + (1,) * out,
        logprobs=(0.0,) * n,
        reward=reward,
        reward_components=components,
        finish_reason=finish,
        reward_error=error,
        metrics={"correct": correct, "formatted": 1.0},
        tokens=TokenCounts(prompt_uncached=2 - cached, prompt_cached=cached, output=out),
    )


def test_aggregate_metrics_per_environment():
    batch = [
        traj("countdown", "t0", 1.0, correct=1.0, components={"format": 0.1, "correct": 0.9}),
        traj("countdown", "t0", 0.1, correct=0.0, components={"format": 0.1, "correct": 0.0}, out=5),
        traj("countdown", "t1", 0.1, correct=0.0, components={"format": 0.1, "correct": 0.0}, cached=1),
        traj("countdown", "t1", 0.1, correct=0.0, components={"format": 0.1, "correct": 0.0}),
        traj("math", "m0", 0.0, correct=0.0, components={"format": 0.0, "correct": 0.0}, finish="length"),
        traj("math", "m0", 0.0, correct=0.0, components={"format": 0.0, "correct": 0.0}, error="timeout after 3 s"),
    ]
    m = aggregate_metrics(batch)
    assert m["countdown/episodes"] == 4 and m["math/episodes"] == 2 and m["all/episodes"] == 6
    assert m["countdown/reward_mean"] == pytest.approx(0.325)
    assert m["countdown/reward_std"] == pytest.approx(0.3897114317)
    assert m["countdown/reward/format_mean"] == pytest.approx(0.1)
    assert m["countdown/reward/correct_mean"] == pytest.approx(0.225)
    assert m["countdown/pass_rate"] == 0.25 and m["countdown/solved_tasks"] == 0.5
    assert m["countdown/zero_variance_groups"] == 0.5  # t1's two rewards are equal
    assert m["countdown/correct_mean"] == 0.25 and m["countdown/formatted_mean"] == 1.0
    assert m["countdown/response_length_mean"] == 3.5 and m["countdown/response_length_max"] == 5
    assert m["countdown/tokens/prompt_cached"] == 1 and m["countdown/tokens/prompt_uncached"] == 7
    assert m["countdown/tokens/output"] == 14
    assert m["math/truncated_rate"] == 0.5 and m["math/reward_errors"] == 1 and m["math/reward_error_rate"] == 0.5
    assert m["all/reward_errors"] == 1 and m["countdown/reward_errors"] == 0
    assert "all/episodes" not in aggregate_metrics(batch[:4])
