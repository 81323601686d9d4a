"""A reward model in place of a verifier (a grpo stage's `reward_model`): each finished episode
of the wrapped environment is rewarded sigmoid(the model's score of its conversation), the
verifier's verdict stays as metrics, and cut or failed episodes are left as they were."""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError
from ptrain.data import tasks as arithmetic_tasks
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.registry import make_env
from ptrain.envs.reward_model import RewardModelScored, RewardModelScorer
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine
from tests.envs.reward_models import score_by_hand, tiny_reward_model


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def reward_model(tok, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rm") / "export")
    return path, tiny_reward_model(tok, path)


def test_finished_episodes_get_the_reward_models_score_and_keep_the_verdict(tok, reward_model):
    path, rm = reward_model
    env = make_env(EnvConfig(kind="arithmetic", n_train=3, n_eval=0), tokenizer=tok)
    scored = RewardModelScored(env, RewardModelScorer(path, tok, max_tokens=512, what="stages.rlhf.reward_model"))
    try:
        task = scored.tasks("train", seed=0)[0]
        problem = arithmetic_tasks.Problem(task.data["op"], task.data["a"], task.data["b"])
        wrong = arithmetic_tasks.worked_solution(problem, arithmetic_tasks._faults(problem)[0])
        answers = [arithmetic_tasks.worked_solution(problem), wrong, Completion(text="Answer:", finish="length")]
        out = asyncio.run(scored.rollout(task, ReplayEngine(answers, tokenizer=tok), SamplingParams(n=3)))
    finally:
        scored.close()
    for t, text, correct in zip(out[:2], answers[:2], (1.0, 0.0)):
        raw = score_by_hand(tok, rm, [*task.messages, {"role": "assistant", "content": text}], len(task.messages))
        assert t.reward == pytest.approx(1 / (1 + math.exp(-raw)), abs=2e-5)
        assert t.reward_components == {"reward_model": t.reward}
        assert t.metrics["correct"] == correct and t.metrics["verifier_reward"] == correct
        assert t.metrics["reward_model_score"] == pytest.approx(raw, abs=2e-5)
    assert out[0].reward != out[1].reward
    assert out[2].finish_reason == "length" and out[2].reward == 0.0 and "reward_model_score" not in out[2].metrics
    assert scored.name == "arithmetic" and scored.stats["reward_model_cut"] == 0


def test_a_failing_reward_model_fails_the_groups_episodes_not_the_batch(tok, reward_model, tmp_path):
    """The weights load at the first score: a folder whose weights went missing after the stage
    started fails that group's episodes with the reason, and nothing else."""
    path, _ = reward_model
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    env = make_env(EnvConfig(kind="arithmetic", n_train=3, n_eval=0), tokenizer=tok)
    scored = RewardModelScored(
        env, RewardModelScorer(str(broken), tok, max_tokens=512, what="stages.rlhf.reward_model")
    )
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    try:
        task = scored.tasks("train", seed=0)[0]
        out = asyncio.run(scored.rollout(task, ReplayEngine(["Answer: 1", "Answer: 2"], tokenizer=tok),
                                         SamplingParams(n=2)))  # fmt: skip
    finally:
        scored.close()
    for t in out:
        assert t.finish_reason == "error" and t.reward == 0.0 and not any(t.loss_mask)
        assert t.error.startswith(f"the reward model ({broken}) failed: EnvConfigError: config key 'stages.rlhf")
    assert scored.stats["reward_model_errors"] == 1


def test_an_empty_answer_gets_nothing_without_being_scored(tok, reward_model):
    """The rm stage's pairs hold no empty answer, so the model has no score for one worth
    trusting: it gets 0, the verdict kept; the other sample of the group is scored."""
    path, _ = reward_model
    env = make_env(EnvConfig(kind="arithmetic", n_train=3, n_eval=0), tokenizer=tok)
    scored = RewardModelScored(env, RewardModelScorer(path, tok, max_tokens=512, what="stages.rlhf.reward_model"))
    try:
        task = scored.tasks("train", seed=0)[0]
        out = asyncio.run(scored.rollout(task, ReplayEngine(["  ", "Answer: 2"], tokenizer=tok), SamplingParams(n=2)))
    finally:
        scored.close()
    assert out[0].reward == 0.0 and out[0].reward_components == {"reward_model": 0.0}
    assert out[0].metrics["correct"] == 0.0 and "reward_model_score" not in out[0].metrics
    assert out[1].reward > 0.0 and "reward_model_score" in out[1].metrics


def test_a_reward_model_with_another_tokenizer_is_refused_when_built(reward_model):
    path, _ = reward_model
    other = build_tokenizer(vocab_size=280)
    with pytest.raises(EnvConfigError, match=r"'stages\.rlhf\.reward_model': the reward model at .* has its own "
                       r"tokenizer, not the policy's"):  # fmt: skip
        RewardModelScorer(path, other, max_tokens=64, what="stages.rlhf.reward_model")


def test_a_long_conversation_is_cut_and_counted(tok, reward_model):
    path, _ = reward_model
    scorer = RewardModelScorer(path, tok, max_tokens=16, what="stages.rlhf.reward_model")
    ids, cut = scorer.response_tokens([{"role": "user", "content": "Say a lot."}], "word " * 50)
    assert cut and len(ids) == 16
    (score,) = scorer.scores([ids])
    assert math.isfinite(score)


def test_rows_are_cut_at_the_length_the_reward_model_was_trained_on(tok, reward_model, tmp_path):
    """A folder that records its trained length (what an rm stage's export does) caps the rows
    the judge scores there, below the caller's limit and the model's positions; the length
    survives a load and a save."""
    from ptrain.models import load_hf_reward_model, save_hf_reward_model
    from ptrain.models.hf import TRAINED_TOKENS_KEY, read_reward_model_config

    path, _ = reward_model
    assert RewardModelScorer(path, tok, max_tokens=100, what="k").max_tokens == 100  # records nothing
    rm = load_hf_reward_model(path)
    rm.trained_tokens = 24
    save_hf_reward_model(rm, str(tmp_path / "rm"), tok)
    assert read_reward_model_config(str(tmp_path / "rm"))[TRAINED_TOKENS_KEY] == 24
    assert load_hf_reward_model(str(tmp_path / "rm")).trained_tokens == 24
    scorer = RewardModelScorer(str(tmp_path / "rm"), tok, max_tokens=100, what="k")
    ids, cut = scorer.response_tokens([{"role": "user", "content": "Say a lot."}], "word " * 50)
    assert scorer.max_tokens == 24 and cut and len(ids) == 24


def test_a_folder_without_a_reward_model_is_refused_naming_the_key(tok, tmp_path):
    with pytest.raises(EnvConfigError, match=r"config key 'stages\.rlhf\.reward_model': no reward model at"):
        RewardModelScorer(str(tmp_path), tok, max_tokens=64, what="stages.rlhf.reward_model")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    with pytest.raises(EnvConfigError, match=r"holds \['LlamaForCausalLM'\], not a reward model"):
        RewardModelScorer(str(tmp_path), tok, max_tokens=64, what="stages.rlhf.reward_model")
