"""A tiny Bradley-Terry reward model over a test tokenizer, exported as the rm stage exports
one, and its score of a conversation computed directly (no padding, no bucketing)."""

from __future__ import annotations

import numpy as np


def tiny_reward_model(tok, path: str):
    """Writes a 2-layer Llama reward model (score head drawn with std 1, so that different
    texts get clearly different scores) to `path`; returns the in-memory model."""
    from flax import nnx

    from ptrain.config.model import ModelConfig
    from ptrain.models import Decoder, RewardModel, save_hf_reward_model

    cfg = ModelConfig(family="llama", vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=48, max_seq_len=512, qk_norm=False)  # fmt: skip
    rm = RewardModel(Decoder(cfg, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1), pad_token_id=tok.pad_token_id, init_std=1.0)
    save_hf_reward_model(rm, path, tok)
    return rm


def score_by_hand(tok, rm, messages, n_prompt: int) -> float:
    from ptrain.data.chat import tokenize_conversations

    ((ids, _),) = tokenize_conversations(tok, [(list(messages), n_prompt)])
    return float(np.asarray(rm(ids[None, :]))[0])
