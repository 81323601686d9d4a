"""Plain-jnp references for the MoE kernels: obviously correct, dense, slow.

Every implementation in this package is tested against these functions (forward and
gradients via `jax.vjp` of these, which autodiff handles because nothing here is custom).
They materialise every expert for every row, so keep shapes tiny.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def row_group_ids(group_sizes_G: jax.Array, m: int) -> jax.Array:
    """Group of each of `m` sorted rows; rows beyond sum(group_sizes) get id G."""
    ends_G = jnp.cumsum(group_sizes_G.astype(jnp.int32))
    return jnp.searchsorted(ends_G, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_matmul(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, preferred_element_type=None):
    """out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T if transpose_rhs); rows past the groups are 0."""
    out_dtype = preferred_element_type or lhs_MxK.dtype
    rhs = jnp.swapaxes(rhs_GxKxN, 1, 2) if transpose_rhs else rhs_GxKxN
    G = rhs.shape[0]
    onehot_MxG = row_group_ids(group_sizes_G, lhs_MxK.shape[0])[:, None] == jnp.arange(G)[None, :]
    all_GxMxN = jnp.einsum("mk,gkn->gmn", lhs_MxK.astype(jnp.float32), rhs.astype(jnp.float32), precision=_HI)
    out = jnp.einsum("gmn,mg->mn", all_GxMxN, onehot_MxG.astype(jnp.float32), precision=_HI)
    return out.astype(out_dtype)


def transposed_grouped_matmul(lhs_MxK, dout_MxN, group_sizes_G, *, preferred_element_type=None):
    """out[g] = lhs[rows of g].T @ dout[rows of g]  -> GxKxN (the weight gradient)."""
    out_dtype = preferred_element_type or lhs_MxK.dtype
    G = group_sizes_G.shape[0]
    onehot_GxM = jnp.arange(G)[:, None] == row_group_ids(group_sizes_G, lhs_MxK.shape[0])[None, :]
    out = jnp.einsum(
        "gm,mk,mn->gkn",
        onehot_GxM.astype(jnp.float32),
        lhs_MxK.astype(jnp.float32),
        dout_MxN.astype(jnp.float32),
        precision=_HI,
    )
    return out.astype(out_dtype)


def permute(x_TxD, expert_ids_Txk, n_experts):
    """Rows of x repeated k times and stably sorted by expert; returns (x_sorted_MxD, group_sizes_E, order_M)."""
    flat_M = expert_ids_Txk.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    x_sorted = x_TxD[order_M // expert_ids_Txk.shape[1]]
    group_sizes = jnp.bincount(flat_M, length=n_experts).astype(jnp.int32)
    return x_sorted, group_sizes, order_M


def combine(y_sorted_MxD, order_M, weights_Txk):
    """y[t] = sum_j w[t, j] * y_sorted[position of assignment (t, j)]."""
    T, k = weights_Txk.shape
    y_flat = jnp.zeros_like(y_sorted_MxD).at[order_M].set(y_sorted_MxD).astype(jnp.float32)
    out = jnp.einsum("tkd,tk->td", y_flat.reshape(T, k, -1), weights_Txk.astype(jnp.float32), precision=_HI)
    return out.astype(y_sorted_MxD.dtype)


def moe_ffn(x_TxD, expert_ids_Txk, weights_Txk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Dense SwiGLU MoE: y[t] = sum_j w[t,j] * down_e(silu(x gate_e) * (x up_e)), e = ids[t,j].

    Computes every expert for every token (no permutation), so it shares no code with
    the sorted-rows path it checks. Weights are cast to x's dtype like the real path.
    """
    dt, f32 = x_TxD.dtype, jnp.float32
    # Inputs are rounded to the compute dtype like the real path, then everything runs in
    # float32 (XLA:CPU has no bf16 x bf16 -> f32 batched dot).
    x = x_TxD.astype(f32)
    g = jnp.einsum("td,edf->tef", x, w_gate_ExDxF.astype(dt).astype(f32), precision=_HI)
    u = jnp.einsum("td,edf->tef", x, w_up_ExDxF.astype(dt).astype(f32), precision=_HI)
    h = (jax.nn.silu(g) * u).astype(dt).astype(f32)
    y_TxExD = jnp.einsum("tef,efd->ted", h, w_down_ExFxD.astype(dt).astype(f32), precision=_HI)
    y_TxkxD = jnp.take_along_axis(y_TxExD.astype(dt), expert_ids_Txk[:, :, None], axis=1)
    out = jnp.einsum("tkd,tk->td", y_TxkxD.astype(jnp.float32), weights_Txk.astype(jnp.float32), precision=_HI)
    return out.astype(dt)
