"""Grouped matmul kernels for GPU in Pallas, Triton lowering.

gmm:  one program per (work item, n tile): loop over k tiles, accumulate in float32
      registers, store only the rows of the item's group (masked store).
tgmm: one program per (group, k tile, n tile): loop over the group's row tiles
      (dynamic bounds from the CSR offsets), masked loads, store the KxN tile once.

Why Triton and not Mosaic GPU: Mosaic GPU (the default GPU lowering since JAX 0.9; see
jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py) is faster on Hopper, but it is
Hopper/Blackwell-only and its interpret mode runs a single block, so a multi-block
grouped kernel could not be checked on CPU here. The Triton lowering runs on every
CUDA/ROCm GPU, and the same kernel runs in interpret mode on CPU, so the tests below
prove its indexing, masking and gradients; `tools/device_check_moe.py` measures it.
The Triton backend is deprecated since JAX 0.11 but still shipped; if it goes, the
"xla" path (dense-free on CPU) and "ragged_dot" remain the GPU fallbacks.

Work items of gmm never share an output row (each writes its own group's rows of a
tile), so programs run fully in parallel without atomics. Triton blocks must be powers
of two: K and N are padded to the tile sizes (a no-op for the usual 128-multiples).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .metadata import make_group_metadata, round_up

DEFAULT_TILING = (128, 64, 128)
NUM_WARPS = 4
NUM_STAGES = 3


def _pow2_tile(block: int, dim: int) -> int:
    """Largest power of two <= block that is still >= 16 and not wastefully above dim."""
    t = 16
    while t * 2 <= block and t < dim:
        t *= 2
    return t


def _tiles(m, k, n, tiling):
    tm, tk, tn = tiling or DEFAULT_TILING
    return _pow2_tile(tm, m), _pow2_tile(tk, k), _pow2_tile(tn, n)


def _pad2(x, rows, cols):
    r, c = x.shape[-2:]
    if (r, c) == (rows, cols):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - r), (0, cols - c)])


def _compiler_params():
    return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _gmm_kernel(offs_ref, gids_ref, tids_ref, nwork_ref, lhs_ref, rhs_ref, out_ref, *, tm, tk, tn, n_k, transpose_rhs):
    w, nb = pl.program_id(0), pl.program_id(1)

    @pl.when(w < nwork_ref[0])
    def _():
        g, row0 = gids_ref[w], tids_ref[w] * tm

        def body(kk, acc):
            x = lhs_ref[pl.ds(row0, tm), pl.ds(kk * tk, tk)]
            if transpose_rhs:
                r = rhs_ref[g, pl.ds(nb * tn, tn), pl.ds(kk * tk, tk)]
                dims = (((1,), (1,)), ((), ()))
            else:
                r = rhs_ref[g, pl.ds(kk * tk, tk), pl.ds(nb * tn, tn)]
                dims = (((1,), (0,)), ((), ()))
            return acc + jax.lax.dot_general(x, r, dims, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((tm, tn), jnp.float32))
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mask = (rows >= offs_ref[g]) & (rows < offs_ref[g + 1])
        pltriton.store(out_ref.at[pl.ds(row0, tm), pl.ds(nb * tn, tn)], acc.astype(out_ref.dtype), mask=mask)


def gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, out_dtype=None, tiling=None, interpret=False):
    """out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T if transpose_rhs); rows past the groups are zero."""
    M, K = lhs_MxK.shape
    N = rhs_GxKxN.shape[1] if transpose_rhs else rhs_GxKxN.shape[2]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm, tk, tn = _tiles(M, K, N, tiling)
    m_pad, k_pad, n_pad = round_up(M, tm), round_up(K, tk), round_up(N, tn)
    lhs = _pad2(lhs_MxK, m_pad, k_pad)
    rhs = _pad2(rhs_GxKxN, n_pad, k_pad) if transpose_rhs else _pad2(rhs_GxKxN, k_pad, n_pad)
    meta = make_group_metadata(group_sizes_G, m_pad, tm)
    n_slots = meta.group_ids_W.shape[0]
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, n_k=k_pad // tk, transpose_rhs=transpose_rhs),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=(n_slots, n_pad // tn),
        compiler_params=_compiler_params(),
        interpret=interpret,
        name="ptrain_gmm_gpu",
    )(meta.offsets_Gp1, meta.group_ids_W, meta.tile_ids_W, meta.num_work[None], lhs, rhs)
    # Rows past sum(group_sizes) (and padding) are never stored: zero them.
    rows = jnp.arange(m_pad, dtype=jnp.int32)[:, None]
    return jnp.where(rows < meta.offsets_Gp1[-1], out, 0).astype(out_dtype)[:M, :N]


def _tgmm_kernel(offs_ref, lhs_ref, dout_ref, out_ref, *, tm, tk, tn):
    g, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offs_ref[g], offs_ref[g + 1]

    def body(t, acc):
        rows = t * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        in_group = (rows >= start) & (rows < end)
        x = jnp.where(in_group, lhs_ref[pl.ds(t * tm, tm), pl.ds(kb * tk, tk)], 0)
        d = jnp.where(in_group, dout_ref[pl.ds(t * tm, tm), pl.ds(nb * tn, tn)], 0)
        return acc + jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    # Empty groups run no iteration (or one fully masked one) and store zeros.
    acc = jax.lax.fori_loop(start // tm, (end + tm - 1) // tm, body, jnp.zeros((tk, tn), jnp.float32))
    out_ref[g, pl.ds(kb * tk, tk), pl.ds(nb * tn, tn)] = acc.astype(out_ref.dtype)


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None, tiling=None, interpret=False):
    """out[g] = lhs[rows of g].T @ dout[rows of g] -> GxKxN; empty groups give zeros."""
    M, K = lhs_MxK.shape
    N = dout_MxN.shape[1]
    G = group_sizes_G.shape[0]
    out_dtype = out_dtype or lhs_MxK.dtype
    tm, tk, tn = _tiles(M, K, N, tiling)
    m_pad, k_pad, n_pad = round_up(M, tm), round_up(K, tk), round_up(N, tn)
    meta = make_group_metadata(group_sizes_G, m_pad, tm)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        out_shape=jax.ShapeDtypeStruct((G, k_pad, n_pad), out_dtype),
        grid=(G, k_pad // tk, n_pad // tn),
        compiler_params=_compiler_params(),
        interpret=interpret,
        name="ptrain_tgmm_gpu",
    )(meta.offsets_Gp1, _pad2(lhs_MxK, m_pad, k_pad), _pad2(dout_MxN, m_pad, n_pad))
    return out[:, :K, :N]
