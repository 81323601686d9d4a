"""`make_engine`: the local engine's context length from rollout.context_length, or from
train.seq_len capped at what the model can hold."""

import dataclasses
import inspect

import pytest
from flax import nnx

from ptrain.config import ConfigError, RunConfig
from ptrain.config.model import ModelConfig
from ptrain.models import Decoder
from ptrain.rollout.engines import make_engine
from ptrain.train.state import split_model

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48, max_seq_len=64)


class _Tokenizer:
    eos_token_id = 63

    def get_vocab(self):
        return {}


@pytest.fixture(scope="module")
def parts():
    return split_model(Decoder(CFG, rngs=nnx.Rngs(0)))


def engine_for(parts, *, seq_len, context_length=None):
    run = RunConfig()
    run.train = dataclasses.replace(run.train, seq_len=seq_len)
    run.rollout = dataclasses.replace(run.rollout, max_running_requests=2, context_length=context_length)
    model_def, params, model_state = parts
    return make_engine(run, model_def, params, model_state, mesh=None, tokenizer=_Tokenizer(), seed=0)


def test_a_seq_len_at_the_models_limit_caps_the_default_context(parts):
    with engine_for(parts, seq_len=CFG.max_seq_len) as eng:
        assert eng.context_length == CFG.max_seq_len
    with engine_for(parts, seq_len=32) as eng:
        assert eng.context_length == 33


def test_a_context_length_beyond_the_model_names_the_key(parts):
    with pytest.raises(ConfigError, match=r"'rollout.context_length': 100 exceeds the model's max_seq_len=64"):
        engine_for(parts, seq_len=32, context_length=100)


def test_the_engines_an_rl_stage_syncs_take_weights_through_the_protocol():
    from ptrain.rollout.fleet import FleetEngine
    from ptrain.rollout.local import LocalEngine
    from ptrain.rollout.protocol import SWAP_MODES, RolloutEngine, WeightSyncedEngine
    from ptrain.rollout.replay import ReplayEngine

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48,
                      max_seq_len=32)  # fmt: skip
    with LocalEngine(Decoder(cfg, rngs=nnx.Rngs(0)), max_running_requests=2) as engine:
        assert isinstance(engine, WeightSyncedEngine)
    assert isinstance(ReplayEngine(), RolloutEngine) and not isinstance(ReplayEngine(), WeightSyncedEngine)
    for cls in (LocalEngine, FleetEngine):
        assert inspect.signature(cls.update_weights).parameters["mode"].default == "drain"
    assert SWAP_MODES == ("drain", "abort", "in_place")
