"""Supervised fine-tuning loss: next-token cross-entropy with label smoothing and z-loss.

Per-token loss at a position with target y and logits z (V classes):
  l_t = (1 - eps) (-log p(y)) + eps (-(1/V) sum_v log p(v)) + c_z lse(z)^2
      = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + c_z lse^2
label smoothing: Szegedy et al. 1512.00567; z-loss: PaLM, Chowdhery et al. 2204.02311 (c_z = 1e-4 there).

Aggregations over the masked tokens (m_t = loss_mask):
  token_mean     sum_t m_t l_t / sum_t m_t                             (every token weighs the same)
  sequence_mean  mean over sequences s of (sum_{t in s} m_t l_t / sum_{t in s} m_t)
                 (every sequence weighs the same; with packing a sequence is a segment)
  sum            sum_t m_t l_t / norm_constant                         (constant denominator)

Gradient accumulation: a micro-batch's `aux.loss_sum` and `aux.token_count` add up across
micro-batches, so the exact token mean of a global batch is sum(loss_sum) / sum(token_count);
equivalently call each micro-batch with `aggregation="sum", norm_constant=global_token_count`
and add the results. For sequence_mean use `aux.seq_loss_sum / aux.seq_count` the same way.

Memory: `sft_loss` takes materialised logits; `sft_loss_from_stats(vocab_stats_from_hidden(h, W,
targets), mask, ...)` gives the same loss from the last hidden state and the output head without
ever forming `[B, L, V]` logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ptrain.losses.logprobs import VocabStats, vocab_stats
from ptrain.losses.reduce import safe_divide, sequence_sums

SFT_AGGREGATIONS = ("token_mean", "sequence_mean", "sum")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SFTAux:
    """Metrics of one SFT loss call (float32 scalars); sums and counts add across micro-batches.

    Attributes:
      loss_sum: sum_t m_t l_t (smoothing and z-loss included).
      nll_sum: sum_t m_t (-log p(y_t)), the plain cross-entropy numerator (for perplexity).
      z_loss_sum: sum_t m_t lse_t^2 (unscaled).
      token_count: sum_t m_t.
      correct_count: sum_t m_t 1[y_t = argmax z_t].
      seq_loss_sum: sum over sequences of their token-mean loss.
      seq_count: number of sequences (segments) with at least one counted token.
    """

    loss_sum: jax.Array
    nll_sum: jax.Array
    z_loss_sum: jax.Array
    token_count: jax.Array
    correct_count: jax.Array
    seq_loss_sum: jax.Array
    seq_count: jax.Array


def _check_common(target_shape, loss_mask, label_smoothing, z_loss):
    if tuple(loss_mask.shape) != tuple(target_shape):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected [B, L] = {tuple(target_shape)}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}.")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0 (coefficient of lse^2), got {z_loss!r}.")


def _check_logits(logits, target_ids):
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, L, V], got shape {tuple(logits.shape)}.")
    if tuple(target_ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"target_ids has shape {tuple(target_ids.shape)}, expected [B, L] = {tuple(logits.shape[:2])}."
        )


def token_losses_from_stats(stats: VocabStats, *, label_smoothing: float = 0.0, z_loss: float = 0.0) -> jax.Array:
    """Per-token SFT loss l_t (module docstring) from `vocab_stats` output, float32 `[B, L]`."""
    nll = -stats.logp
    loss = nll
    if label_smoothing:
        # -(1/V) sum_v log p(v) = lse - mean_v z_v.
        loss = (1.0 - label_smoothing) * nll + label_smoothing * (stats.lse - stats.mean_logit)
    if z_loss:
        loss = loss + z_loss * jnp.square(stats.lse)
    return loss


def sft_token_losses(
    logits_BxLxV: jax.Array,
    target_ids_BxL: jax.Array,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
) -> jax.Array:
    """Unmasked per-token SFT loss l_t (formula in the module docstring), float32 `[B, L]`.

    Positions whose loss does not count still get a value; multiply by the loss mask.
    """
    _check_logits(logits_BxLxV, target_ids_BxL)
    _check_common(target_ids_BxL.shape, target_ids_BxL, label_smoothing, z_loss)
    stats = vocab_stats(logits_BxLxV, target_ids_BxL, chunk_size=chunk_size)
    return token_losses_from_stats(stats, label_smoothing=label_smoothing, z_loss=z_loss)


def sft_loss(
    logits_BxLxV: jax.Array,
    target_ids_BxL: jax.Array,
    loss_mask_BxL: jax.Array,
    *,
    aggregation: str = "token_mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    norm_constant: float | jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
    chunk_size: int | None = None,
) -> tuple[jax.Array, SFTAux]:
    """SFT cross-entropy over the masked target tokens.

    Args:
      logits_BxLxV: model logits (any float dtype).
      target_ids_BxL: int32 next-token targets (batch contract `target_ids`).
      loss_mask_BxL: 1.0 where the target counts (batch contract `loss_mask`).
      aggregation: "token_mean", "sequence_mean" or "sum" (module docstring); a batch with no
        counted token gives loss 0, not NaN.
      label_smoothing: eps in [0, 1).
      z_loss: coefficient c_z of lse^2 (PaLM uses 1e-4).
      norm_constant: denominator for aggregation="sum" (e.g. the global token count of the
        accumulated batch, or a fixed budget such as batch_size x max_length).
      segment_ids_BxL: batch contract `segment_ids`; with sequence_mean each packed segment is
        its own sequence. Ignored by the other aggregations.
      chunk_size: vocabulary chunk of the log-softmax (see `vocab_stats`).

    Returns:
      (scalar float32 loss, SFTAux).
    """
    _check_logits(logits_BxLxV, target_ids_BxL)
    _check_common(target_ids_BxL.shape, loss_mask_BxL, label_smoothing, z_loss)
    stats = vocab_stats(logits_BxLxV, target_ids_BxL, chunk_size=chunk_size)
    return sft_loss_from_stats(
        stats,
        loss_mask_BxL,
        aggregation=aggregation,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        norm_constant=norm_constant,
        segment_ids_BxL=segment_ids_BxL,
    )


def sft_loss_from_stats(
    stats: VocabStats,
    loss_mask_BxL: jax.Array,
    *,
    aggregation: str = "token_mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    norm_constant: float | jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> tuple[jax.Array, SFTAux]:
    """`sft_loss` from precomputed `vocab_stats` / `vocab_stats_from_hidden` output (same options)."""
    _check_common(stats.logp.shape, loss_mask_BxL, label_smoothing, z_loss)
    if aggregation not in SFT_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {SFT_AGGREGATIONS}, got {aggregation!r}.")
    if aggregation == "sum" and norm_constant is None:
        raise ValueError(
            "aggregation='sum' divides by norm_constant; pass norm_constant= (e.g. the global "
            "token count, or batch_size * max_length)."
        )
    if isinstance(norm_constant, (int, float)) and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0 (it divides the summed loss), got {norm_constant!r}.")
    if aggregation != "sum" and norm_constant is not None:
        raise ValueError(f"norm_constant is only used with aggregation='sum', not {aggregation!r}; drop it.")
    if aggregation == "sequence_mean" and stats.logp.ndim != 2:
        raise ValueError(f"aggregation='sequence_mean' needs [B, L] statistics, got shape {tuple(stats.logp.shape)}.")

    mask = loss_mask_BxL.astype(jnp.float32)
    per_token = token_losses_from_stats(stats, label_smoothing=label_smoothing, z_loss=z_loss)

    loss_sum = jnp.sum(per_token * mask)
    token_count = jnp.sum(mask)
    if stats.logp.ndim == 2:
        seq_sums, seq_counts = sequence_sums(per_token, mask, segment_ids_BxL)
        seq_loss_sum = jnp.sum(safe_divide(seq_sums, seq_counts))
        seq_count = jnp.sum((seq_counts > 0).astype(jnp.float32))
    else:  # flat token lists (e.g. gathered completion tokens) have no sequences
        seq_loss_sum = seq_count = jnp.zeros((), jnp.float32)

    if aggregation == "token_mean":
        loss = safe_divide(loss_sum, token_count)
    elif aggregation == "sequence_mean":
        loss = safe_divide(seq_loss_sum, seq_count)
    else:
        loss = loss_sum / norm_constant

    aux = SFTAux(
        loss_sum=loss_sum,
        nll_sum=jnp.sum(-stats.logp * mask),
        z_loss_sum=jnp.sum(jnp.square(stats.lse) * mask),
        token_count=token_count,
        correct_count=jnp.sum(stats.is_argmax * mask),
        seq_loss_sum=seq_loss_sum,
        seq_count=seq_count,
    )
    return loss, jax.tree.map(jax.lax.stop_gradient, aux)
