"""Group metadata for tiled grouped matmuls (the megablox scheme, shared by every path).

Rows are sorted by group, so group g owns rows [offsets[g], offsets[g+1]). The row axis
is cut into tiles of `tm` rows; a "work item" is one (tile, group) pair with a non-empty
intersection. A tile that straddles a group boundary appears once per group and each
visit writes only its own rows (a row mask). Work items are ordered by group then tile,
so consecutive items touching the same output tile are adjacent (Pallas keeps that tile
resident between them) and there are at most m/tm + G - 1 of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    """offsets_Gp1: row offsets (CSR); group_ids_W, tile_ids_W: per work item (W = m/tm + G - 1
    slots, the first `num_work` valid); num_work: int32 scalar."""

    offsets_Gp1: jax.Array
    group_ids_W: jax.Array
    tile_ids_W: jax.Array
    num_work: jax.Array


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def make_group_metadata(group_sizes_G: jax.Array, m: int, tm: int) -> GroupMetadata:
    """Builds the work list for `m` rows (a multiple of `tm`) in tiles of `tm`.

    Rows past sum(group_sizes) belong to no group and are never visited; a sum larger
    than `m` is clipped to `m` (the caller's contract is sum(group_sizes) <= m).
    """
    if m % tm:
        raise ValueError(f"make_group_metadata: m={m} is not a multiple of tm={tm}; pad the rows first.")
    gs = group_sizes_G.astype(jnp.int32)
    G = gs.shape[0]
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    first_tile = starts // tm
    tiles_per_group = jnp.where(ends > starts, (ends + tm - 1) // tm - first_tile, 0)
    n_slots = m // tm + G - 1
    num_work = jnp.sum(tiles_per_group).astype(jnp.int32)
    group_ids = jnp.repeat(jnp.arange(G, dtype=jnp.int32), tiles_per_group, total_repeat_length=n_slots)
    work_start = jnp.cumsum(tiles_per_group) - tiles_per_group
    w = jnp.arange(n_slots, dtype=jnp.int32)
    tile_ids = first_tile[group_ids] + w - work_start[group_ids]
    # Unused slots point at the last valid item so that a static grid revisits, not strays.
    last = jnp.maximum(num_work - 1, 0)
    valid = w < num_work
    group_ids = jnp.where(valid, group_ids, group_ids[last])
    tile_ids = jnp.clip(jnp.where(valid, tile_ids, tile_ids[last]), 0, m // tm - 1)
    return GroupMetadata(offsets, group_ids.astype(jnp.int32), tile_ids.astype(jnp.int32), num_work)
