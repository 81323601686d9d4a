"""One top-level seed: component seeds derived per component, resolved once, still overridable."""

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ptrain.config import ConfigError, DataConfig, RunConfig, register_configs, stage_config, to_run_config
from ptrain.config.seeds import SEEDED_KEYS, component_seed, derive_seed, seed_or_default

register_configs()


def composed(*overrides):
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def seeds_of(run) -> dict:
    return {
        "model.seed": run.model.seed,
        "data.shuffle_seed": run.data.shuffle_seed,
        "data.generated.seed": run.data.generated.seed,
        "train.seed": run.train.seed,
    }


def test_derivation_is_deterministic_31_bit_and_separate_per_component():
    got = {(s, k): derive_seed(s, k) for s in range(4) for k in SEEDED_KEYS}
    assert got == {(s, k): derive_seed(s, k) for s in range(4) for k in SEEDED_KEYS}
    assert all(isinstance(v, int) and 0 <= v < 2**31 for v in got.values())
    assert len(set(got.values())) == len(got)  # no two (seed, component) pairs share a stream
    # pinned: the scheme is part of what a run's seed means (ptrain/config/seeds.py)
    assert derive_seed(0, "model.seed") == 1540917229
    with pytest.raises(ValueError, match="'seed'"):
        derive_seed(-1, "model.seed")


def test_null_component_seeds_are_resolved_from_the_top_level_seed():
    run = to_run_config(composed("seed=7"))
    assert run.seed == 7
    assert seeds_of(run) == {k: derive_seed(7, k) for k in SEEDED_KEYS}
    # the saved config shows the concrete values
    text = OmegaConf.to_yaml(OmegaConf.structured(run))
    assert f"seed: {derive_seed(7, 'data.generated.seed')}" in text and "seed: null" not in text


def test_two_seeds_change_every_component():
    a, b = seeds_of(to_run_config(composed("seed=1"))), seeds_of(to_run_config(composed("seed=2")))
    assert all(a[k] != b[k] for k in SEEDED_KEYS)


def test_an_explicit_component_seed_is_kept():
    run = to_run_config(composed("seed=3", "data.shuffle_seed=0", "model.seed=11"))
    assert run.data.shuffle_seed == 0 and run.model.seed == 11
    assert run.train.seed == derive_seed(3, "train.seed")
    assert run.data.generated.seed == derive_seed(3, "data.generated.seed")


def test_a_stage_override_of_a_component_seed_wins():
    run = to_run_config(composed("seed=5"))
    run.stages[0].train = {"seed": 123}
    assert stage_config(run, run.stages[0]).train.seed == 123
    run.stages[0].train = {"seed": None}  # back to null: derived again, from the run's seed
    assert stage_config(run, run.stages[0]).train.seed == derive_seed(5, "train.seed")


def test_a_negative_seed_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="config key 'seed'"):
        to_run_config(composed("seed=-1"))


def test_configs_built_in_code_derive_the_same_seeds():
    """A RunConfig or DataConfig made directly (not through to_run_config) means by null
    what a resolved default run has."""
    resolved = to_run_config(composed())
    assert component_seed(RunConfig(), "train.seed") == resolved.train.seed
    assert component_seed(RunConfig(seed=4), "model.seed") == derive_seed(4, "model.seed")
    assert seed_or_default(DataConfig().shuffle_seed, "data.shuffle_seed") == resolved.data.shuffle_seed
    assert seed_or_default(9, "data.shuffle_seed") == 9
