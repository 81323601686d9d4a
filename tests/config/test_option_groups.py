"""The RL stage's option groups (SamplingConfig, AdvantageConfig, PolicyLossConfig): algo.grpo
extends them with its keys unchanged, each checks itself, and the config check reports their
problems under algo.grpo.<field>."""

import dataclasses

import pytest

from ptrain.config import AdvantageConfig, ConfigError, PolicyLossConfig, RunConfig, SamplingConfig
from ptrain.config.grpo import GRPOAlgoConfig
from ptrain.config.run import validate
from ptrain.rollout.protocol import TOP_K_OFF, SamplingParams


def test_algo_grpo_is_each_group_and_each_group_keeps_its_own_check():
    cfg = GRPOAlgoConfig()
    assert isinstance(cfg, SamplingConfig) and isinstance(cfg, AdvantageConfig) and isinstance(cfg, PolicyLossConfig)
    # The checks have distinct names: a shared one would resolve to one group only.
    assert GRPOAlgoConfig.problems is PolicyLossConfig.problems
    assert GRPOAlgoConfig.sampling_problems is SamplingConfig.sampling_problems
    assert GRPOAlgoConfig.advantage_problems is AdvantageConfig.advantage_problems
    names = [f.name for f in dataclasses.fields(GRPOAlgoConfig)]
    loss = [f.name for f in dataclasses.fields(PolicyLossConfig)]
    sampling = [f.name for f in dataclasses.fields(SamplingConfig)]
    adv = [f.name for f in dataclasses.fields(AdvantageConfig)]
    # The keys' order of the pinned resolved configs (tests/golden/recipes): loss, batch shape,
    # sampling, updates, advantages, the rest.
    updates = ["epochs", "mini_batches", "bucket_lengths", "pack_rows"]
    assert names[: len(loss) + 2 + len(sampling) + len(updates) + len(adv)] == [
        *loss, "prompts_per_step", "group_size", *sampling, *updates, *adv,
    ]  # fmt: skip


def test_sampling_params_is_what_the_stage_sent_before():
    """The request equals the one the driver built field by field; top_k 0 (off) is left at
    SGLang's default, which SGLang accepts (it refuses 0) and every engine reads as off."""
    for cfg in (SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12)):
        sent = SamplingParams.from_dict(cfg.sampling_params())
        before = SamplingParams(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else TOP_K_OFF,
        )  # fmt: skip
        assert sent == before
    assert "top_k" not in SamplingConfig(top_k=0).sampling_params()
    assert "top_k" not in SamplingParams.from_dict(SamplingConfig().sampling_params()).to_dict()
    assert SamplingConfig(top_k=5).sampling_params()["top_k"] == 5


@pytest.mark.parametrize(
    "change, key, message",
    [
        (dict(temperature=0.0), "temperature", "must be > 0, got 0.0"),
        (dict(temperature=float("inf")), "temperature", "must be a finite number, got inf"),
        (dict(top_p=1.5), "top_p", "must be in (0, 1], got 1.5"),
        (dict(top_k=-1), "top_k", "must be >= 0 (0: off), got -1"),
        (dict(max_new_tokens=0), "max_new_tokens", "must be > 0, got 0"),
        (dict(baseline="median"), "baseline", "must be one of mean, leave_one_out, got 'median'"),
        (dict(invalid_tool_call_advantage=float("nan")), "invalid_tool_call_advantage",
         "must be a finite number, got nan"),
    ],
)  # fmt: skip
def test_each_group_reports_its_problems_under_algo_grpo(change, key, message):
    cfg = GRPOAlgoConfig(**change)
    assert (key, message) in cfg.sampling_problems() + cfg.advantage_problems()
    run = RunConfig()
    run.algo.grpo = cfg
    with pytest.raises(ConfigError) as e:
        validate(run)
    assert str(e.value).endswith(f"config key 'algo.grpo.{key}': {message}")  # after "stage 'sft': "


def test_defaults_have_no_problems():
    assert SamplingConfig().sampling_problems() == [] and AdvantageConfig().advantage_problems() == []
    assert GRPOAlgoConfig().sampling_problems() == [] and GRPOAlgoConfig().advantage_problems() == []
