"""Stage-driver checks that run before any training step."""

import pytest
from flax import nnx

from ptrain.config import ModelConfig, RunConfig
from ptrain.data import build_tokenizer
from ptrain.models import Decoder, save_hf
from ptrain.stages.common import load_model, stage_mesh


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    """Ids past the embedding would read garbage rows and turn the loss NaN (which looks like
    divergence); the load names both sizes and the fix instead."""
    cfg = ModelConfig(
        family="qwen3", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48
    )
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), str(tmp_path))
    run = RunConfig()
    tokenizer = build_tokenizer()
    assert len(tokenizer) > 64
    with pytest.raises(ValueError, match=r"vocabulary of 64 but the tokenizer has \d+ tokens"):
        load_model(run, str(tmp_path), stage_mesh(run), tokenizer)
