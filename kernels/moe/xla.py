"""Portable grouped matmul in plain XLA: sorted rows, per-group blocked matmuls.

`lax.ragged_dot` on XLA:CPU multiplies every row by every expert and masks (cost grows
with the number of experts). Here an outer loop walks the groups and an inner loop
walks the group's rows in tiles of `tm` that start at the group's first row, so each
step is one ordinary (tm x K) @ (K x N) dot that XLA runs multi-threaded, the group's
weight slice is taken once per group, and the work is the active FLOPs plus at most one
partial tile per group. Output tiles are written in place (dynamic_update_slice in a
while loop); a tile's rows past its group are left for the next group to overwrite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import round_up


def pick_tm(m: int, n_groups: int, tm: int | None) -> int:
    """Row tile: large enough to amortise a loop step, small enough that the G partial
    tiles stay a small fraction of the rows (about a quarter of the mean group size)."""
    if tm is None:
        tm = 512
        while tm > 64 and tm * 4 > max(m // max(n_groups, 1), 1):
            tm //= 2
    return min(tm, round_up(max(m, 1), 8))


def _offsets(group_sizes_G, m):
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def _pad_rows(x, rows):
    # tm extra rows so that a tile starting at any row < m is never clamped by dynamic_slice.
    return jnp.pad(x, ((0, rows), (0, 0)))


def _tile_mask(start, end, r0, tm):
    rows = r0 + jnp.arange(tm, dtype=jnp.int32)
    return ((rows >= start) & (rows < end))[:, None]


def gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, out_dtype=None, tm=None):
    """out[m] = lhs[m] @ rhs[group(m)] (or @ rhs[g].T); rows past the groups are zero."""
    M, _ = lhs_MxK.shape
    G = rhs_GxKxN.shape[0]
    N = rhs_GxKxN.shape[1] if transpose_rhs else rhs_GxKxN.shape[2]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm = pick_tm(M, G, tm)
    lhs = _pad_rows(lhs_MxK, tm)
    offs = _offsets(group_sizes_G, M)
    contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

    def group_body(g, out):
        start, end = offs[g], offs[g + 1]
        w = rhs_GxKxN[g]

        def tile_body(i, out):
            r0 = start + i * tm
            x = jax.lax.dynamic_slice_in_dim(lhs, r0, tm)
            y = jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.float32).astype(out_dtype)
            old = jax.lax.dynamic_slice_in_dim(out, r0, tm)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(_tile_mask(start, end, r0, tm), y, old), r0, 0)

        return jax.lax.fori_loop(0, (end - start + tm - 1) // tm, tile_body, out)

    # zeros_like keeps lhs's varying-manual-axes type, so the loop also works inside shard_map.
    out = jax.lax.fori_loop(0, G, group_body, jnp.zeros_like(lhs, out_dtype, (M + tm, N)))
    return out[:M]


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None, tm=None):
    """out[g] = lhs[rows of g].T @ dout[rows of g] -> GxKxN; empty groups give zeros."""
    M, K = lhs_MxK.shape
    N = dout_MxN.shape[1]
    G = group_sizes_G.shape[0]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm = pick_tm(M, G, tm)
    lhs, dout = _pad_rows(lhs_MxK, tm), _pad_rows(dout_MxN, tm)
    offs = _offsets(group_sizes_G, M)

    def group_body(g, out):
        start, end = offs[g], offs[g + 1]

        def tile_body(i, acc):
            r0 = start + i * tm
            mask = _tile_mask(start, end, r0, tm)
            # Both operands masked: the next group's rows must not leak in, even as inf * 0.
            x = jnp.where(mask, jax.lax.dynamic_slice_in_dim(lhs, r0, tm), 0)
            d = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dout, r0, tm), 0)
            return acc + jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, (end - start + tm - 1) // tm, tile_body, jnp.zeros_like(lhs, jnp.float32, (K, N)))
        return jax.lax.dynamic_update_index_in_dim(out, acc.astype(out_dtype), g, 0)

    return jax.lax.fori_loop(0, G, group_body, jnp.zeros_like(lhs, out_dtype, (G, K, N)))
