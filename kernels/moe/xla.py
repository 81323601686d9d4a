"""Portable grouped matmul in plain XLA: sorted rows, one row tile per loop step.

`lax.ragged_dot` on XLA:CPU multiplies every row by every expert and masks (cost grows
with the number of experts). Here a `while_loop` walks the (tile, group) work list of
`metadata.py` and multiplies one `tm`-row tile by its group's weights, so the work is
the active FLOPs plus at most (G - 1) partial tiles. Each step is one ordinary dot
that XLA runs multi-threaded; the output tile is written in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import make_group_metadata, round_up


def _row_mask(meta, g, tile, tm):
    rows = tile * tm + jnp.arange(tm, dtype=jnp.int32)
    return (rows >= meta.offsets_Gp1[g]) & (rows < meta.offsets_Gp1[g + 1])


def _pad_rows(x, m_pad):
    return x if x.shape[0] == m_pad else jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0)))


def pick_tm(m: int, n_groups: int, tm: int | None) -> int:
    """Row tile: large enough to amortise a loop step, small enough that the (G-1) partial
    tiles stay a small fraction of the rows (about a quarter of the mean group size)."""
    if tm is None:
        tm = 512
        while tm > 64 and tm * 4 > max(m // max(n_groups, 1), 1):
            tm //= 2
    return min(tm, round_up(max(m, 1), 8))


def gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, out_dtype=None, tm=None):
    """out[m] = lhs[m] @ rhs[group(m)] (or @ rhs[g].T); rows past the groups are zero."""
    M, K = lhs_MxK.shape
    G = rhs_GxKxN.shape[0]
    N = rhs_GxKxN.shape[1] if transpose_rhs else rhs_GxKxN.shape[2]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm = pick_tm(M, G, tm)
    m_pad = round_up(M, tm)
    lhs = _pad_rows(lhs_MxK, m_pad)
    meta = make_group_metadata(group_sizes_G, m_pad, tm)
    contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

    def body(w, out):
        g, t = meta.group_ids_W[w], meta.tile_ids_W[w]
        x = jax.lax.dynamic_slice_in_dim(lhs, t * tm, tm)
        y = jax.lax.dot_general(x, rhs_GxKxN[g], contract, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice_in_dim(out, t * tm, tm)
        new = jnp.where(_row_mask(meta, g, t, tm)[:, None], y.astype(out_dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, t * tm, 0)

    # zeros_like keeps lhs's varying-manual-axes type, so the loop also works inside shard_map.
    out = jax.lax.fori_loop(0, meta.num_work, body, jnp.zeros_like(lhs, out_dtype, (m_pad, N)))
    return out[:M]


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None, tm=None):
    """out[g] = lhs[rows of g].T @ dout[rows of g] -> GxKxN; empty groups give zeros."""
    M, K = lhs_MxK.shape
    N = dout_MxN.shape[1]
    G = group_sizes_G.shape[0]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm = pick_tm(M, G, tm)
    m_pad = round_up(M, tm)
    lhs, dout = _pad_rows(lhs_MxK, m_pad), _pad_rows(dout_MxN, m_pad)
    meta = make_group_metadata(group_sizes_G, m_pad, tm)

    def body(w, acc):
        g, t = meta.group_ids_W[w], meta.tile_ids_W[w]
        mask = _row_mask(meta, g, t, tm)[:, None]
        x = jnp.where(mask, jax.lax.dynamic_slice_in_dim(lhs, t * tm, tm), 0)
        d = jax.lax.dynamic_slice_in_dim(dout, t * tm, tm)
        part = jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc.at[g].add(part)

    acc = jax.lax.fori_loop(0, meta.num_work, body, jnp.zeros_like(lhs, jnp.float32, (G, K, N)))
    return acc.astype(out_dtype)
