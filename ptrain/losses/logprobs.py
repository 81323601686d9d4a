"""Per-token log-probabilities, entropy and log-normaliser, chunked over the vocabulary.

One pass over the vocabulary in chunks of `chunk_size` columns gives, for every
position, the statistics all losses need:

  logp     = z[y] - logsumexp(z)                       log-probability of the given token y
  entropy  = logsumexp(z) - sum_v softmax(z)_v z_v      entropy of the predictive distribution
  lse      = logsumexp(z)                               log-normaliser (z-loss, PaLM 2204.02311)
  mean_logit = (1/V) sum_v z_v                         (label smoothing's uniform term)
  is_argmax  = 1[z[y] == max_v z_v]                     (token accuracy)

with z = logits / temperature. The log-sum-exp is computed online (running max m,
running sum s = sum exp(z - m), and t = sum exp(z - m) (z - m) for the entropy) so
no full-vocabulary softmax is ever materialised; the log-prob is formed as
(z[y] - m) - log s, never as z[y] - (m + log s), which keeps it exact to float32
resolution of the *difference* even at |z| ~ 1e4. Logits of -inf (a masked vocabulary
entry) get probability 0 without NaN in values or gradients.

The gradient is a custom VJP that recomputes the softmax chunk by chunk:
  d/dz_v = g_logp (1[v=y] - p_v) + g_H p_v (lse - H - z_v) + g_lse p_v + g_mean_logit / V.

Two entry points:
  `vocab_stats(logits_BxLxV, ...)`           logits already materialised.
  `vocab_stats_from_hidden(h_BxLxD, W_DxV, ...)`  logits formed chunk by chunk from the last
      hidden state and the output-head matrix, so BxLxV logits never exist (forward or
      backward); the backward pass returns d h and d W directly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 8192


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VocabStats:
    """Per-position statistics of the predictive distribution, all float32 `[B, L]`.

    Attributes:
      logp: log-probability of the given token, log softmax(z)[y].
      entropy: entropy of softmax(z), in nats.
      lse: log-sum-exp of z (log-normaliser).
      mean_logit: mean of z over the vocabulary.
      is_argmax: 1.0 where the given token has the largest logit (ties count), else 0.0.
        Carries no gradient.
    """

    logp: jax.Array
    entropy: jax.Array
    lse: jax.Array
    mean_logit: jax.Array
    is_argmax: jax.Array


def _check_chunk(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return min(vocab, DEFAULT_CHUNK_SIZE)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(
            f"chunk_size must be a positive int (columns of the vocabulary per chunk), got {chunk_size!r}."
        )
    return min(chunk_size, vocab)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (logits are divided by it), got {temperature!r}.")


def _check_targets(target_ids, lead_shape, what: str) -> None:
    if tuple(target_ids.shape) != tuple(lead_shape):
        raise ValueError(
            f"target_ids has shape {tuple(target_ids.shape)} but {what} has leading shape "
            f"{tuple(lead_shape)}; they must match (one target per position)."
        )
    if not jnp.issubdtype(target_ids.dtype, jnp.integer):
        raise TypeError(f"target_ids must be an integer array of token ids, got dtype {target_ids.dtype}.")


# ---------------------------------------------------------------------------------------------
# Chunk-level math shared by both entry points.


def _chunk_bounds(vocab: int, chunk: int) -> tuple[int, int]:
    """Number of full chunks and the size of the trailing partial chunk (static)."""
    return vocab // chunk, vocab % chunk


def _forward_scan(get_chunk: Callable[[jax.Array, int], jax.Array], targets, lead_shape, vocab: int, chunk: int):
    """Online statistics over vocabulary chunks.

    `get_chunk(start, size)` returns float32 z[..., start:start+size] (start may be traced,
    size is static). Returns (m, log_s, H, z_target, sum_z), each `lead_shape`.
    """
    n_full, rem = _chunk_bounds(vocab, chunk)
    f32 = jnp.float32
    m0 = jnp.full(lead_shape, -jnp.inf, f32)
    zero = jnp.zeros(lead_shape, f32)

    def update(carry, z, start):
        m, s, t, zt, sz = carry
        size = z.shape[-1]
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        # A row whose logits are all -inf so far has m_new = -inf; shift by 0 there to avoid inf - inf.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        scale = jnp.exp(m - m_safe)
        d = z - m_safe[..., None]
        e = jnp.exp(d)
        ed = jnp.where(e > 0, e * d, 0.0)  # 0 * (-inf) would be nan for masked (-inf) logits
        # Rescale the old t to the new max: exp(z-m)(z-m) -> exp(z-m')(z-m') = scale*exp(z-m)((z-m) + (m-m')).
        shift = jnp.where(s > 0, (m - m_safe) * s, 0.0)
        t_new = scale * (t + shift) + jnp.sum(ed, axis=-1)
        s_new = scale * s + jnp.sum(e, axis=-1)
        local = targets - start
        in_chunk = (local >= 0) & (local < size)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1)[..., None], axis=-1)[..., 0]
        zt_new = jnp.where(in_chunk, picked, zt)
        sz_new = sz + jnp.sum(jnp.where(jnp.isfinite(z), z, 0.0), axis=-1)
        return (m_new, s_new, t_new, zt_new, sz_new)

    carry = (m0, zero, zero, zero, zero)
    if n_full:

        def body(i, c):
            start = i * chunk
            return update(c, get_chunk(start, chunk), start)

        carry = jax.lax.fori_loop(0, n_full, body, carry)
    if rem:
        carry = update(carry, get_chunk(n_full * chunk, rem), n_full * chunk)
    m, s, t, zt, sz = carry
    log_s = jnp.log(s)
    entropy = log_s - t / s
    return m, log_s, entropy, zt, sz


def _stats_from_scan(m, log_s, entropy, zt, sz, vocab: int) -> VocabStats:
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return VocabStats(
        logp=(zt - m_safe) - log_s,
        entropy=entropy,
        lse=m_safe + log_s,
        mean_logit=sz / vocab,
        is_argmax=(zt >= m).astype(jnp.float32),
    )


def _chunk_dz(z, start, targets, m_safe, log_s, entropy, g: VocabStats, vocab: int):
    """Cotangent of the chunk's z (float32 `[..., size]`) given output cotangents `g`."""
    d = z - m_safe[..., None]
    p = jnp.exp(d - log_s[..., None])
    onehot = (targets[..., None] - start) == jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    # lse - H - z = log_s - H - (z - m): written in shifted form for the same precision reason.
    dz = (
        g.logp[..., None] * (onehot.astype(jnp.float32) - p)
        + g.entropy[..., None] * jnp.where(p > 0, p * ((log_s - entropy)[..., None] - d), 0.0)
        + g.lse[..., None] * p
        + g.mean_logit[..., None] / vocab
    )
    return dz


# ---------------------------------------------------------------------------------------------
# Logits entry point.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _vocab_stats_logits(logits, targets, chunk: int, temperature: float) -> VocabStats:
    out, _ = _vocab_stats_logits_fwd(logits, targets, chunk, temperature)
    return out


def _logits_chunk_getter(logits, temperature: float):
    def get(start, size):
        z = jax.lax.dynamic_slice_in_dim(logits, start, size, axis=-1).astype(jnp.float32)
        return z / temperature if temperature != 1.0 else z

    return get


def _vocab_stats_logits_fwd(logits, targets, chunk, temperature):
    vocab = logits.shape[-1]
    m, log_s, entropy, zt, sz = _forward_scan(
        _logits_chunk_getter(logits, temperature), targets, logits.shape[:-1], vocab, chunk
    )
    out = _stats_from_scan(m, log_s, entropy, zt, sz, vocab)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return out, (logits, targets, m_safe, log_s, entropy)


def _vocab_stats_logits_bwd(chunk, temperature, res, g: VocabStats):
    logits, targets, m_safe, log_s, entropy = res
    vocab = logits.shape[-1]
    get = _logits_chunk_getter(logits, temperature)
    n_full, rem = _chunk_bounds(vocab, chunk)

    def dlogits(start, size):
        dz = _chunk_dz(get(start, size), start, targets, m_safe, log_s, entropy, g, vocab)
        return (dz / temperature).astype(logits.dtype)

    # Write chunk gradients in place into one buffer (XLA updates a loop-carried buffer in place).
    out = jnp.zeros_like(logits)
    if n_full:

        def body(i, buf):
            start = i * chunk
            return jax.lax.dynamic_update_slice_in_dim(buf, dlogits(start, chunk), start, axis=-1)

        out = jax.lax.fori_loop(0, n_full, body, out)
    if rem:
        out = jax.lax.dynamic_update_slice_in_dim(out, dlogits(n_full * chunk, rem), n_full * chunk, axis=-1)
    return out, None


_vocab_stats_logits.defvjp(_vocab_stats_logits_fwd, _vocab_stats_logits_bwd)


def vocab_stats(
    logits_BxLxV: jax.Array, target_ids_BxL: jax.Array, *, chunk_size: int | None = None, temperature: float = 1.0
) -> VocabStats:
    """Statistics of softmax(logits / temperature) at every position, chunked over the vocabulary.

    Args:
      logits_BxLxV: float logits (any float dtype; math is float32). Any leading shape works;
        `[B, L, V]` is the usual one.
      target_ids_BxL: int token ids whose log-probability is wanted (same leading shape).
      chunk_size: vocabulary columns per chunk (default min(V, 8192)); peak extra memory is
        about leading_size x chunk_size float32.
      temperature: logits are divided by it (sampling temperature of RL rollouts).

    Returns:
      `VocabStats` of float32 arrays with the leading shape. Differentiable in the logits.
    """
    _check_targets(target_ids_BxL, logits_BxLxV.shape[:-1], "logits")
    _check_temperature(temperature)
    chunk = _check_chunk(chunk_size, logits_BxLxV.shape[-1])
    return _vocab_stats_logits(logits_BxLxV, target_ids_BxL.astype(jnp.int32), chunk, float(temperature))


def token_logprobs(
    logits_BxLxV: jax.Array, target_ids_BxL: jax.Array, *, chunk_size: int | None = None, temperature: float = 1.0
) -> jax.Array:
    """log p(y_t) = log softmax(logits_t / temperature)[y_t], float32 `[B, L]`, chunked over V."""
    return vocab_stats(logits_BxLxV, target_ids_BxL, chunk_size=chunk_size, temperature=temperature).logp


def entropy_from_logits(
    logits_BxLxV: jax.Array, *, chunk_size: int | None = None, temperature: float = 1.0
) -> jax.Array:
    """H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_tv with z = logits / temperature; float32 `[B, L]`."""
    dummy = jnp.zeros(logits_BxLxV.shape[:-1], jnp.int32)
    return vocab_stats(logits_BxLxV, dummy, chunk_size=chunk_size, temperature=temperature).entropy


# ---------------------------------------------------------------------------------------------
# Hidden-state entry point: logits z = (h @ W) / temperature, built one vocabulary chunk at a time.


def _hidden_chunk_getter(hidden, head, temperature: float):
    def get(start, size):
        w = jax.lax.dynamic_slice_in_dim(head, start, size, axis=1)
        z = jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)
        return z / temperature if temperature != 1.0 else z

    return get


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _vocab_stats_hidden(hidden, head, targets, chunk: int, temperature: float) -> VocabStats:
    out, _ = _vocab_stats_hidden_fwd(hidden, head, targets, chunk, temperature)
    return out


def _vocab_stats_hidden_fwd(hidden, head, targets, chunk, temperature):
    vocab = head.shape[1]
    m, log_s, entropy, zt, sz = _forward_scan(
        _hidden_chunk_getter(hidden, head, temperature), targets, hidden.shape[:-1], vocab, chunk
    )
    out = _stats_from_scan(m, log_s, entropy, zt, sz, vocab)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return out, (hidden, head, targets, m_safe, log_s, entropy)


def _vocab_stats_hidden_bwd(chunk, temperature, res, g: VocabStats):
    hidden, head, targets, m_safe, log_s, entropy = res
    vocab = head.shape[1]
    get = _hidden_chunk_getter(hidden, head, temperature)
    n_full, rem = _chunk_bounds(vocab, chunk)
    lead = hidden.ndim - 1
    f32 = jnp.float32

    def grads(start, size):
        dz = _chunk_dz(get(start, size), start, targets, m_safe, log_s, entropy, g, vocab) / temperature
        w = jax.lax.dynamic_slice_in_dim(head, start, size, axis=1)
        dh = jnp.einsum("...v,dv->...d", dz, w.astype(f32), preferred_element_type=f32)
        dw = jnp.tensordot(hidden.astype(f32), dz, axes=(tuple(range(lead)), tuple(range(lead))))
        return dh, dw

    dh = jnp.zeros(hidden.shape, f32)
    dw = jnp.zeros(head.shape, f32)
    if n_full:

        def body(i, c):
            dh_acc, dw_acc = c
            start = i * chunk
            dh_i, dw_i = grads(start, chunk)
            return dh_acc + dh_i, jax.lax.dynamic_update_slice_in_dim(dw_acc, dw_i, start, axis=1)

        dh, dw = jax.lax.fori_loop(0, n_full, body, (dh, dw))
    if rem:
        dh_i, dw_i = grads(n_full * chunk, rem)
        dh = dh + dh_i
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_i, n_full * chunk, axis=1)
    return dh.astype(hidden.dtype), dw.astype(head.dtype), None


_vocab_stats_hidden.defvjp(_vocab_stats_hidden_fwd, _vocab_stats_hidden_bwd)


def vocab_stats_from_hidden(
    hidden_BxLxD: jax.Array,
    head_DxV: jax.Array,
    target_ids_BxL: jax.Array,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> VocabStats:
    """`vocab_stats` of logits = hidden @ head without materialising the `[B, L, V]` logits.

    Args:
      hidden_BxLxD: final hidden states (after the final norm), any float dtype.
      head_DxV: output-head matrix (for tied embeddings pass `embedding_VxD.T`).
      target_ids_BxL: int token ids.
      chunk_size: vocabulary columns per chunk (default min(V, 8192)); peak extra memory is
        about B x L x chunk_size float32, in the forward and the backward pass.
      temperature: logits are divided by it.

    Returns:
      `VocabStats`; differentiable in `hidden_BxLxD` and `head_DxV`. The backward pass recomputes
      each logits chunk, so forward + backward cost four head-sized matmuls against three with
      materialised logits (measured in docs/perf_losses.md: about the same time on CPU, a tenth
      of the memory).
    """
    if head_DxV.ndim != 2 or head_DxV.shape[0] != hidden_BxLxD.shape[-1]:
        raise ValueError(
            f"head_DxV must be [D, V] with D = hidden size {hidden_BxLxD.shape[-1]}, got shape "
            f"{tuple(head_DxV.shape)} (for a [V, D] embedding matrix pass its transpose)."
        )
    _check_targets(target_ids_BxL, hidden_BxLxD.shape[:-1], "hidden")
    _check_temperature(temperature)
    chunk = _check_chunk(chunk_size, head_DxV.shape[1])
    return _vocab_stats_hidden(hidden_BxLxD, head_DxV, target_ids_BxL.astype(jnp.int32), chunk, float(temperature))


def token_logprobs_from_hidden(
    hidden_BxLxD: jax.Array,
    head_DxV: jax.Array,
    target_ids_BxL: jax.Array,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> jax.Array:
    """log softmax((h_t @ W) / temperature)[y_t], float32 `[B, L]`, without `[B, L, V]` logits."""
    return vocab_stats_from_hidden(
        hidden_BxLxD, head_DxV, target_ids_BxL, chunk_size=chunk_size, temperature=temperature
    ).logp


def sequence_logprobs(logp_BxL: jax.Array, mask_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-sequence summed log-probs and token counts: (sum_t m_t logp_t, sum_t m_t), each `[B]`.

    This is the input the preference losses take (`policy_chosen_logps`, `chosen_token_counts`).
    """
    if logp_BxL.shape != mask_BxL.shape:
        raise ValueError(
            f"logp_BxL {tuple(logp_BxL.shape)} and mask_BxL {tuple(mask_BxL.shape)} must have the same shape."
        )
    mask = mask_BxL.astype(jnp.float32)
    return jnp.sum(logp_BxL * mask, axis=-1), jnp.sum(mask, axis=-1)
