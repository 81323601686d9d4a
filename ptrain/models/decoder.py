"""The decoder: one configurable stack for the dense (Llama, Qwen2, Qwen3, Mistral) and
MoE (Qwen3-MoE, Mixtral, DeepSeek-V3-style routing) families.

    model = Decoder(cfg, rngs=nnx.Rngs(cfg.seed))
    logits_BxLxV = model(input_ids_BxL, positions_BxL, segment_ids_BxL)
    logits_BxLxV, aux = model(input_ids_BxL, return_aux=True)   # aux: ModelAux
    scores_B = RewardModel(model, rngs=..., pad_token_id=pad)(input_ids_BxL, segment_ids=seg_BxL)

Layers come in groups: each run of consecutive layers with the same MLP kind (dense or
MoE, per `moe_layer_flags`) is one group, held in the attribute `dense_blocks` /
`moe_blocks` for the first run of its kind and `dense_blocks_1`, `moe_blocks_1`, ... for
later ones (`layer_groups`). A dense model is one `dense_blocks` group; a DeepSeek-style
model `dense_blocks` then `moe_blocks`; Qwen3-MoE with `mlp_only_layers` or
`decoder_sparse_step` alternates. With `cfg.scan_layers` each group is one stacked module
(leading layer axis, logical name None) run by `nnx.scan`; otherwise a list run by a
Python loop. The forward pass is pure given the module state: no RNG, no dropout, no
mutation.

Expert parallelism: `Decoder(cfg, rngs=..., mesh=mesh, rules=rules)` (what `load_hf(...,
mesh=)` does) hands the mesh to every MoE block when the rules put the logical `expert`
axis on a mesh axis of size > 1; the block then dispatches tokens to the devices holding
their experts with all-to-all (`ptrain.kernels.moe.expert_parallel`). Without a mesh the
model names logical axes only, and any sharding of the experts is left to XLA.

Context parallelism: with a mesh whose axis for the logical `length` axis is larger than 1
(`mesh.context`), a forward pass without a cache splits every sequence over it, and the
attention layers cross the split as `model.context_attention` says
(`ptrain.models.context_parallel`). A batch whose length does not divide runs unsplit.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ptrain.config import choices
from ptrain.config.model import ModelConfig
from ptrain.models import lora, weights
from ptrain.models.layers import MLP, Attention, RMSNorm, as_dtype, attention_mask, param, rope_inv_freq, rope_tables

REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
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
        (cfg.dtype in choices.COMPUTE_DTYPES, f"model.dtype={cfg.dtype!r}: pass {' | '.join(choices.COMPUTE_DTYPES)}"),
        (cfg.param_dtype in choices.PARAM_DTYPES, f"model.param_dtype={cfg.param_dtype!r}: pass float32 | bfloat16"),
        (cfg.remat in choices.REMAT_MODES, f"model.remat={cfg.remat!r}: pass {' | '.join(choices.REMAT_MODES)}"),
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
            (
                all(isinstance(i, int) and 0 <= i < cfg.n_layers for i in cfg.dense_layers),
                f"model.dense_layers={list(cfg.dense_layers)} must hold layer indices in [0, n_layers={cfg.n_layers})",
            ),
            (cfg.moe_layer_step >= 1, f"model.moe_layer_step={cfg.moe_layer_step} must be >= 1"),
        ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # raises on an unsupported rope type


def moe_layer_flags(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether its MLP is MoE: never in a dense model; in an MoE model layer i is
    MoE when i >= first_k_dense, i is not in dense_layers and (i + 1) % moe_layer_step == 0
    (the rule of transformers' Qwen3MoeDecoderLayer, plus DeepSeek's first dense layers)."""
    if not cfg.is_moe:
        return (False,) * cfg.n_layers
    dense = set(cfg.dense_layers)
    return tuple(
        i >= cfg.first_k_dense and i not in dense and (i + 1) % cfg.moe_layer_step == 0 for i in range(cfg.n_layers)
    )


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """A run of consecutive layers with the same MLP kind.

    name: the Decoder attribute holding it (`dense_blocks`, `moe_blocks`, `dense_blocks_1`, ...);
    cache_key: its entry in the `init_cache` dict (`dense`, `moe`, `dense_1`, ...);
    moe: MoE or dense MLP; start: index of its first layer; n: number of layers.
    """

    name: str
    cache_key: str
    moe: bool
    start: int
    n: int


def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The model's layer groups in layer order (see the module docstring)."""
    groups: list[LayerGroup] = []
    seen = {False: 0, True: 0}
    for i, moe in enumerate(moe_layer_flags(cfg)):
        if groups and groups[-1].moe == moe:
            groups[-1] = dataclasses.replace(groups[-1], n=groups[-1].n + 1)
            continue
        kind = "moe" if moe else "dense"
        suffix = f"_{seen[moe]}" if seen[moe] else ""
        seen[moe] += 1
        groups.append(LayerGroup(f"{kind}_blocks{suffix}", f"{kind}{suffix}", moe, i, 1))
    return tuple(groups)


class Block(nnx.Module):
    """Pre-norm decoder block: x += attn(norm(x)); x += mlp(norm(x)) with a dense or MoE MLP."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs, ep=None, cp=None):
        pd = as_dtype(cfg.param_dtype)
        norm_kw = dict(eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, **norm_kw)
        self.attn = Attention(cfg, rngs=rngs, cp=cp)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm_kw)
        self.is_moe = moe
        if moe:
            from ptrain.models.moe import MoE

            self.mlp = MoE(cfg, rngs=rngs, ep=ep)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg, rngs=rngs)

    def __call__(self, x, cos, sin, mask, kv_cache=None, cache_index=None, token_mask=None):
        """x [B, T, D] -> (x, new kv_cache | None, lb_loss scalar, load [E] or [0]); token_mask
        [B, T] (or None): the real tokens, to which an MoE block's load statistics are limited."""
        h, new_cache = self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, cache_index)
        x = x + h
        if self.is_moe:
            h, lb_loss, load = self.mlp(self.mlp_norm(x), token_mask)
        else:
            h = self.mlp(self.mlp_norm(x))
            lb_loss, load = jnp.zeros((), jnp.float32), jnp.zeros((0,), jnp.float32)
        return x + h, new_cache, lb_loss, load


def _make_group(cfg: ModelConfig, moe: bool, n: int, rngs: nnx.Rngs, ep=None, cp=None):
    if not cfg.scan_layers:
        return nnx.List([Block(cfg, moe, rngs=rngs, ep=ep, cp=cp) for _ in range(n)])

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(r):
        return Block(cfg, moe, rngs=r, ep=ep, cp=cp)

    return make(rngs)


def _call_block(block, x, cos, sin, mask, cache, cache_index, remat: str, token_mask=None):
    if remat != "none" and cache is None:
        fn = nnx.remat(lambda b, *a: b(*a), policy=REMAT_POLICIES[remat])
        return fn(block, x, cos, sin, mask, None, None, token_mask)
    return block(x, cos, sin, mask, cache, cache_index, token_mask)


def _run_group(group, scanned: bool, x, cos, sin, mask, caches, cache_index, remat: str, token_mask=None):
    """Runs one group of blocks. caches: None; a list of per-layer (k, v) [B, S, K, Dh]
    (Python loop: each layer's buffers update in place inside a while loop); or, scanned,
    one stacked (k [n, B, S, K, Dh], v [...]).

    Returns (x, new caches | None, lb_loss summed, load [n, E])."""
    if not scanned:
        new_caches, lbs, loads = [], [], []
        for i, block in enumerate(group):
            cache_i = None if caches is None else caches[i]
            x, c, lb, load = _call_block(block, x, cos, sin, mask, cache_i, cache_index, remat, token_mask)
            lbs.append(lb)
            loads.append(load)
            new_caches.append(c)
        return x, (None if caches is None else new_caches), sum(lbs), jnp.stack(loads)

    if caches is None:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, block):
            y, _, lb, load = _call_block(block, carry, cos, sin, mask, None, None, remat, token_mask)
            return y, (lb, load)

        x, (lbs, loads) = body(x, group)
        return x, None, jnp.sum(lbs), loads

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    def body_cached(carry, block, cache):
        y, c, lb, load = block(carry, cos, sin, mask, cache, cache_index, token_mask)
        return y, (c, lb, load)

    x, (new_caches, lbs, loads) = body_cached(x, group, caches)
    return x, new_caches, jnp.sum(lbs), loads


class Decoder(nnx.Module):
    """Decoder-only transformer built from a ModelConfig (see module docstring).

    mesh, rules: optional; with a mesh whose axis for the logical `expert` axis (under
    `rules`, default ptrain.parallel.DEFAULT_RULES) is larger than 1, the MoE blocks run
    expert-parallel on it (`ptrain.models.moe.expert_parallel_plan`). The mesh becomes a
    static part of the module (its GraphDef), not of its state.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None, rules=None):
        validate_config(cfg)
        self._frozen = _FrozenConfig(cfg)
        pd = as_dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), std=cfg.init_std, dtype=pd)
        from ptrain.models.context_parallel import context_parallel_plan
        from ptrain.models.moe import expert_parallel_plan

        ep = expert_parallel_plan(cfg, mesh, rules)
        self._cp = context_parallel_plan(cfg, mesh, rules)
        self._groups = layer_groups(cfg)
        for g in self._groups:
            setattr(self, g.name, _make_group(cfg, g.moe, g.n, rngs, ep=ep if g.moe else None, cp=self._cp))
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std, dtype=pd)

    @property
    def cfg(self) -> ModelConfig:
        """The model's config (a copy; the module itself is immutable)."""
        return dataclasses.replace(self._frozen.cfg)

    @property
    def n_dense_layers(self) -> int:
        """Layers with a dense MLP."""
        return sum(not m for m in moe_layer_flags(self._frozen.cfg))

    def head_weight(self) -> jax.Array:
        """Output projection [D, V] (the transposed embedding when tied), param dtype."""
        if self._frozen.cfg.tie_embeddings:
            return self.embed[...].T
        return lora.merged(self.lm_head[...])  # the chunked vocabulary loss reads the head whole

    def logits_from_hidden(self, h_BxLxD: jax.Array) -> jax.Array:
        """Final-normed hidden states -> float32 logits [B, L, V]."""
        return weights.logits(h_BxLxD, self.head_weight(), as_dtype(self._frozen.cfg.dtype))

    def _trunk(self, input_ids_BxL, positions_BxL, mask_BxTxS, caches=None, cache_index=None, cp=None,
               token_mask=None):  # fmt: skip
        cfg = self._frozen.cfg
        dt = as_dtype(cfg.dtype)
        cos, sin = rope_tables(positions_BxL, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        if cp is not None:
            input_ids_BxL = cp.constrain(input_ids_BxL)
        x = jnp.take(self.embed[...], input_ids_BxL, axis=0).astype(dt)
        if cp is not None:
            x = cp.constrain(x)
        lb_total = jnp.zeros((), jnp.float32)
        loads = [jnp.zeros((0, cfg.n_experts if cfg.is_moe else 0), jnp.float32)]
        new_caches = {}
        for g in self._groups:
            c = None if caches is None else caches[g.cache_key]
            group = getattr(self, g.name)
            x, nc, lb, load = _run_group(
                group, cfg.scan_layers, x, cos, sin, mask_BxTxS, c, cache_index, cfg.remat, token_mask
            )
            new_caches[g.cache_key] = nc
            if g.moe:
                lb_total, loads = lb_total + lb, loads + [load]
        aux = ModelAux(lb_loss=lb_total, expert_load=jnp.concatenate(loads))  # MoE layers in layer order
        h = self.final_norm(x)
        return (h if cp is None else cp.constrain(h)), aux, new_caches

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
        # Padding (segment id 0) stays out of the MoE load statistics: the balancing loss and
        # the expert-bias update learn from real tokens only.
        token_mask = None if segment_ids is None or not cfg.is_moe else segment_ids > 0
        if segment_ids is None:
            segment_ids = jnp.ones((B, L), jnp.int32)
        if positions.shape != (B, L) or segment_ids.shape != (B, L):
            raise ValueError(
                f"positions {positions.shape} and segment_ids {segment_ids.shape} must match input_ids {(B, L)}"
            )
        cp = self._cp if self._cp is not None and self._cp.applies(B, L) else None
        # Split over a context axis, attention builds its mask per block from the segment ids.
        mask = attention_mask(segment_ids, cfg.sliding_window) if cp is None else segment_ids
        h, aux, _ = self._trunk(input_ids_BxL, positions, mask, cp=cp, token_mask=token_mask)
        out = h if return_hidden else self.logits_from_hidden(h)
        return (out, aux) if return_aux else out

    def decode_step(self, input_ids_BxT, positions_BxT, mask_BxTxS, caches, cache_index):
        """One prefill or decode chunk against the KV cache (see ptrain.models.generate).

        caches: from `init_cache` ({group cache key: per-layer or stacked (k, v)}); the T new keys are
        written at slots [cache_index, cache_index + T). Returns (float32 logits [B, T, V],
        new caches).
        """
        h, _, new_caches = self._trunk(input_ids_BxT, positions_BxT, mask_BxTxS, caches, cache_index)
        return self.logits_from_hidden(h), new_caches


def last_token_index(
    input_ids_BxL: jax.Array, segment_ids_BxL: jax.Array | None = None, pad_token_id: int | None = None
) -> jax.Array:
    """Index [B] (int32) of the token each row is scored at: the rightmost real token
    (segment id > 0) whose id is not `pad_token_id`.

    This is transformers' *ForSequenceClassification rule (the rightmost token that is not
    pad_token_id, whatever the padding side), restricted to real tokens so that our own
    padding, whatever id it holds, never counts. A real token equal to pad_token_id (a tokenizer
    that pads with its end-of-sequence token, at the end of the sequence) is skipped as
    transformers skips it, so scores agree after export. A row with no such token gives 0,
    as there. One sequence per row: a packed row is scored at its last segment only.
    """
    B, L = input_ids_BxL.shape
    keep = jnp.ones((B, L), jnp.int32) if segment_ids_BxL is None else (segment_ids_BxL > 0).astype(jnp.int32)
    if pad_token_id is not None:
        keep = keep * (input_ids_BxL != pad_token_id).astype(jnp.int32)
    return jnp.argmax(jnp.arange(L, dtype=jnp.int32)[None, :] * keep, axis=-1).astype(jnp.int32)


class RewardModel(nnx.Module):
    """A decoder with a scalar score head: r(x) = h_last . w, with h_last the final-normed
    hidden state [D] at the row's scored token (`last_token_index`) and w a bias-free
    [D, 1] projection.

    This is the layout of transformers' *ForSequenceClassification with num_labels=1 (`model`
    the decoder trunk, `score` the head), which `ptrain.models.hf.save_hf_reward_model`
    writes and `load_hf_reward_model` reads. The head is composed around a plain Decoder,
    so the policy paths (load_hf, save_hf, generation, sharding rules) stay as they are;
    the parameters split as {"model": the decoder's, "score": [D, 1]}.

    The decoder is taken over, not copied: its untied LM head [D, V] is deleted, as the
    score never reads it (at a 150k vocabulary it would be the largest weight, with
    gradients and optimizer state to match). A tied head is the embedding and stays.

    pad_token_id: the id transformers will read from the exported config.json and pool
    by; None scores the last real token of each row.
    trained_tokens: the longest row it was trained on, exported as config.json's
    `ptrain_trained_tokens` so a judge scores no longer rows (None: not known).
    init_std: std of the head's normal initialisation; None: 1/sqrt(d_model), so the
    initial scores are of order one whatever the width.
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        rngs: nnx.Rngs,
        pad_token_id: int | None = None,
        init_std: float | None = None,
        trained_tokens: int | None = None,
    ):
        cfg = decoder.cfg
        if hasattr(decoder, "lm_head"):
            del decoder.lm_head
        self.model = decoder
        self.pad_token_id = pad_token_id
        self.trained_tokens = trained_tokens
        std = cfg.d_model**-0.5 if init_std is None else init_std
        self.score = param(rngs, (cfg.d_model, 1), ("embed", None), std=std, dtype=as_dtype(cfg.param_dtype))

    @property
    def cfg(self) -> ModelConfig:
        """The decoder's config (a copy)."""
        return self.model.cfg

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        return_aux: bool = False,
    ):
        """Scores float32 [B] of one sequence per row (right-padded: segment id 0 marks padding;
        positions and segment_ids default as in Decoder.__call__), and ModelAux if return_aux."""
        h_BxLxD, aux = self.model(input_ids_BxL, positions, segment_ids, return_aux=True, return_hidden=True)
        idx_B = last_token_index(input_ids_BxL, segment_ids, self.pad_token_id)
        h_BxD = h_BxLxD[jnp.arange(h_BxLxD.shape[0]), idx_B]
        dt = as_dtype(self.cfg.dtype)
        w_Dx1 = self.score[...].astype(dt)
        scores_B = jnp.einsum("bd,do->b", h_BxD.astype(dt), w_Dx1, preferred_element_type=jnp.float32)
        return (scores_B, aux) if return_aux else scores_B


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict:
    """Zero KV cache pytree for `Decoder.decode_step`, keys and values in the compute dtype
    (or `dtype`): per layer group (keyed by `LayerGroup.cache_key`: "dense", "moe", "dense_1",
    ...), a list of per-layer (k, v) [B, K, max_len, Dh], or with scan_layers one stacked
    (k, v) [n_layers_in_group, B, K, max_len, Dh]. Head-major, so that a row's keys for one
    head are contiguous (`ptrain.models.layers.attend_cached`)."""
    dt = as_dtype(dtype or cfg.dtype)
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    caches = {}
    for g in layer_groups(cfg):
        if cfg.scan_layers:
            caches[g.cache_key] = (jnp.zeros((g.n,) + shape, dt), jnp.zeros((g.n,) + shape, dt))
        else:
            caches[g.cache_key] = [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(g.n)]
    return caches


def count_params(cfg: ModelConfig, *, active: bool = False, embedding: bool = True) -> int:
    """Number of parameters; active=True counts only top_k routed experts (plus shared)."""
    D, H, K, Dh, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    attn = D * (H + 2 * K) * Dh + H * Dh * D + (cfg.qkv_bias and (H + 2 * K) * Dh) + (cfg.qk_norm and 2 * Dh)
    dense_mlp = 3 * D * cfg.d_ff
    n_experts = cfg.top_k if active else cfg.n_experts
    moe_mlp = 3 * D * cfg.d_ff_expert * (n_experts + cfg.n_shared_experts) + D * cfg.n_experts
    n_moe = sum(moe_layer_flags(cfg))
    blocks = (cfg.n_layers - n_moe) * (attn + dense_mlp + 2 * D) + n_moe * (attn + moe_mlp + 2 * D)
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
