"""Tiny model and batch builders shared by the train-core tests."""

import numpy as np
from flax import nnx

from ptrain.config import ModelConfig


def tiny_model_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        max_seq_len=64,
        qk_norm=True,
        tie_embeddings=False,
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(**kw):
    from ptrain.models import Decoder

    cfg = tiny_model_config(**kw)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def random_batch(batch: int = 8, length: int = 16, vocab: int = 64, seed: int = 0) -> dict:
    """Two packed segments per row with uneven loss masks (so micro-batches weigh differently)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, length + 1)).astype(np.int32)
    cut = length // 2 + 1
    seg = np.where(np.arange(length) < cut, 1, 2)[None, :].repeat(batch, 0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(length), np.arange(length) - cut).astype(np.int32)
    mask = (rng.random((batch, length)) < np.linspace(0.2, 0.9, batch)[:, None]).astype(np.float32)
    return dict(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask, segment_ids=seg, positions=pos)
