"""Models: the Flax NNX decoder, Hugging Face import/export, KV-cache generation.

Public entry points (tests, tools and stages rely on these names):
  Decoder(cfg, rngs=nnx.Rngs(seed))      dense and MoE decoder; model(ids_BxL) -> logits_BxLxV
  RewardModel(decoder, rngs=..., pad_token_id=id)
                                         decoder + scalar score head; rm(ids_BxL) -> scores_B
  load_hf(path, dtype=...) / save_hf(model, path, tokenizer=None)
  save_hf_reward_model(rm, path, tokenizer=None) / load_hf_reward_model(path, dtype=...)
                                         a RewardModel as a *ForSequenceClassification folder
  generate(model, prompts, ...)          prefill + incremental decode with a KV cache
  flops_per_token(cfg, seq_len)          training FLOPs per token for MFU
  pack_decode_weights(params)            dense weights in the CPU matmul kernel's layout, for decode
  update_router_bias(state, load, rate)  aux-loss-free router bias step (RouterBias is not a Param)
"""

from ptrain.models.decoder import (
    Decoder,
    ModelAux,
    RewardModel,
    count_params,
    flops_per_token,
    init_cache,
    last_token_index,
    validate_config,
)
from ptrain.models.generate import GenerateOutput, generate
from ptrain.models.hf import (
    config_from_hf,
    config_to_hf,
    load_hf,
    load_hf_reward_model,
    save_hf,
    save_hf_reward_model,
)
from ptrain.models.moe import RouterBias, update_router_bias
from ptrain.models.weights import pack_decode_weights

__all__ = [
    "Decoder",
    "GenerateOutput",
    "ModelAux",
    "RewardModel",
    "RouterBias",
    "config_from_hf",
    "config_to_hf",
    "count_params",
    "flops_per_token",
    "generate",
    "init_cache",
    "last_token_index",
    "load_hf",
    "load_hf_reward_model",
    "pack_decode_weights",
    "save_hf",
    "save_hf_reward_model",
    "update_router_bias",
    "validate_config",
]
