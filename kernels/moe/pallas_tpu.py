"""Grouped matmul kernels for TPU in Pallas (Mosaic), after megablox.

gmm:  out[m] = lhs[m] @ rhs[group(m)]                  grid (n tiles, work items, k tiles)
tgmm: out[g] = lhs[rows of g]^T @ dout[rows of g]      grid (k tiles, n tiles, work items)

The (tile, group) work list of `metadata.py` reaches the BlockSpec index maps through
`pltpu.PrefetchScalarGridSpec` (scalar prefetch into SMEM), so each grid step DMAs the
right lhs row tile and the right expert's weight block. Work items of one output tile
are adjacent, so Mosaic keeps that tile in VMEM across them and each visit overwrites
only its own group's rows (gmm), or the reduction over a group's row tiles ends when
the group id changes (tgmm). The work-item grid axis is sized by the traced number of
active items (a dynamic grid bound, as in megablox), so no step is wasted on padding.

Layout: tm must be a multiple of 8 (16 for bfloat16; 128 in tgmm, where it is the lane
dimension of the transposed lhs block), tk and tn multiples of 128 dividing the dimension
or the full dimension; `_tiles` rounds or falls back to full dimensions accordingly.
Interpret mode keeps small tiles as given so that tests can cover many tiles cheaply.
`interpret=True` runs the same kernels on CPU under `pltpu.InterpretParams` with NaN-filled
uninitialised memory and race detection, which is how the tests check them; a race test
passes InterpretParams with two simulated cores, between which the "parallel" grid axes
are split as on a megacore chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .metadata import make_group_metadata, round_up

# bf16: lhs, rhs and out blocks of 0.5 MiB plus a 1 MiB float32 accumulator, about 4 MiB
# double-buffered, inside the default scoped VMEM of every TPU generation.
DEFAULT_TILING = (512, 512, 512)
LANES = 128


def _fit(block: int, dim: int, strict: bool) -> int:
    """A lane-dim block that tiles `dim` exactly: `block` if it divides dim (and, for the
    chip, is a multiple of 128), else the whole dim (Mosaic accepts either)."""
    lanes_ok = block % LANES == 0 or not strict
    return block if block < dim and dim % block == 0 and lanes_ok else dim


def _interpret_params(interpret):
    """False: compile for the chip. True: NaN-filled uninitialised memory, race detection.
    An `InterpretParams` passes through (e.g. num_cores_or_threads=2 to split the
    "parallel" grid axes over two simulated cores, as on a megacore chip)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    if not interpret:
        return False
    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def _tiles(m, k, n, dtype, tiling, *, strict, tm_is_lane_dim=False):
    """(tm, tk, tn) obeying Mosaic's block rules when `strict` (compiling for the chip);
    tgmm reads lhs transposed, so there tm is the lane (last) dimension of a block and
    must be a multiple of 128 unless it covers m."""
    tm, tk, tn = tiling or DEFAULT_TILING
    sublane = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    tm = round_up(tm, LANES if (tm_is_lane_dim and strict) else sublane)
    tm = min(tm, round_up(m, sublane))
    return tm, _fit(tk, k, strict), _fit(tn, n, strict)


def _row_mask(offsets_ref, group_ids_ref, tile_ids_ref, w, shape, axis):
    g, t = group_ids_ref[w], tile_ids_ref[w]
    rows = t * shape[axis] + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])


def _gmm_kernel(offsets_ref, group_ids_ref, tile_ids_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs, n_k):
    w, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32)

    @pl.when(kk == n_k - 1)
    def _():
        mask = _row_mask(offsets_ref, group_ids_ref, tile_ids_ref, w, acc_ref.shape, 0)
        out_ref[...] = jnp.where(mask, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, out_dtype=None, tiling=None, interpret=False):
    """out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T if transpose_rhs); rows past the groups are zero."""
    M, K = lhs_MxK.shape
    G = rhs_GxKxN.shape[0]
    N = rhs_GxKxN.shape[1] if transpose_rhs else rhs_GxKxN.shape[2]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm, tk, tn = _tiles(M, K, N, lhs_MxK.dtype, tiling, strict=interpret is False)
    m_pad = round_up(M, tm)
    lhs = jnp.pad(lhs_MxK, ((0, m_pad - M), (0, 0)))
    meta = make_group_metadata(group_sizes_G, m_pad, tm)
    n_k = K // tk
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((None, tn, tk), lambda n, w, kk, offs, gids, tids: (gids[w], n, kk))
    else:
        rhs_spec = pl.BlockSpec((None, tk, tn), lambda n, w, kk, offs, gids, tids: (gids[w], kk, n))
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs, n_k=n_k),
        out_shape=jax.ShapeDtypeStruct((m_pad, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(N // tn, meta.num_work, n_k),
            in_specs=[pl.BlockSpec((tm, tk), lambda n, w, kk, offs, gids, tids: (tids[w], kk)), rhs_spec],
            out_specs=pl.BlockSpec((tm, tn), lambda n, w, kk, offs, gids, tids: (tids[w], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_params(interpret),
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N,
            transcendentals=0,
            bytes_accessed=(M * K + G * K * N) * lhs_MxK.dtype.itemsize + M * N * jnp.dtype(out_dtype).itemsize,
        ),
        name="ptrain_gmm",
    )(meta.offsets_Gp1, meta.group_ids_W, meta.tile_ids_W, lhs, rhs_GxKxN)
    # Rows past sum(group_sizes) (and padding) are never written: zero them.
    rows = jnp.arange(m_pad, dtype=jnp.int32)[:, None]
    return jnp.where(rows < meta.offsets_Gp1[-1], out, 0).astype(out_dtype)[:M]


def _tgmm_kernel(offsets_ref, group_ids_ref, tile_ids_ref, lhs_t_ref, dout_ref, out_ref, acc_ref):
    w = pl.program_id(2)
    n_w = pl.num_programs(2)
    g = group_ids_ref[w]
    first = (w == 0) | (group_ids_ref[jnp.maximum(w - 1, 0)] != g)
    last = (w == n_w - 1) | (group_ids_ref[jnp.minimum(w + 1, n_w - 1)] != g)

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # Zero both operands outside the group: the other rows may hold another group's data.
    lhs_t = jnp.where(_row_mask(offsets_ref, group_ids_ref, tile_ids_ref, w, lhs_t_ref.shape, 1), lhs_t_ref[...], 0)
    dout = jnp.where(_row_mask(offsets_ref, group_ids_ref, tile_ids_ref, w, dout_ref.shape, 0), dout_ref[...], 0)
    acc_ref[...] += jnp.dot(lhs_t, dout, preferred_element_type=jnp.float32)

    @pl.when(last)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None, tiling=None, interpret=False):
    """out[g] = lhs[rows of g].T @ dout[rows of g] -> GxKxN; empty groups give zeros."""
    M, K = lhs_MxK.shape
    N = dout_MxN.shape[1]
    G = group_sizes_G.shape[0]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm, tk, tn = _tiles(M, K, N, lhs_MxK.dtype, tiling, strict=interpret is False, tm_is_lane_dim=True)
    m_pad = round_up(M, tm)
    # megablox takes lhs transposed ([K, M]) so that the MXU sees a plain (tk, tm) x (tm, tn) matmul.
    lhs_t = jnp.pad(lhs_MxK, ((0, m_pad - M), (0, 0))).T
    dout = jnp.pad(dout_MxN, ((0, m_pad - M), (0, 0)))
    meta = make_group_metadata(group_sizes_G, m_pad, tm)
    out = pl.pallas_call(
        _tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((G, K, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(K // tk, N // tn, meta.num_work),
            in_specs=[
                pl.BlockSpec((tk, tm), lambda kk, n, w, offs, gids, tids: (kk, tids[w])),
                pl.BlockSpec((tm, tn), lambda kk, n, w, offs, gids, tids: (tids[w], n)),
            ],
            out_specs=pl.BlockSpec((None, tk, tn), lambda kk, n, w, offs, gids, tids: (gids[w], kk, n)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret_params(interpret),
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N,
            transcendentals=0,
            bytes_accessed=(M * K + M * N) * lhs_MxK.dtype.itemsize + G * K * N * jnp.dtype(out_dtype).itemsize,
        ),
        name="ptrain_tgmm",
    )(meta.offsets_Gp1, meta.group_ids_W, meta.tile_ids_W, lhs_t, dout)
    # Empty groups are never visited: zero them.
    return jnp.where((group_sizes_G > 0)[:, None, None], out, 0).astype(out_dtype)
