"""A tiny Qwen3 saved in Hugging Face format with the embedded tokenizer, its output head
untied (so a Tinker adapter's `train_unembed` has a weight to adapt)."""

from __future__ import annotations

import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.data.tokenizer import get_tokenizer
from ptrain.models import Decoder, save_hf


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        max_seq_len=512,
        tie_embeddings=False,
    )


@pytest.fixture(scope="session")
def tinker_model_dir(tmp_path_factory) -> str:
    tokenizer = get_tokenizer(None, str(tmp_path_factory.mktemp("tinker_tokenizer")), vocab_size=300)
    path = str(tmp_path_factory.mktemp("tinker") / "model")
    save_hf(Decoder(tiny_config(len(tokenizer)), rngs=nnx.Rngs(0)), path, tokenizer=tokenizer)
    return path
