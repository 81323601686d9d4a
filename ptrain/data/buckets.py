"""Row lengths cut to a few buckets, so a batch of short rows is not trained at the full context's cost.

A batch built at `seq_len` tokens a row is cut to the shortest of seq_len, seq_len/2,
seq_len/4, ... that holds its longest row (`bucket_length`); what is cut is padding, so every
loss and gradient is the one of the full-length batch, and a stage compiles one step per
length it meets (at most log2(seq_len / MIN_BUCKET) + 1).
"""

from __future__ import annotations

import numpy as np

MIN_BUCKET = 128
"""Shortest row length `bucket_length` cuts to (tokens)."""


def bucket_length(longest: int, seq_len: int, multiple: int = 1) -> int:
    """The row length for a batch whose longest row holds `longest` tokens: the shortest of
    seq_len, seq_len/2, seq_len/4, ... that holds it, is at least MIN_BUCKET and is a multiple
    of `multiple` (mesh.context: rows split over the context axis)."""
    length = seq_len
    while length % 2 == 0 and length // 2 >= max(longest, MIN_BUCKET) and (length // 2) % multiple == 0:
        length //= 2
    return length


def _segment_keys(batch: dict[str, np.ndarray]) -> list[str]:
    keys = [k for k in batch if k.endswith("segment_ids")]
    if not keys:
        raise ValueError(f"the batch has no segment ids to find its padding by (keys {sorted(batch)})")
    return keys


def longest_row(batch: dict[str, np.ndarray]) -> int:
    """The position after the last real token of any row (segment id > 0), over every
    `*segment_ids` array of the batch (a preference batch has one per side)."""
    ends = [
        np.max(np.where(batch[k] > 0, np.arange(batch[k].shape[1]) + 1, 0), initial=0) for k in _segment_keys(batch)
    ]
    return int(max(ends))


def trimmed(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """`batch` with its per-token [B, L] arrays cut to `length` tokens (what is cut must be
    padding); per-row arrays stay as they are."""
    keys = _segment_keys(batch)
    if longest_row(batch) > length:
        raise ValueError(f"rows hold tokens past {length}; cut at the longest row or later")
    full = batch[keys[0]].shape
    return {k: v[:, :length] if np.ndim(v) >= 2 and v.shape[:2] == full else v for k, v in batch.items()}


def to_bucket(batch: dict[str, np.ndarray], seq_len: int, multiple: int = 1) -> dict[str, np.ndarray]:
    """`batch` cut to the bucket of its longest row (`bucket_length`)."""
    return trimmed(batch, bucket_length(longest_row(batch), seq_len, multiple))
