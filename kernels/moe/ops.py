"""Public MoE dispatch ops with custom VJPs: permute, grouped_matmul, combine, moe_ffn.

Data flow of one MoE layer (M = T*k sorted rows, E experts):

  x_TxD --permute--> x_sorted_MxD --grouped_matmul(w_gate|w_up)--> h_Mx2F --SwiGLU-->
  a_MxF --grouped_matmul(w_down)--> y_sorted_MxD --combine(weights)--> y_TxD

`grouped_matmul` follows megablox (jax/experimental/pallas/ops/tpu/megablox/ops.py):
d lhs = gmm(d out, rhs^T), d rhs = tgmm(lhs, d out). Permute and combine are gathers whose
gradients are gathers with the inverse permutation (MaxText moe.py), never scatter-adds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import xla

IMPLEMENTATIONS = (
    "xla",
    "ragged_dot",
    "pallas_tpu",
    "pallas_tpu_interpret",
    "pallas_gpu",
    "pallas_gpu_interpret",
)


def resolve_implementation(implementation: str) -> str:
    """Maps "auto" to the native path of the default backend (TPU: Mosaic, GPU: Pallas GPU, else XLA)."""
    if implementation == "auto":
        platform = jax.default_backend()
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "xla")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {('auto',) + IMPLEMENTATIONS}.")
    return implementation


# ----------------------------------------------------------------------------- permute / combine


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Permutation:
    """How `permute` sorted the T*k assignments; `combine` undoes it.

    sort_idx_M  int32: sorted position m holds flat assignment sort_idx[m] (= t*k + j)
    inv_idx_M   int32: flat assignment t*k + j sits at sorted position inv_idx[t*k + j]
    """

    sort_idx_M: jax.Array
    inv_idx_M: jax.Array


@jax.custom_vjp
def _expand_sorted(x_TxD, sort_idx_M, inv_idx_M):
    k = sort_idx_M.shape[0] // x_TxD.shape[0]
    return x_TxD[sort_idx_M // k]


def _expand_sorted_fwd(x_TxD, sort_idx_M, inv_idx_M):
    return _expand_sorted(x_TxD, sort_idx_M, inv_idx_M), (sort_idx_M, inv_idx_M, x_TxD.shape[0])


def _expand_sorted_bwd(res, g_MxD):
    sort_idx_M, inv_idx_M, T = res
    # Each token's k copies sit at inv_idx[t*k:(t+1)*k]: gather them back and add.
    dx = g_MxD[inv_idx_M].reshape(T, -1, g_MxD.shape[-1]).sum(axis=1)
    return dx, None, None


_expand_sorted.defvjp(_expand_sorted_fwd, _expand_sorted_bwd)


@jax.custom_vjp
def _gather_rows(x_MxD, idx_M, inv_idx_M):
    """x[idx] for a permutation idx whose inverse is inv_idx (so the VJP is g[inv_idx])."""
    return x_MxD[idx_M]


def _gather_rows_fwd(x_MxD, idx_M, inv_idx_M):
    return x_MxD[idx_M], inv_idx_M


def _gather_rows_bwd(inv_idx_M, g_MxD):
    return g_MxD[inv_idx_M], None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _stable_argsort_small_keys(keys_M: jax.Array, n_keys: int) -> jax.Array:
    """Stable argsort of int32 keys in [0, n_keys): one sort of key * M + position.

    Unique packed keys need no tie-break, so XLA sorts one int32 operand instead of a
    (key, index) pair through a comparator (several times faster on CPU).
    Falls back to argsort when the packed key would overflow int32.
    """
    M = keys_M.shape[0]
    if n_keys * M >= 2**31:
        return jnp.argsort(keys_M, stable=True).astype(jnp.int32)
    pos = jnp.arange(M, dtype=jnp.int32)
    return jax.lax.sort(keys_M * M + pos) % M


def permute(x_TxD: jax.Array, expert_ids_Txk: jax.Array, n_experts: int):
    """Copies each token once per chosen expert and sorts the copies by expert.

    x_sorted[m] = x[sort_idx[m] // k], sort_idx = stable argsort of expert_ids.ravel().

    Expert ids should lie in [0, n_experts) (not checkable under jit): an id outside drops
    out of group_sizes, its row sorts past the groups and its expert output is zero.

    Returns:
      x_sorted_MxD (M = T*k), group_sizes_E int32 (rows per expert, zeros allowed),
      and the `Permutation` that `combine` needs. The VJP gathers with the inverse.
    """
    if x_TxD.ndim != 2 or expert_ids_Txk.ndim != 2 or x_TxD.shape[0] != expert_ids_Txk.shape[0]:
        raise ValueError(
            f"permute: need x_TxD 2-D and expert_ids_Txk 2-D with the same T; got {x_TxD.shape} and "
            f"{expert_ids_Txk.shape}. Flatten batch and length first."
        )
    if not jnp.issubdtype(expert_ids_Txk.dtype, jnp.integer):
        raise ValueError(f"permute: expert_ids_Txk must be integer, got {expert_ids_Txk.dtype}.")
    flat_M = expert_ids_Txk.reshape(-1).astype(jnp.int32)
    # Out-of-range ids (negative ones too) sort last, past every group.
    flat_M = jnp.where((flat_M >= 0) & (flat_M < n_experts), flat_M, n_experts)
    M = flat_M.shape[0]
    sort_idx = _stable_argsort_small_keys(flat_M, n_experts + 1)
    inv_idx = jnp.zeros((M,), jnp.int32).at[sort_idx].set(jnp.arange(M, dtype=jnp.int32))
    group_sizes = jnp.zeros((n_experts,), jnp.int32).at[flat_M].add(1)
    x_sorted = _expand_sorted(x_TxD, sort_idx, inv_idx)
    return x_sorted, group_sizes, Permutation(sort_idx, inv_idx)


def combine(y_sorted_MxD: jax.Array, perm: Permutation, weights_Txk: jax.Array) -> jax.Array:
    """Undoes `permute` and takes the weighted sum over the k experts of each token.

    y[t] = sum_j weights[t, j] * y_sorted[inv_idx[t*k + j]]   (accumulated in float32)
    Differentiable in y_sorted (a gather with sort_idx) and in the weights.
    """
    T, k = weights_Txk.shape
    if y_sorted_MxD.shape[0] != T * k:
        raise ValueError(f"combine: y_sorted has {y_sorted_MxD.shape[0]} rows, expected T*k = {T}*{k}.")
    y_TxkxD = _gather_rows(y_sorted_MxD, perm.inv_idx_M, perm.sort_idx_M).reshape(T, k, -1)
    # An elementwise product and a k-term sum: XLA:CPU has no bf16 x bf16 -> f32 batched dot.
    out = jnp.sum(y_TxkxD.astype(jnp.float32) * weights_Txk.astype(jnp.float32)[:, :, None], axis=1)
    return out.astype(y_sorted_MxD.dtype)


# ----------------------------------------------------------------------------- grouped matmul


def _backend(implementation: str):
    """(gmm, tgmm) callables for an implementation name; Pallas modules load lazily."""
    if implementation == "xla":
        return xla.gmm, xla.tgmm
    if implementation == "ragged_dot":
        from . import ragged

        return ragged.gmm, ragged.tgmm
    if implementation.startswith("pallas_tpu"):
        from . import pallas_tpu

        interpret = implementation.endswith("_interpret")
        return (
            functools.partial(pallas_tpu.gmm, interpret=interpret),
            functools.partial(pallas_tpu.tgmm, interpret=interpret),
        )
    if implementation.startswith("pallas_gpu"):
        from . import pallas_gpu

        interpret = implementation.endswith("_interpret")
        return (
            functools.partial(pallas_gpu.gmm, interpret=interpret),
            functools.partial(pallas_gpu.tgmm, interpret=interpret),
        )
    raise ValueError(f"unknown implementation {implementation!r}")


def _tiling_kw(implementation, tiling):
    """`tiling` is (tm, tk, tn) for the Pallas kernels; the XLA path uses only tm."""
    if tiling is None:
        return {}
    if implementation == "xla":
        return {"tm": tiling[0]}
    if implementation == "ragged_dot":
        return {}
    return {"tiling": tuple(tiling)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, group_sizes, implementation, out_dtype, tiling):
    gmm, _ = _backend(implementation)
    return gmm(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=out_dtype, **_tiling_kw(implementation, tiling))


def _gmm_fwd(lhs, rhs, group_sizes, implementation, out_dtype, tiling):
    return _gmm(lhs, rhs, group_sizes, implementation, out_dtype, tiling), (lhs, rhs, group_sizes)


def _gmm_bwd(implementation, out_dtype, tiling, res, g_MxN):
    lhs, rhs, group_sizes = res
    gmm, tgmm = _backend(implementation)
    kw = _tiling_kw(implementation, tiling)
    g = g_MxN.astype(lhs.dtype)
    dlhs = gmm(g, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype, **kw)
    drhs = tgmm(lhs, g, group_sizes, out_dtype=rhs.dtype, **kw)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(
    lhs_MxK: jax.Array,
    rhs_GxKxN: jax.Array,
    group_sizes_G: jax.Array,
    *,
    implementation: str = "auto",
    preferred_element_type=None,
    tiling: tuple[int, int, int] | None = None,
) -> jax.Array:
    """Grouped (ragged) matmul: out[m] = lhs[m] @ rhs[g] for rows m of group g.

    Rows are sorted by group: group g owns rows [sum(gs[:g]), sum(gs[:g+1])); rows beyond
    sum(group_sizes) come out as zeros. Differentiable in lhs and rhs (custom VJP:
    d lhs = grouped_matmul(d out, rhs^T), d rhs[g] = lhs_g^T d out_g), as in megablox
    (Gale et al. 2022, MegaBlocks, arXiv:2211.15841).

    Args:
      lhs_MxK: sorted rows, float32 or bfloat16.
      rhs_GxKxN: one KxN matrix per group, same dtype as lhs (cast master weights first).
      group_sizes_G: int32 rows per group; sum <= M.
      implementation: "auto" | "xla" | "ragged_dot" | "pallas_tpu" | "pallas_gpu" |
        "pallas_tpu_interpret" | "pallas_gpu_interpret".
      preferred_element_type: output dtype (default lhs dtype); accumulation is float32.
      tiling: (tm, tk, tn) block sizes for the Pallas kernels (tm only for "xla").
    Returns:
      out_MxN.
    """
    impl = resolve_implementation(implementation)
    if lhs_MxK.ndim != 2 or rhs_GxKxN.ndim != 3 or group_sizes_G.ndim != 1:
        raise ValueError(
            f"grouped_matmul: need lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs_MxK.shape}, "
            f"{rhs_GxKxN.shape}, {group_sizes_G.shape}."
        )
    if lhs_MxK.shape[1] != rhs_GxKxN.shape[1] or rhs_GxKxN.shape[0] != group_sizes_G.shape[0]:
        raise ValueError(
            f"grouped_matmul: lhs {lhs_MxK.shape}, rhs {rhs_GxKxN.shape}, group_sizes {group_sizes_G.shape} "
            "disagree: K must match lhs.shape[1] == rhs.shape[1] and G rhs.shape[0] == group_sizes.shape[0]."
        )
    if lhs_MxK.dtype != rhs_GxKxN.dtype:
        raise ValueError(
            f"grouped_matmul: lhs is {lhs_MxK.dtype} but rhs is {rhs_GxKxN.dtype}; cast the weights to the "
            "compute dtype (rhs.astype(lhs.dtype)) so that the gradient reaches the master copy."
        )
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integer, got {group_sizes_G.dtype}.")
    if tiling is not None and len(tuple(tiling)) != 3:
        raise ValueError(f"grouped_matmul: tiling must be (tm, tk, tn), got {tiling!r}.")
    out_dtype = jnp.dtype(preferred_element_type or lhs_MxK.dtype)
    tiling = None if tiling is None else tuple(int(t) for t in tiling)
    lhs_MxK, rhs_GxKxN = _match_varying_axes(lhs_MxK, rhs_GxKxN)
    return _gmm(lhs_MxK, rhs_GxKxN, group_sizes_G.astype(jnp.int32), impl, out_dtype, tiling)


def _varying_axes(a) -> frozenset:
    """Manual mesh axes along which `a` varies (jax 0.10: aval.manual_axis_type; older/newer: aval.vma)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _match_varying_axes(*arrays):
    """Inside shard_map, marks every operand as varying over the union of their manual axes.

    A weight replicated over the data axes meets rows that vary over them; the custom VJP
    must return a weight gradient of the weight's own type, so the cast happens outside
    it and its transpose is the psum over those axes. A no-op outside shard_map.
    """
    vmas = [_varying_axes(a) for a in arrays]
    union = frozenset().union(*vmas)
    if not union:
        return arrays
    pcast = getattr(jax.lax, "pcast", None)
    out = []
    for a, vma in zip(arrays, vmas):
        missing = tuple(sorted(union - vma))
        if missing:
            a = pcast(a, missing, to="varying") if pcast is not None else jax.lax.pvary(a, missing)
        out.append(a)
    return tuple(out)


# ----------------------------------------------------------------------------- expert FFN


def expert_ffn_sorted(
    x_sorted_MxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, implementation="auto", tiling=None
):
    """SwiGLU experts on expert-sorted rows: down_e(silu(x gate_e) * (x up_e)).

    Gate and up projections run as one grouped matmul on [gate | up] (ExDx2F): one pass
    over the rows instead of two. Weights are cast to the rows' dtype (the compute dtype).
    The "xla" implementation runs the whole expert MLP per row tile (`xla.fused_expert_ffn`).
    """
    dt = x_sorted_MxD.dtype
    F = w_gate_ExDxF.shape[-1]
    if resolve_implementation(implementation) == "xla":
        # One fused loop per pass instead of two grouped matmuls, an elementwise pass and
        # four more grouped matmuls backward (measured in tools/bench_moe.py).
        x_sorted_MxD, wg, wu, wd = _match_varying_axes(
            x_sorted_MxD, w_gate_ExDxF.astype(dt), w_up_ExDxF.astype(dt), w_down_ExFxD.astype(dt)
        )
        return xla.fused_expert_ffn(x_sorted_MxD, group_sizes_E, wg, wu, wd, tm=None if tiling is None else tiling[0])
    w_gu = jnp.concatenate([w_gate_ExDxF.astype(dt), w_up_ExDxF.astype(dt)], axis=-1)
    h = grouped_matmul(x_sorted_MxD, w_gu, group_sizes_E, implementation=implementation, tiling=tiling)
    a = (jax.nn.silu(h[:, :F].astype(jnp.float32)) * h[:, F:].astype(jnp.float32)).astype(dt)
    return grouped_matmul(a, w_down_ExFxD.astype(dt), group_sizes_E, implementation=implementation, tiling=tiling)


def _check_ffn_args(x, ids, weights, wg, wu, wd):
    if x.ndim != 2:
        raise ValueError(f"moe_ffn: x_TxD must be 2-D, got {x.shape}; reshape [B, L, D] to [B*L, D].")
    T, D = x.shape
    if ids.shape != weights.shape or ids.ndim != 2 or ids.shape[0] != T:
        raise ValueError(f"moe_ffn: expert_ids {ids.shape} and weights {weights.shape} must both be [T={T}, k].")
    E, D2, F = wg.shape
    if D2 != D or wu.shape != wg.shape or wd.shape != (E, F, D):
        raise ValueError(
            f"moe_ffn: weight shapes gate {wg.shape}, up {wu.shape}, down {wd.shape} do not fit x [T, {D}]; "
            "expected gate/up [E, D, F] and down [E, F, D]."
        )


def moe_ffn(
    x_TxD: jax.Array,
    expert_ids_Txk: jax.Array,
    weights_Txk: jax.Array,
    w_gate_ExDxF: jax.Array,
    w_up_ExDxF: jax.Array,
    w_down_ExFxD: jax.Array,
    *,
    implementation: str = "auto",
    tiling: tuple[int, int, int] | None = None,
    mesh=None,
    expert_axis: str | None = None,
    token_axes: tuple[str, ...] | None = None,
) -> jax.Array:
    """Routed SwiGLU experts: y[t] = sum_j w[t,j] * down_e(silu(x[t] gate_e) * (x[t] up_e)), e = ids[t,j].

    Shazeer et al. 2017 / Fedus et al. 2021 token-choice MoE with SwiGLU experts (Shazeer 2020).
    Compute dtype is x's dtype; float32 master weights are cast inside (their gradients
    come back in float32). Pass `routing.expert_ids_Txk, routing.weights_Txk` from `route`.

    With `mesh` and `expert_axis`, experts are sharded over that mesh axis (expert
    parallelism, `expert_parallel.moe_ffn_ep`): tokens are exchanged with all-to-all.
    `token_axes` orders the mesh axes the tokens are split over (see moe_ffn_ep).

    Returns:
      y_TxD in x's dtype.
    """
    _check_ffn_args(x_TxD, expert_ids_Txk, weights_Txk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    if (mesh is None) != (expert_axis is None):
        raise ValueError("moe_ffn: pass both mesh and expert_axis for expert parallelism, or neither.")
    if mesh is not None:
        from . import expert_parallel

        return expert_parallel.moe_ffn_ep(
            x_TxD,
            expert_ids_Txk,
            weights_Txk,
            w_gate_ExDxF,
            w_up_ExDxF,
            w_down_ExFxD,
            mesh=mesh,
            expert_axis=expert_axis,
            token_axes=token_axes,
            implementation=implementation,
            tiling=tiling,
        )
    E = w_gate_ExDxF.shape[0]
    x_sorted, group_sizes, perm = permute(x_TxD, expert_ids_Txk, E)
    y_sorted = expert_ffn_sorted(
        x_sorted, group_sizes, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, implementation=implementation, tiling=tiling
    )
    return combine(y_sorted, perm, weights_Txk)
