"""Models: the Flax NNX decoder, Hugging Face import/export, KV-cache generation.

Public entry points (tests, tools and stages rely on these names):
  Decoder(cfg, rngs=nnx.Rngs(seed))      dense and MoE decoder; model(ids_BxL) -> logits_BxLxV
  load_hf(path, dtype=...) / save_hf(model, path, tokenizer=None)
  generate(model, prompts, ...)          prefill + incremental decode with a KV cache
  flops_per_token(cfg, seq_len)          training FLOPs per token for MFU
"""

from ptrain.models.decoder import Decoder, ModelAux, count_params, flops_per_token, init_cache, validate_config
from ptrain.models.generate import GenerateOutput, generate
from ptrain.models.hf import config_from_hf, config_to_hf, load_hf, save_hf

__all__ = [
    "Decoder",
    "GenerateOutput",
    "ModelAux",
    "config_from_hf",
    "config_to_hf",
    "count_params",
    "flops_per_token",
    "generate",
    "init_cache",
    "load_hf",
    "save_hf",
    "validate_config",
]
