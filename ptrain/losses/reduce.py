"""Masked reductions shared by the losses (float32, NaN-free on empty masks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator, and 0 where the denominator is 0 (an empty mask gives 0, not NaN)."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1.0), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """sum(mask * x) / sum(mask) over `axis` (all axes by default); 0 where the mask is empty."""
    return safe_divide(jnp.sum(x * mask, axis=axis), jnp.sum(mask, axis=axis))


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    """max of x over the positions where mask > 0; 0 when the mask is empty."""
    return jnp.where(jnp.any(mask > 0), jnp.max(jnp.where(mask > 0, x, -jnp.inf)), 0.0)


def sequence_sums(values_BxL: jax.Array, mask_BxL: jax.Array, segment_ids_BxL: jax.Array | None = None):
    """Per-sequence sums of masked values and of the mask.

    A sequence is a row, or with `segment_ids_BxL` (packing; ids in [0, L], 0 = padding)
    a (row, segment) pair. Returns (sums, counts), each `[B]` for rows or `[B * (L + 1)]`
    buckets for segments (empty buckets have count 0).
    """
    if segment_ids_BxL is None:
        return jnp.sum(values_BxL * mask_BxL, axis=1), jnp.sum(mask_BxL, axis=1)
    if tuple(segment_ids_BxL.shape) != tuple(mask_BxL.shape):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids_BxL.shape)}, expected {tuple(mask_BxL.shape)}.")
    b, l = mask_BxL.shape
    ids = (jnp.arange(b, dtype=jnp.int32)[:, None] * (l + 1) + jnp.clip(segment_ids_BxL, 0, l)).reshape(-1)
    n = b * (l + 1)
    sums = jax.ops.segment_sum((values_BxL * mask_BxL).reshape(-1), ids, num_segments=n)
    counts = jax.ops.segment_sum(mask_BxL.reshape(-1), ids, num_segments=n)
    return sums, counts
