"""Building blocks of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds *logical* axis
names (vocab, embed, mlp, heads, kv_heads, head_dim, expert, None); `ptrain.parallel`
maps them onto mesh axes. Nothing here knows about the mesh. Parameters are created
without eager sharding, so a model can be built with or without a mesh in context.

Numerics: parameters are stored in `param_dtype` (float32 master weights) and cast to
the compute dtype at use; norms, RoPE tables and the attention softmax run in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ptrain.kernels import cpu as cpu_kernels
from ptrain.models import weights

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Scores of masked keys. Finite (not -inf) so that a query row with every key masked
# (padding) gets a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def as_dtype(name: str | Any) -> Any:
    """Maps a config dtype name ("float32" | "bfloat16" | "float16") to a jnp dtype."""
    if not isinstance(name, str):
        return jnp.dtype(name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; pass one of {sorted(DTYPES)}")
    return DTYPES[name]


def param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    axes: Sequence[str | None],
    *,
    std: float = 0.02,
    init: str = "normal",
    dtype: Any = jnp.float32,
) -> nnx.Param:
    """Creates an `nnx.Param` of `shape` annotated with logical `axes`.

    init: "normal" (N(0, std^2)), "ones" or "zeros". Eager sharding is off: the names
    are logical, and the parallel package turns them into shardings by its rules.
    """
    if len(axes) != len(shape):
        raise ValueError(f"axes {tuple(axes)} do not match shape {tuple(shape)}")
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), tuple(shape), dtype)
    elif init == "ones":
        value = jnp.ones(tuple(shape), dtype)
    elif init == "zeros":
        value = jnp.zeros(tuple(shape), dtype)
    else:
        raise ValueError(f"unknown init {init!r}; pass normal | ones | zeros")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, normalised in float32 (Zhang & Sennrich 2019).

    The scale multiplies after the cast back to the input dtype, as transformers does.
    """

    def __init__(self, dim: int, *, eps: float, axis_name: str | None, param_dtype: Any, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), init="ones", dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        scale = self.scale[...].astype(x.dtype)
        return y * scale.reshape((1,) * (x.ndim - 1) + scale.shape)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies [head_dim/2] of rotary embeddings (Su et al. 2021), float32.

    scaling: HF rope dict; supports rope_type default, linear and llama3 (Llama 3.1+).
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(
            f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3. "
            "Set model.rope_scaling=null or convert the checkpoint's rope settings."
        )
    return inv.astype(np.float32)


def rope_tables(positions_BxL: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables [B, L, Dh/2] in float32 for integer positions."""
    freqs = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x_BxLxNxDh: jax.Array, cos_BxLxR: jax.Array, sin_BxLxR: jax.Array) -> jax.Array:
    """Rotates the two halves of each head (the HF `rotate_half` layout, not interleaved)."""
    half = x_BxLxNxDh.shape[-1] // 2
    x1, x2 = x_BxLxNxDh[..., :half], x_BxLxNxDh[..., half:]
    cos = cos_BxLxR[:, :, None, :].astype(x_BxLxNxDh.dtype)
    sin = sin_BxLxR[:, :, None, :].astype(x_BxLxNxDh.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ------------------------------------------------------------------------ attention


def attention_mask(segment_ids_BxL: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """Boolean mask [B, L, L]: causal and same-segment (and within the sliding window).

    The diagonal is always allowed, so padding (segment 0) attends to itself and no row is
    empty.
    """
    L = segment_ids_BxL.shape[1]
    idx = jnp.arange(L)
    allowed = idx[:, None] >= idx[None, :]
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return same & allowed[None, :, :]


def attend(q_BxTxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array, mask_BxTxS: jax.Array) -> jax.Array:
    """Masked softmax attention with grouped KV heads; scores and softmax in float32.

    out = softmax(q k^T / sqrt(Dh) + mask) v  (Vaswani et al. 2017; GQA: Ainslie et al. 2023)
    Returns [B, T, H, Dh] in the dtype of q.
    """
    B, T, H, Dh = q_BxTxHxDh.shape
    K = k_BxSxKxDh.shape[2]
    q = q_BxTxHxDh.reshape(B, T, K, H // K, Dh)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxDh, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(Dh))
    s = jnp.where(mask_BxTxS[:, None, None, :, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v_BxSxKxDh)
    return out.reshape(B, T, H, Dh)


def attend_cached(
    q_BxTxHxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """`attend` against a head-major KV cache ([B, K, S, Dh], as `init_cache` lays it out).

    Per (row, kv head) the keys are one contiguous [S, Dh] block, so both products are
    batched matmuls over contiguous operands; with the cache stored [B, S, K, Dh] XLA:CPU
    strided through it, and the engine's decode ran 1.1-1.3x slower (docs/performance.md,
    the rollout engine).
    """
    B, T, H, Dh = q_BxTxHxDh.shape
    K = k_BxKxSxDh.shape[1]
    q = q_BxTxHxDh.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    s = jnp.einsum("bkgtd,bksd->bkgts", q, k_BxKxSxDh, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(Dh))
    s = jnp.where(mask_BxTxS[:, None, None, :, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v_BxKxSxDh.dtype)
    # Output head-major too, then one small transpose: asked for [B, T, K, G, Dh] directly,
    # XLA:CPU computed V^T p with the result transposed, 1.3x slower for the whole step.
    out = jnp.einsum("bkgts,bksd->bkgtd", p, v_BxKxSxDh)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


ATTN_QUERY_CHUNK = 64
"""Query block of the causal self-attention without a cache. Each block attends only to
keys up to its own end (and from its sliding-window start), skipping the masked upper
triangle; on CPU at L=512 this ran 3.4x faster (forward + backward) than the full masked
softmax and 2.6x faster than jax.nn.dot_product_attention (docs/perf_models.md)."""


def _query_blocks(L: int, chunk: int, window: int | None) -> list[tuple[int, int, int]]:
    """(query start, query end, first key) of each block; keys run up to the query end."""
    return [(s, min(s + chunk, L), 0 if window is None else max(0, s - window + 1)) for s in range(0, L, chunk)]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked_attention(q_BxKxLxGxDh, k_BxKxLxDh, v_BxKxLxDh, mask_BxLxL, window, chunk):
    return _blocked_attention_fwd(q_BxKxLxGxDh, k_BxKxLxDh, v_BxKxLxDh, mask_BxLxL, window, chunk)[0]


def _blocked_attention_fwd(q, k, v, mask, window, chunk):
    """Head-major blocked softmax attention; q is already scaled by 1/sqrt(Dh).

    Each block keeps its unnormalised probabilities p = exp(s - max) and row sums l for the
    backward pass, and divides the [rows, Dh] output by l rather than p itself: one pass
    over the scores fewer than softmax-then-matmul.
    """
    B, K, L, G, Dh = q.shape
    k_t = jnp.swapaxes(k, -1, -2)  # [B, K, Dh, L]: every block's score dot reads plain rows
    outs, probs, sums = [], [], []
    for s, e, ks in _query_blocks(L, chunk, window):
        rows = (e - s) * G
        qb = q[:, :, s:e].reshape(B, K, rows, Dh)
        sc = jnp.einsum("bkrd,bkds->bkrs", qb, k_t[..., ks:e], preferred_element_type=jnp.float32)
        sc = sc.reshape(B, K, e - s, G, e - ks)
        sc = jnp.where(mask[:, None, s:e, None, ks:e], sc, MASK_VALUE)
        p = jnp.exp(sc - jnp.max(sc, axis=-1, keepdims=True)).reshape(B, K, rows, e - ks)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), v[:, :, ks:e], preferred_element_type=jnp.float32)
        outs.append((o / l).reshape(B, K, e - s, G, Dh))
        probs.append(p)
        sums.append(l)
    out = jnp.concatenate(outs, axis=2).astype(q.dtype)
    return out, (q, k, v, out, probs, sums)


def _blocked_attention_bwd(window, chunk, residuals, dout):
    """Per block, with dO' = dO / l (the softmax normalisation moved onto the small side):
    dV += p^T dO', dS = p * (dO' V^T - rowsum(dO' * O)), dQ = dS K, dK += dS^T Q.
    Masked keys have p = 0, so dS needs no mask.

    dK and dV are built transposed ([Dh, keys] per head): XLA:CPU runs a dot that contracts
    the rows of both operands (p^T dO') at about half the speed of one whose small operand
    is the transposed side (dO'^T p), and the final [Dh, L] -> [L, Dh] transpose is small."""
    q, k, v, out, probs, sums = residuals
    B, K, L, G, Dh = q.shape
    dq = []
    dk_t = jnp.zeros((B, K, Dh, L), jnp.float32)
    dv_t = jnp.zeros((B, K, Dh, L), jnp.float32)
    for (s, e, ks), p, l in zip(_query_blocks(L, chunk, window), probs, sums):
        rows = (e - s) * G
        do = dout[:, :, s:e].reshape(B, K, rows, Dh).astype(jnp.float32) / l
        delta = jnp.sum(do * out[:, :, s:e].reshape(B, K, rows, Dh).astype(jnp.float32), axis=-1, keepdims=True)
        do = do.astype(v.dtype)
        dv_t = dv_t.at[..., ks:e].add(
            jnp.einsum("bkrd,bkrs->bkds", do, p.astype(v.dtype), preferred_element_type=jnp.float32)
        )
        dp = jnp.einsum("bkrd,bksd->bkrs", do, v[:, :, ks:e], preferred_element_type=jnp.float32)
        ds = (p * (dp - delta)).astype(q.dtype)
        dq.append(
            jnp.einsum("bkrs,bksd->bkrd", ds, k[:, :, ks:e], preferred_element_type=jnp.float32).reshape(
                B, K, e - s, G, Dh
            )
        )
        qb = q[:, :, s:e].reshape(B, K, rows, Dh)
        dk_t = dk_t.at[..., ks:e].add(jnp.einsum("bkrd,bkrs->bkds", qb, ds, preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq, axis=2).astype(q.dtype)
    dk, dv = jnp.swapaxes(dk_t, -1, -2), jnp.swapaxes(dv_t, -1, -2)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


def causal_attend(
    q_BxLxHxDh: jax.Array,
    k_BxLxKxDh: jax.Array,
    v_BxLxKxDh: jax.Array,
    mask_BxLxL: jax.Array,
    sliding_window: int | None = None,
    chunk: int = ATTN_QUERY_CHUNK,
) -> jax.Array:
    """`attend` for self-attention over one sequence (queries and keys at the same slots)
    with a causal mask, computed block by block over queries (static shapes per block) in a
    head-major layout, with a hand-written backward pass (`_blocked_attention_bwd`)."""
    B, L, H, Dh = q_BxLxHxDh.shape
    K = k_BxLxKxDh.shape[2]
    q = (q_BxLxHxDh * (1.0 / math.sqrt(Dh))).reshape(B, L, K, H // K, Dh).transpose(0, 2, 1, 3, 4)
    k = k_BxLxKxDh.transpose(0, 2, 1, 3)
    v = v_BxLxKxDh.transpose(0, 2, 1, 3)
    out = _blocked_attention(q, k, v, mask_BxLxL, sliding_window, chunk)
    return out.transpose(0, 2, 1, 3, 4).reshape(B, L, H, Dh)


class Attention(nnx.Module):
    """Grouped-query self-attention with optional q/k bias and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs, cp=None):
        D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cp = cp  # a ptrain.models.context_parallel.ContextParallel plan, or None
        pd = as_dtype(cfg.param_dtype)
        self.dtype = as_dtype(cfg.dtype)
        self.q = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), std=cfg.init_std, dtype=pd)
        self.k = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), std=cfg.init_std, dtype=pd)
        self.v = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), std=cfg.init_std, dtype=pd)
        self.o = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), std=cfg.init_std, dtype=pd)
        self.head_dim = Dh
        self.qkv_bias = cfg.qkv_bias
        self.sliding_window = cfg.sliding_window
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (H, Dh), ("heads", "head_dim"), init="zeros", dtype=pd)
            self.k_bias = param(rngs, (K, Dh), ("kv_heads", "head_dim"), init="zeros", dtype=pd)
            self.v_bias = param(rngs, (K, Dh), ("kv_heads", "head_dim"), init="zeros", dtype=pd)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            kw = dict(eps=cfg.rms_norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)
            self.q_norm = RMSNorm(Dh, **kw)
            self.k_norm = RMSNorm(Dh, **kw)

    def _projections(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, Dh], k and v [B, T, K, Dh]."""
        q, k, v = weights.attention_qkv(x_BxTxD, self.q[...], self.k[...], self.v[...], self.head_dim, self.dtype)
        if self.qkv_bias:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            q, k, v = (y + b[...].astype(self.dtype)[None, None] for y, b in zip((q, k, v), biases))
        return q, k, v

    def __call__(
        self,
        x_BxTxD: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask_BxTxS: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Self-attention over x. Returns (out [B, T, D], updated cache or None).

        mask_BxTxS: boolean [B, T, S]; or, when the decoder splits the sequence over a
        context axis (its `cp` plan), the int segment ids [B, T] the plan builds each block's
        mask from, since no device may hold a whole [T, T] mask.

        With `kv_cache` (k, v, each [R, K, S_max, Dh], R >= B): the batch is cache rows
        [0, B). The T new keys/values of row b are written at slots cache_index + [0, T):
        `cache_index` is a scalar (every row the same) or a [B] vector of per-row slots,
        where a slot >= S_max writes nothing (an idle row of a serving batch). Queries attend
        to cache slots [0, S) with S = mask_BxTxS.shape[-1] <= S_max, so a caller bounds the
        keys read by the length it knows is in use."""
        q, k, v = self._projections(x_BxTxD)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            if mask_BxTxS.ndim == 2:
                out = self.cp.attend(q, k, v, mask_BxTxS, self.sliding_window)
            else:
                out = causal_attend(q, k, v, mask_BxTxS, self.sliding_window)
            # the one activation model.remat=attention keeps for the backward pass
            return self._out(checkpoint_name(out, "attention_out")), None
        ck, cv = kv_cache
        B, T, K = k.shape[:3]
        k_new, v_new = k.transpose(0, 2, 1, 3).astype(ck.dtype), v.transpose(0, 2, 1, 3).astype(cv.dtype)
        cache_index = jnp.asarray(cache_index, jnp.int32)
        if cache_index.ndim == 0:
            zero = jnp.zeros((), jnp.int32)
            start = (zero, zero, cache_index, zero)
            ck = jax.lax.dynamic_update_slice(ck, k_new, start)
            cv = jax.lax.dynamic_update_slice(cv, v_new, start)
        else:
            rows = jnp.arange(B, dtype=jnp.int32)[:, None, None]
            heads = jnp.arange(K, dtype=jnp.int32)[None, :, None]
            slots = (cache_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :])[:, None, :]
            ck = ck.at[rows, heads, slots].set(k_new, mode="drop")
            cv = cv.at[rows, heads, slots].set(v_new, mode="drop")
        if cpu_kernels.use_decode_attention(q, ck, mask_BxTxS):
            out = cpu_kernels.decode_attention(q[:, 0], ck, cv, mask_BxTxS[:, 0])[:, None]
        else:
            S = mask_BxTxS.shape[-1]
            keys, values = ck[:B, :, :S].astype(self.dtype), cv[:B, :, :S].astype(self.dtype)
            out = attend_cached(q, keys, values, mask_BxTxS)
        return self._out(out), (ck, cv)

    def _out(self, out_BxTxHxDh: jax.Array) -> jax.Array:
        return weights.attention_out(out_BxTxHxDh, self.o[...], self.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x W_gate) * (x W_up)) (Shazeer 2020)."""

    def __init__(self, d_model: int, d_ff: int, cfg: Any, *, rngs: nnx.Rngs):
        pd = as_dtype(cfg.param_dtype)
        self.dtype = as_dtype(cfg.dtype)
        self.gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), std=cfg.init_std, dtype=pd)
        self.up = param(rngs, (d_model, d_ff), ("embed", "mlp"), std=cfg.init_std, dtype=pd)
        self.down = param(rngs, (d_ff, d_model), ("mlp", "embed"), std=cfg.init_std, dtype=pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        return weights.gated_mlp(x, self.gate[...], self.up[...], self.down[...], self.dtype, swiglu)


@jax.custom_vjp
def swiglu(x: jax.Array, w_gate_DxF: jax.Array, w_up_DxF: jax.Array, w_down_FxD: jax.Array) -> jax.Array:
    """down(silu(x W_gate) * (x W_up)) with a hand-written backward pass: the SiLU-and-product
    derivative is one elementwise expression over [tokens, F] that also rebuilds the hidden
    activation, where autodiff left several passes (11% of the MLP's forward + backward on
    CPU, docs/performance.md)."""
    return _swiglu_fwd(x, w_gate_DxF, w_up_DxF, w_down_FxD)[0]


def _swiglu_fwd(x, w_gate, w_up, w_down):
    g, u = x @ w_gate, x @ w_up
    return (jax.nn.silu(g) * u) @ w_down, (x, w_gate, w_up, w_down, g, u)


def _swiglu_bwd(residuals, dy):
    x, w_gate, w_up, w_down, g, u = residuals
    dh = (dy @ w_down.T).astype(jnp.float32)
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    act = g32 * sig  # silu(g); d silu / dg = sig + silu(g) (1 - sig)
    h = (act * u32).astype(x.dtype)
    dg = (dh * u32 * (sig + act * (1.0 - sig))).astype(x.dtype)
    du = (dh * act).astype(x.dtype)
    dx = dg @ w_gate.T + du @ w_up.T
    return (
        dx,
        _over_tokens(x, dg).astype(w_gate.dtype),
        _over_tokens(x, du).astype(w_up.dtype),
        _over_tokens(h, dy).astype(w_down.dtype),
    )


def _over_tokens(a: jax.Array, b: jax.Array) -> jax.Array:
    """a^T b for a [..., M] and b [..., N]: [M, N] summed over every leading (token) axis.
    Contracted in place rather than flattened to [tokens, M] first: a flatten of a batch
    split and a sequence split (context parallelism) made XLA gather the sequence."""
    lead = tuple(range(a.ndim - 1))
    return jax.lax.dot_general(a, b, ((lead, lead), ((), ())))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
