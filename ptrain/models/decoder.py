"""The decoder: one configurable stack for the dense (Llama, Qwen2, Qwen3, Mistral) and
MoE (Qwen3-MoE, Mixtral, DeepSeek-V3-style routing) families.

    model = Decoder(cfg, rngs=nnx.Rngs(cfg.seed))
    logits_BxLxV = model(input_ids_BxL, positions_BxL, segment_ids_BxL)
    logits_BxLxV, aux = model(input_ids_BxL, return_aux=True)   # aux: ModelAux

Layers come in two groups: `dense_blocks` (all layers of a dense model; the first
`first_k_dense` layers of an MoE model) and `moe_blocks`. With `cfg.scan_layers` each
group is one stacked module (leading layer axis, logical name None) run by `nnx.scan`;
otherwise a list run by a Python loop. The forward pass is pure given the module state:
no RNG, no dropout, no mutation.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ptrain.config.model import ModelConfig
from ptrain.models.layers import MLP, Attention, RMSNorm, as_dtype, attention_mask, param, rope_inv_freq, rope_tables

REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@struct.dataclass
class ModelAux:
    """Router terms of one forward pass; zeros with E = 0 rows for dense models.

    lb_loss: scalar, Switch load-balancing loss summed over MoE layers (not yet weighted).
    expert_load: [n_moe_layers, E] fraction of routed (token, slot) pairs per expert.
    """

    lb_loss: jax.Array
    expert_load: jax.Array


class _FrozenConfig:
    """Hashable holder of a ModelConfig: NNX keeps static attributes in the GraphDef, which
    jit hashes, and the dataclass itself (with its rope dict) is unhashable."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = dataclasses.replace(cfg)
        self._key = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FrozenConfig) and other._key == self._key

    def __repr__(self) -> str:
        return f"FrozenConfig({self.cfg})"


def validate_config(cfg: ModelConfig) -> None:
    """Raises ValueError naming the field for a model config that cannot be built."""
    checks = [
        (cfg.vocab_size > 0, "model.vocab_size must be > 0 (set it, or let the tokenizer fill it)"),
        (cfg.d_model > 0 and cfg.n_layers > 0, "model.d_model and model.n_layers must be > 0"),
        (cfg.n_heads > 0 and cfg.n_kv_heads > 0, "model.n_heads and model.n_kv_heads must be > 0"),
        (
            cfg.n_heads % max(cfg.n_kv_heads, 1) == 0,
            f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_heads={cfg.n_heads}",
        ),
        (cfg.head_dim > 0 and cfg.head_dim % 2 == 0, f"model.head_dim={cfg.head_dim} must be even and > 0 (RoPE)"),
        (cfg.dtype in ("float32", "bfloat16", "float16"), f"model.dtype={cfg.dtype!r}: pass float32 | bfloat16"),
        (cfg.param_dtype in ("float32", "bfloat16"), f"model.param_dtype={cfg.param_dtype!r}: pass float32 | bfloat16"),
        (cfg.remat in ("none", "full", "dots"), f"model.remat={cfg.remat!r}: pass none | full | dots"),
        (cfg.sliding_window is None or cfg.sliding_window > 0, "model.sliding_window must be null or > 0"),
    ]
    if cfg.n_experts > 0:
        checks += [
            (0 < cfg.top_k <= cfg.n_experts, f"model.top_k={cfg.top_k} must be in [1, n_experts={cfg.n_experts}]"),
            (cfg.router in ("softmax", "sigmoid"), f"model.router={cfg.router!r}: pass softmax | sigmoid"),
            (cfg.n_experts % cfg.n_groups == 0, f"model.n_groups={cfg.n_groups} must divide n_experts={cfg.n_experts}"),
            (1 <= cfg.topk_groups <= cfg.n_groups, f"model.topk_groups={cfg.topk_groups} must be in [1, n_groups]"),
            (
                0 <= cfg.first_k_dense <= cfg.n_layers,
                f"model.first_k_dense={cfg.first_k_dense} must be in [0, n_layers]",
            ),
        ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # raises on an unsupported rope type


class Block(nnx.Module):
    """Pre-norm decoder block: x += attn(norm(x)); x += mlp(norm(x)) with a dense or MoE MLP."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        pd = as_dtype(cfg.param_dtype)
        norm_kw = dict(eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, **norm_kw)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm_kw)
        self.is_moe = moe
        if moe:
            from ptrain.models.moe import MoE

            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg, rngs=rngs)

    def __call__(self, x, cos, sin, mask, kv_cache=None, cache_index=None):
        """x [B, T, D] -> (x, new kv_cache | None, lb_loss scalar, load [E] or [0])."""
        h, new_cache = self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, cache_index)
        x = x + h
        if self.is_moe:
            h, lb_loss, load = self.mlp(self.mlp_norm(x))
        else:
            h = self.mlp(self.mlp_norm(x))
            lb_loss, load = jnp.zeros((), jnp.float32), jnp.zeros((0,), jnp.float32)
        return x + h, new_cache, lb_loss, load


def _make_group(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs):
    if n == 0:
        return None
    if not cfg.scan_layers:
        return nnx.List([Block(cfg, moe, rngs=rngs) for _ in range(n)])

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(r):
        return Block(cfg, moe, rngs=r)

    return make(rngs)


def _call_block(block, x, cos, sin, mask, cache, cache_index, remat: str):
    if remat != "none" and cache is None:
        fn = nnx.remat(lambda b, *a: b(*a), policy=REMAT_POLICIES[remat])
        return fn(block, x, cos, sin, mask)
    return block(x, cos, sin, mask, cache, cache_index)


def _run_group(group, scanned: bool, x, cos, sin, mask, caches, cache_index, remat: str):
    """Runs one group of blocks. caches: None; a list of per-layer (k, v) [B, S, K, Dh]
    (Python loop: each layer's buffers update in place inside a while loop); or, scanned,
    one stacked (k [n, B, S, K, Dh], v [...]).

    Returns (x, new caches | None, lb_loss summed, load [n, E])."""
    if not scanned:
        new_caches, lbs, loads = [], [], []
        for i, block in enumerate(group):
            cache_i = None if caches is None else caches[i]
            x, c, lb, load = _call_block(block, x, cos, sin, mask, cache_i, cache_index, remat)
            lbs.append(lb)
            loads.append(load)
            new_caches.append(c)
        return x, (None if caches is None else new_caches), sum(lbs), jnp.stack(loads)

    if caches is None:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, block):
            y, _, lb, load = _call_block(block, carry, cos, sin, mask, None, None, remat)
            return y, (lb, load)

        x, (lbs, loads) = body(x, group)
        return x, None, jnp.sum(lbs), loads

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    def body_cached(carry, block, cache):
        y, c, lb, load = block(carry, cos, sin, mask, cache, cache_index)
        return y, (c, lb, load)

    x, (new_caches, lbs, loads) = body_cached(x, group, caches)
    return x, new_caches, jnp.sum(lbs), loads


class Decoder(nnx.Module):
    """Decoder-only transformer built from a ModelConfig (see module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        validate_config(cfg)
        self._frozen = _FrozenConfig(cfg)
        pd = as_dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=cfg.init_std, dtype=pd)
        n_dense = cfg.first_k_dense if cfg.is_moe else cfg.n_layers
        self.dense_blocks = _make_group(cfg, False, n_dense, rngs)
        self.moe_blocks = _make_group(cfg, True, cfg.n_layers - n_dense, rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std, dtype=pd)

    @property
    def cfg(self) -> ModelConfig:
        """The model's config (a copy; the module itself is immutable)."""
        return dataclasses.replace(self._frozen.cfg)

    @property
    def n_dense_layers(self) -> int:
        c = self._frozen.cfg
        return c.first_k_dense if c.is_moe else c.n_layers

    def head_weight(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied), param dtype."""
        if self._frozen.cfg.tie_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits_from_hidden(self, h_BxLxD: jax.Array) -> jax.Array:
        """Final-normed hidden states -> float32 logits [B, L, V]."""
        dt = as_dtype(self._frozen.cfg.dtype)
        w = self.head_weight().astype(dt)
        return jnp.einsum("bld,dv->blv", h_BxLxD.astype(dt), w, preferred_element_type=jnp.float32)

    def _trunk(self, input_ids_BxL, positions_BxL, mask_BxTxS, caches=None, cache_index=None):
        cfg = self._frozen.cfg
        dt = as_dtype(cfg.dtype)
        cos, sin = rope_tables(positions_BxL, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        x = jnp.take(self.embed[...], input_ids_BxL, axis=0).astype(dt)
        lb_total = jnp.zeros((), jnp.float32)
        loads = jnp.zeros((0, cfg.n_experts if cfg.is_moe else 0), jnp.float32)
        new_caches = {}
        for name, group in (("dense", self.dense_blocks), ("moe", self.moe_blocks)):
            if group is None:
                continue
            c = None if caches is None else caches[name]
            x, nc, lb, load = _run_group(group, cfg.scan_layers, x, cos, sin, mask_BxTxS, c, cache_index, cfg.remat)
            new_caches[name] = nc
            if name == "moe":
                lb_total, loads = lb_total + lb, load
        return self.final_norm(x), ModelAux(lb_loss=lb_total, expert_load=loads), new_caches

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        return_aux: bool = False,
        return_hidden: bool = False,
    ):
        """Forward pass.

        input_ids_BxL: int token ids. positions: int [B, L] (default arange(L); packed rows
        restart per segment). segment_ids: int [B, L] (default all ones); attention stays
        inside a segment; 0 marks padding. Returns float32 logits [B, L, V] (or the final
        normed hidden states [B, L, D] in the compute dtype if return_hidden), and ModelAux
        if return_aux.
        """
        cfg = self._frozen.cfg
        if input_ids_BxL.ndim != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {input_ids_BxL.shape}")
        B, L = input_ids_BxL.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
        if segment_ids is None:
            segment_ids = jnp.ones((B, L), jnp.int32)
        if positions.shape != (B, L) or segment_ids.shape != (B, L):
            raise ValueError(
                f"positions {positions.shape} and segment_ids {segment_ids.shape} must match input_ids {(B, L)}"
            )
        mask = attention_mask(segment_ids, cfg.sliding_window)
        h, aux, _ = self._trunk(input_ids_BxL, positions, mask)
        out = h if return_hidden else self.logits_from_hidden(h)
        return (out, aux) if return_aux else out

    def decode_step(self, input_ids_BxT, positions_BxT, mask_BxTxS, caches, cache_index):
        """One prefill or decode chunk against the KV cache (see ptrain.models.generate).

        caches: from `init_cache` ({"dense"|"moe": per-layer or stacked (k, v)}); the T new keys are
        written at slots [cache_index, cache_index + T). Returns (float32 logits [B, T, V],
        new caches).
        """
        h, _, new_caches = self._trunk(input_ids_BxT, positions_BxT, mask_BxTxS, caches, cache_index)
        return self.logits_from_hidden(h), new_caches


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict:
    """Zero KV cache pytree for `Decoder.decode_step`, keys and values in the compute dtype
    (or `dtype`): per layer group, a list of per-layer (k, v) [B, max_len, K, Dh], or with
    scan_layers one stacked (k, v) [n_layers_in_group, B, max_len, K, Dh]."""
    dt = as_dtype(dtype or cfg.dtype)
    n_dense = cfg.first_k_dense if cfg.is_moe else cfg.n_layers
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    caches = {}
    for name, n in (("dense", n_dense), ("moe", cfg.n_layers - n_dense)):
        if n and cfg.scan_layers:
            caches[name] = (jnp.zeros((n,) + shape, dt), jnp.zeros((n,) + shape, dt))
        elif n:
            caches[name] = [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(n)]
    return caches


def count_params(cfg: ModelConfig, *, active: bool = False, embedding: bool = True) -> int:
    """Number of parameters; active=True counts only top_k routed experts (plus shared)."""
    D, H, K, Dh, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    attn = D * (H + 2 * K) * Dh + H * Dh * D + (cfg.qkv_bias and (H + 2 * K) * Dh) + (cfg.qk_norm and 2 * Dh)
    dense_mlp = 3 * D * cfg.d_ff
    n_experts = cfg.top_k if active else cfg.n_experts
    moe_mlp = 3 * D * cfg.d_ff_expert * (n_experts + cfg.n_shared_experts) + D * cfg.n_experts
    n_dense = cfg.first_k_dense if cfg.is_moe else cfg.n_layers
    blocks = n_dense * (attn + dense_mlp + 2 * D) + (cfg.n_layers - n_dense) * (attn + moe_mlp + 2 * D)
    emb = V * D * (1 if cfg.tie_embeddings else 2) if embedding else 0
    return int(blocks + D + emb)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B (Chowdhery et al. 2022):

        6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len

    N_matmul counts the active matmul weights, the output head included (also when tied),
    the embedding lookup excluded. The attention term counts the full (non-causal) score
    matrix, as PaLM's MFU does. Forward only is one third of this.
    """
    norms = cfg.n_layers * (2 * cfg.d_model + (cfg.qk_norm and 2 * cfg.head_dim)) + cfg.d_model
    n_matmul = count_params(cfg, active=True, embedding=False) - norms + cfg.vocab_size * cfg.d_model
    return float(6 * n_matmul + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len)
