"""Portable grouped matmul in plain XLA: sorted rows, per-group blocked matmuls.

`lax.ragged_dot` on XLA:CPU multiplies every row by every expert and masks (cost grows
with the number of experts). Here an outer loop walks the groups and inner loops walk
the group's rows in tiles that start at the group's first row (large tiles, then
smaller ones for the remainder: `pick_tiles`), so each step is one ordinary
(tm x K) @ (K x N) dot that XLA runs multi-threaded, the group's weight slice is taken
once per group, and the work is the active FLOPs plus less than one small tile per group.

Tiles are written whole, without masks: a tile's rows past its group's end are
rewritten by the next group's first tile, which starts exactly there and is written
later, so every row ends up holding its own group's result; the rows past the last
group are zeroed once at the end. This saves a masked read-modify-write per tile, which
was the main overhead of the loop on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .metadata import round_up


def pick_tiles(m: int, n_groups: int, tm: int | None) -> tuple[int, ...]:
    """Row tile sizes, largest first: each group is covered by as many large tiles as fit,
    then smaller ones, so the rows computed past a group's end (the last tile's overhang)
    stay under the smallest size instead of growing with the large one. The large size is
    at most half the mean group size (down to 64). An explicit `tm` gives one size."""
    if tm is not None:
        return (min(tm, round_up(max(m, 1), 8)),)
    big = 512
    while big > 64 and big * 2 > max(m // max(n_groups, 1), 1):
        big //= 2
    return tuple(t for t in (big, big // 4, big // 16) if t >= 16) or (16,)


def _tile_loop(start, end, tms, body, carry):
    """carry = body(r0, tm, carry) for tiles covering rows [start, end) in order: floor-many
    tiles of each size but the last, whose ceil-many tiles may overhang `end`."""
    r = start
    for j, tm in enumerate(tms):
        n = (end - r + tm - 1) // tm if j == len(tms) - 1 else (end - r) // tm
        carry = jax.lax.fori_loop(0, n, lambda i, c, r=r, tm=tm: body(r + i * tm, tm, c), carry)
        r = r + n * tm
    return carry


def _offsets(group_sizes_G, m):
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def _pad_rows(x, rows):
    # max(tms) extra rows so that a tile starting at any row < m is never clamped by dynamic_slice.
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
    tms = pick_tiles(M, G, tm)
    lhs = _pad_rows(lhs_MxK, tms[0])
    offs = _offsets(group_sizes_G, M)
    contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

    def group_body(g, out):
        w = rhs_GxKxN[g]

        def tile_body(r0, tm, out):
            x = jax.lax.dynamic_slice_in_dim(lhs, r0, tm)
            y = jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.float32).astype(out_dtype)
            return jax.lax.dynamic_update_slice_in_dim(out, y, r0, 0)

        return _tile_loop(offs[g], offs[g + 1], tms, tile_body, out)

    # zeros_like keeps lhs's varying-manual-axes type, so the loop also works inside shard_map.
    out = jax.lax.fori_loop(0, G, group_body, jnp.zeros_like(lhs, out_dtype, (M + tms[0], N)))
    return _zero_past(out[:M], offs[-1])


def _zero_past(x, total):
    return jnp.where(jnp.arange(x.shape[0], dtype=jnp.int32)[:, None] < total, x, 0)


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None, tm=None):
    """out[g] = lhs[rows of g].T @ dout[rows of g] -> GxKxN; empty groups give zeros."""
    M, K = lhs_MxK.shape
    N = dout_MxN.shape[1]
    G = group_sizes_G.shape[0]
    out_dtype = out_dtype or lhs_MxK.dtype
    tms = pick_tiles(M, G, tm)
    lhs, dout = _pad_rows(lhs_MxK, tms[0]), _pad_rows(dout_MxN, tms[0])
    offs = _offsets(group_sizes_G, M)

    def group_body(g, out):
        start, end = offs[g], offs[g + 1]

        def tile_body(r0, tm, acc):
            mask = _tile_mask(start, end, r0, tm)
            # Both operands masked: the next group's rows must not leak in, even as inf * 0.
            x = jnp.where(mask, jax.lax.dynamic_slice_in_dim(lhs, r0, tm), 0)
            d = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dout, r0, tm), 0)
            return acc + jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        acc = _tile_loop(start, end, tms, tile_body, jnp.zeros_like(lhs, jnp.float32, (K, N)))
        return jax.lax.dynamic_update_index_in_dim(out, acc.astype(out_dtype), g, 0)

    return jax.lax.fori_loop(0, G, group_body, jnp.zeros_like(lhs, out_dtype, (G, K, N)))


# ----------------------------------------------------------------------------- fused SwiGLU experts


def _silu_parts(h_f32, F):
    g, u = h_f32[:, :F], h_f32[:, F:]
    sig = jax.nn.sigmoid(g)
    return g, u, sig, g * sig


def _ffn_forward(x_MxD, offs, w_gu_Ex2F, w_down, tms):
    """Per group, per tile: h = x [gate|up]; a = silu(h_g) h_u; y = a down. Keeps h (float32)."""
    M, D = x_MxD.shape
    F = w_down.shape[1]
    dt = x_MxD.dtype
    xp = _pad_rows(x_MxD, tms[0])

    def group_body(g, carry):
        wgu, wd = w_gu_Ex2F[g], w_down[g]

        def tile_body(r0, tm, carry):
            out, h_all = carry
            h = jnp.dot(jax.lax.dynamic_slice_in_dim(xp, r0, tm), wgu, preferred_element_type=jnp.float32)
            _, u, _, silu = _silu_parts(h, F)
            y = jnp.dot((silu * u).astype(dt), wd, preferred_element_type=jnp.float32).astype(dt)
            # Unmasked writes: see the module docstring.
            out = jax.lax.dynamic_update_slice_in_dim(out, y, r0, 0)
            h_all = jax.lax.dynamic_update_slice_in_dim(h_all, h, r0, 0)
            return out, h_all

        return _tile_loop(offs[g], offs[g + 1], tms, tile_body, carry)

    init = (jnp.zeros_like(xp, dt, (M + tms[0], D)), jnp.zeros_like(xp, jnp.float32, (M + tms[0], 2 * F)))
    out, h_all = jax.lax.fori_loop(0, w_gu_Ex2F.shape[0], group_body, init)
    return _zero_past(out[:M], offs[-1]), h_all


def _ffn_backward(x_MxD, h_all, dy_MxD, offs, w_gu_Ex2F, w_down, tms):
    """Returns dx, d gate, d up, d down. The gate and up gradients leave the loop as two
    arrays, each group's halves written from cache: splitting one ExDx2F gradient after
    the loop would be a strided copy of the whole gradient."""
    M, D = x_MxD.shape
    E, F = w_down.shape[0], w_down.shape[1]
    dt = x_MxD.dtype
    xp, dyp = _pad_rows(x_MxD, tms[0]), _pad_rows(dy_MxD.astype(dt), tms[0])
    t_dims = (((0,), (0,)), ((), ()))  # a.T @ b without materialising the transpose

    def group_body(g, carry):
        dx, dwg, dwu, dwd = carry
        start, end = offs[g], offs[g + 1]
        wgu, wd = w_gu_Ex2F[g], w_down[g]

        def tile_body(r0, tm, carry):
            dx, acc_gu, acc_d = carry
            # Masking dy alone zeroes d a, d h and so every product of rows outside the group
            # (h is finite: it was computed from finite rows).
            x = jax.lax.dynamic_slice_in_dim(xp, r0, tm)
            dy = jnp.where(_tile_mask(start, end, r0, tm), jax.lax.dynamic_slice_in_dim(dyp, r0, tm), 0)
            gate, u, sig, silu = _silu_parts(jax.lax.dynamic_slice_in_dim(h_all, r0, tm), F)
            a = (silu * u).astype(dt)
            acc_d = acc_d + jax.lax.dot_general(a, dy, t_dims, preferred_element_type=jnp.float32)
            da = jax.lax.dot_general(dy, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            # d silu(g)/dg = sig * (1 + g * (1 - sig))
            dh = jnp.concatenate([da * u * sig * (1 + gate * (1 - sig)), da * silu], axis=1).astype(dt)
            acc_gu = acc_gu + jax.lax.dot_general(x, dh, t_dims, preferred_element_type=jnp.float32)
            dxt = jax.lax.dot_general(dh, wgu, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, dxt.astype(dt), r0, 0)
            return dx, acc_gu, acc_d

        init = (dx, jnp.zeros_like(xp, jnp.float32, (D, 2 * F)), jnp.zeros_like(xp, jnp.float32, (F, D)))
        dx, acc_gu, acc_d = _tile_loop(start, end, tms, tile_body, init)
        acc_gu = acc_gu.astype(dwg.dtype)
        dwg = jax.lax.dynamic_update_index_in_dim(dwg, acc_gu[:, :F], g, 0)
        dwu = jax.lax.dynamic_update_index_in_dim(dwu, acc_gu[:, F:], g, 0)
        dwd = jax.lax.dynamic_update_index_in_dim(dwd, acc_d.astype(dwd.dtype), g, 0)
        return dx, dwg, dwu, dwd

    wdt = w_gu_Ex2F.dtype
    init = (
        jnp.zeros_like(xp, dt, (M + tms[0], D)),
        jnp.zeros_like(xp, wdt, (E, D, F)),
        jnp.zeros_like(xp, wdt, (E, D, F)),
        jnp.zeros_like(xp, w_down.dtype, (E, F, D)),
    )
    dx, dwg, dwu, dwd = jax.lax.fori_loop(0, E, group_body, init)
    return _zero_past(dx[:M], offs[-1]), dwg, dwu, dwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_ffn(x_MxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, tms):
    w_gu = jnp.concatenate([w_gate_ExDxF, w_up_ExDxF], axis=-1)
    return _ffn_forward(x_MxD, _offsets(group_sizes_E, x_MxD.shape[0]), w_gu, w_down_ExFxD, tms)[0]


def _fused_ffn_fwd(x_MxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, tms):
    offs = _offsets(group_sizes_E, x_MxD.shape[0])
    w_gu = jnp.concatenate([w_gate_ExDxF, w_up_ExDxF], axis=-1)
    y, h_all = _ffn_forward(x_MxD, offs, w_gu, w_down_ExFxD, tms)
    return y, (x_MxD, h_all, offs, w_gu, w_down_ExFxD)


def _fused_ffn_bwd(tms, res, dy_MxD):
    x, h_all, offs, w_gu, w_down = res
    dx, dwg, dwu, dwd = _ffn_backward(x, h_all, dy_MxD, offs, w_gu, w_down, tms)
    return dx, None, dwg, dwu, dwd


_fused_ffn.defvjp(_fused_ffn_fwd, _fused_ffn_bwd)


def fused_expert_ffn(x_sorted_MxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, tm=None):
    """SwiGLU experts on expert-sorted rows in one loop per pass: y = down_e(silu(x gate_e) * (x up_e)).

    Weights come in the rows' dtype. Gate and up run as one dot per tile on [gate | up]
    (ExDx2F, concatenated once per call). The forward keeps
    h = x [gate|up] in float32 (M x 2F) for the backward, which walks the tiles once and
    does all five products of a tile (d a, d down, d h, d x, d [gate|up]) while the tile
    and the expert's weights are in cache. Rows past sum(group_sizes) give zeros.
    """
    tms = pick_tiles(x_sorted_MxD.shape[0], w_gate_ExDxF.shape[0], tm)
    return _fused_ffn(x_sorted_MxD, group_sizes_E.astype(jnp.int32), w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, tms)
