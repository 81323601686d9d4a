"""Expert parallelism: experts sharded over one mesh axis, tokens exchanged with all-to-all.

Per device (inside `shard_map`), with P devices on the expert axis and E_l = E / P local
experts (the GShard / MaxText dispatch scheme, Lepikhin et al. 2020, arXiv:2006.16668):

  1. permute the local tokens by global expert: rows for device d are contiguous
  2. exchange rows: device d receives every row routed to its experts
  3. sort the received rows by local expert, run the SwiGLU experts (grouped matmul)
  4. exchange back, combine with the routing weights

Exchanges ("exchange="):
  "ragged"  `lax.ragged_all_to_all`: only real rows travel (GPU/TPU; XLA:CPU lacks it).
  "padded"  `lax.all_to_all` of a [P, C, D] buffer with C = T_local * k (the worst case:
            no token is ever dropped); works everywhere, costs P times the memory.
  "ragged_emulated"  the ragged path with the collective emulated by all_gather: same
            offsets and layout as "ragged", runs on CPU, for tests.
  "auto"    ragged on GPU/TPU, padded on CPU.

Tokens are sharded over every mesh axis (each device routes its own slice, in the order of
`token_axes`); expert weights over `expert_axis` only, replicated over the others (their
gradients are summed over those axes by `shard_map`'s transpose).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..shard_map import shard_map
from . import ops

EXCHANGES = ("auto", "padded", "ragged", "ragged_emulated")


# ----------------------------------------------------------------------------- injective gathers


@jax.custom_vjp
def _partial_gather(x, idx, valid, inv_idx, inv_valid):
    """out[i] = x[idx[i]] where valid[i] else 0, for an injective idx on the valid rows.

    (inv_idx, inv_valid) is the inverse map, so the VJP is the gather g[inv_idx] (masked)
    instead of the scatter-add autodiff would emit for a general gather.
    """
    return jnp.where(valid[:, None], x[idx], 0)


def _partial_gather_fwd(x, idx, valid, inv_idx, inv_valid):
    return _partial_gather(x, idx, valid, inv_idx, inv_valid), (inv_idx, inv_valid)


def _partial_gather_bwd(res, g):
    inv_idx, inv_valid = res
    return jnp.where(inv_valid[:, None], g[inv_idx], 0), None, None, None, None


_partial_gather.defvjp(_partial_gather_fwd, _partial_gather_bwd)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all` semantics built from all_gather (one slice per device).

    For tests on CPU, where the real collective is not implemented; gathers everyone's
    operand, so it is P times heavier than the real thing.
    """
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    ops_all = jax.lax.all_gather(operand, axis_name)  # [P(src), rows, D]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # what each source sends me
    size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    j = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]
    hit = (j >= out_off[None, :]) & (j < (out_off + size)[None, :])  # [rows, P]
    src = jnp.argmax(hit, axis=1)
    row = jnp.clip(in_off[src] + j[:, 0] - out_off[src], 0, operand.shape[0] - 1)
    return jnp.where(jnp.any(hit, axis=1)[:, None], ops_all[src, row], output)


# ----------------------------------------------------------------------------- the per-device program


def _local_expert_ids(recv_counts_PxEl, recv_offsets_P, n_rows):
    """Local expert of each received row (E_l for padding rows), given where each source's
    chunk starts and how many rows of each local expert it holds (chunks are expert-sorted)."""
    n_src, E_l = recv_counts_PxEl.shape
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    sizes_P = recv_counts_PxEl.sum(axis=1)
    src = jnp.clip(jnp.searchsorted(recv_offsets_P, rows, side="right") - 1, 0, n_src - 1)
    q = rows - recv_offsets_P[src]
    valid = (q >= 0) & (q < sizes_P[src])
    local = jnp.sum(q[:, None] >= jnp.cumsum(recv_counts_PxEl, axis=1)[src], axis=1).astype(jnp.int32)
    return jnp.where(valid, local, E_l)


def _local_moe(x_TxD, ids_Txk, w_Txk, wg, wu, wd, *, n_experts, axis, implementation, tiling, exchange):
    n_dev = jax.lax.axis_size(axis)
    E_l = wg.shape[0]
    D = x_TxD.shape[1]
    xs, gs_E, perm = ops.permute(x_TxD, ids_Txk, n_experts)
    M = xs.shape[0]

    send_counts_PxEl = gs_E.reshape(n_dev, E_l)
    send_sizes_P = send_counts_PxEl.sum(axis=1)
    send_offsets_P = _exclusive_cumsum(send_sizes_P)
    recv_counts_PxEl = jax.lax.all_to_all(send_counts_PxEl, axis, 0, 0, tiled=True)
    recv_sizes_P = recv_counts_PxEl.sum(axis=1)
    # Sorted row m goes to device dest(m), at position m - send_offsets[dest(m)] of that chunk.
    dest_M = jnp.searchsorted(jnp.cumsum(gs_E), jnp.arange(M, dtype=jnp.int32), side="right") // E_l
    dest_M = jnp.clip(dest_M, 0, n_dev - 1).astype(jnp.int32)
    pos_in_chunk_M = jnp.arange(M, dtype=jnp.int32) - send_offsets_P[dest_M]

    if exchange == "padded":
        C = M  # worst case: every local row routed to one device
        slot = jnp.arange(n_dev * C, dtype=jnp.int32)
        d, r = slot // C, slot % C
        send_valid = r < send_sizes_P[d]
        slot_of_row = dest_M * C + pos_in_chunk_M
        always = jnp.ones((M,), bool)
        buf = _partial_gather(xs, jnp.clip(send_offsets_P[d] + r, 0, M - 1), send_valid, slot_of_row, always)
        recv = jax.lax.all_to_all(buf.reshape(n_dev, C, D), axis, 0, 0, tiled=True).reshape(n_dev * C, D)
        recv_offsets_P = jnp.arange(n_dev, dtype=jnp.int32) * C
    else:
        a2a = jax.lax.ragged_all_to_all if exchange == "ragged" else ragged_all_to_all_emulated
        me = jax.lax.axis_index(axis)
        sizes_PxP = jax.lax.all_gather(send_sizes_P, axis)  # [src, dst]
        out_offsets_P = _exclusive_cumsum(sizes_PxP, axis=0)[me]  # where my chunk lands on each dst
        recv_offsets_P = _exclusive_cumsum(recv_sizes_P)
        recv = a2a(
            xs,
            jnp.zeros((n_dev * M, D), xs.dtype),
            send_offsets_P,
            send_sizes_P,
            out_offsets_P,
            recv_sizes_P,
            axis_name=axis,
        )

    n_rows = recv.shape[0]
    local_ids = _local_expert_ids(recv_counts_PxEl, recv_offsets_P, n_rows)
    # Padding rows form group E_l, which sorts last and which the grouped matmul never visits.
    rs, lgs, lperm = ops.permute(recv, local_ids[:, None], E_l + 1)
    y_rs = ops.expert_ffn_sorted(rs, lgs[:E_l], wg, wu, wd, implementation=implementation, tiling=tiling)
    y_recv = ops.combine(y_rs, lperm, jnp.ones((n_rows, 1), jnp.float32))

    if exchange == "padded":
        back = jax.lax.all_to_all(y_recv.reshape(n_dev, C, D), axis, 0, 0, tiled=True).reshape(n_dev * C, D)
        y_sorted = _partial_gather(back, slot_of_row, always, jnp.clip(send_offsets_P[d] + r, 0, M - 1), send_valid)
    else:
        offsets_PxP = jax.lax.all_gather(send_offsets_P, axis)  # [src, dst]
        back_offsets_P = offsets_PxP[:, me]  # where each source expects its rows back
        y_sorted = a2a(
            y_recv,
            jnp.zeros((M, D), y_recv.dtype),
            recv_offsets_P,
            recv_sizes_P,
            back_offsets_P,
            send_sizes_P,
            axis_name=axis,
        )
    return ops.combine(y_sorted, perm, w_Txk)


def moe_ffn_ep(
    x_TxD,
    expert_ids_Txk,
    weights_Txk,
    w_gate_ExDxF,
    w_up_ExDxF,
    w_down_ExFxD,
    *,
    mesh,
    expert_axis,
    token_axes=None,
    implementation="auto",
    tiling=None,
    exchange="auto",
):
    """`ops.moe_ffn` with experts sharded over `mesh.shape[expert_axis]` devices.

    Same result as the single-device call (up to summation order). T must divide by the
    mesh size and E by the expert-axis size. The tokens are split over every mesh axis,
    `token_axes` first in their order, then the others in the mesh's: pass the axes the
    caller's [B, L] activations are split over (batch axes, then sequence axes), and each
    device's share of the flattened tokens is a slice of what it already holds, so the
    shard_map moves nothing on the way in or out.
    """
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"moe_ffn: expert_axis={expert_axis!r} is not an axis of the mesh {mesh.axis_names}.")
    if exchange not in EXCHANGES:
        raise ValueError(f"moe_ffn_ep: exchange={exchange!r} is not one of {EXCHANGES}.")
    ep = mesh.shape[expert_axis]
    T, E = x_TxD.shape[0], w_gate_ExDxF.shape[0]
    if E % ep:
        raise ValueError(
            f"moe_ffn: {E} experts do not split over {ep} devices of axis {expert_axis!r}; "
            "choose an expert-axis size that divides n_experts."
        )
    if T % mesh.size:
        raise ValueError(
            f"moe_ffn: {T} tokens do not split over the {mesh.size} devices of the mesh; "
            "pad the batch or change the batch size."
        )
    if exchange == "auto":
        platform = mesh.devices.flat[0].platform
        exchange = "ragged" if platform in ("gpu", "cuda", "rocm", "tpu") else "padded"
    impl = ops.resolve_implementation(implementation)
    order = tuple(token_axes or ()) + tuple(a for a in mesh.axis_names if a not in (token_axes or ()))
    tokens = P(order)
    experts = P(expert_axis)
    fn = functools.partial(
        _local_moe, n_experts=E, axis=expert_axis, implementation=impl, tiling=tiling, exchange=exchange
    )
    return shard_map(fn, mesh, (tokens, tokens, tokens, experts, experts, experts), tokens)(
        x_TxD, expert_ids_Txk, weights_Txk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD
    )
