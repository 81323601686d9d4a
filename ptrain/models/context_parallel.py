"""Context parallelism: one sequence split along its length over the devices of a mesh axis.

With a mesh axis of size N > 1 under the rules' logical `length` axis (the `context` axis by
default, `mesh.context=N`), the decoder's activations are split along the sequence: device
c holds slots [c L/N, (c+1) L/N) of every row. Every layer but attention works per token and
needs nothing more; attention needs every earlier key, and runs in one of two ways
(`model.context_attention`):

- ring: the keys and values, with their segment ids, go round the ring of N devices with
  `ppermute`, one neighbour hop per step, while each device attends its queries to the
  chunk it holds and merges the partial results with the online softmax (Liu et al. 2023,
  arXiv:2310.01889). A chunk from later in the sequence is causally masked whole, and its
  step is skipped. The backward pass is a second ring in which each chunk's key and value
  gradients travel with it and arrive home after N hops. No device holds more than two
  chunks of keys and values.
- all_to_all: Ulysses-style (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all trades the
  sequence split for a heads split, each device attends its share of the heads over the
  whole sequence, and a second all-to-all trades back. Four all-to-alls a layer whatever N
  is, where the ring moves keys and values N - 1 times; the kv heads must divide over N.

The mask is built per block from segment ids and global slots, so packed segments that cross
a chunk boundary attend as they do on one device, and positions (RoPE) are per token already.
Chunks are contiguous, so the causal skip leaves device c with c + 1 blocks of work: device
N - 1 sets the pace. A zigzag order of the chunks would even that out.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ptrain.config import choices
from ptrain.models.layers import MASK_VALUE, attention_mask, causal_attend


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How attention runs over a sequence split on `axis` (hashable: a static attribute of
    the module). batch_axes and head_axes: the mesh axes (of size > 1) the activations'
    batch and kv-heads dimensions are split over; mode: one of choices.CONTEXT_ATTENTION."""

    mesh: jax.sharding.Mesh
    axis: str
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]
    mode: str

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def applies(self, batch: int, length: int) -> bool:
        """Whether a [batch, length] input splits evenly (else the model runs it unsplit)."""
        rows = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        return length % self.size == 0 and batch % rows == 0

    def constrain(self, x_BxL: jax.Array) -> jax.Array:
        """Pins an activation [B, L, ...] to the batch x sequence split."""
        spec = P(self.batch_axes or None, self.axis, *([None] * (x_BxL.ndim - 2)))
        return jax.lax.with_sharding_constraint(x_BxL, NamedSharding(self.mesh, spec))

    def attend(
        self, q_BxLxHxDh: jax.Array, k_BxLxKxDh: jax.Array, v_BxLxKxDh: jax.Array, segment_ids_BxL: jax.Array, window
    ) -> jax.Array:
        """Causal, same-segment (and sliding-window) attention of the split sequence;
        the result of `causal_attend` with `attention_mask(segment_ids_BxL, window)`."""
        heads = P(self.batch_axes or None, self.axis, self.head_axes or None, None)
        rows = P(self.batch_axes or None, self.axis)
        local = _ring_local if self.mode == "ring" else _all_to_all_local
        fn = partial(local, axis=self.axis, n=self.size, window=window)
        return _shard_map(fn, self.mesh, (heads, heads, heads, rows), heads)(
            q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL
        )


def context_parallel_plan(cfg: Any, mesh: jax.sharding.Mesh | None, rules=None) -> ContextParallel | None:
    """The ContextParallel plan for `cfg` on `mesh` under `rules` (default
    ptrain.parallel.DEFAULT_RULES), or None when no mesh axis of size > 1 holds the logical
    `length` axis. ValueError when the split cannot work, with the fix."""
    if mesh is None:
        return None
    from ptrain.parallel.sharding import split_axes

    axes = split_axes(mesh, rules, "length")
    if not axes:
        return None
    if len(axes) > 1:
        raise ValueError(
            f"mesh.rules map the logical 'length' axis to the mesh axes {list(axes)}, all larger than 1; context "
            "parallelism passes keys round one axis: map 'length' to one of them"
        )
    mode = cfg.context_attention
    if mode not in choices.CONTEXT_ATTENTION:
        raise ValueError(f"model.context_attention={mode!r}: pass {' | '.join(choices.CONTEXT_ATTENTION)}")
    head_axes = split_axes(mesh, rules, "kv_heads")
    split = math.prod(mesh.shape[a] for a in head_axes)
    if cfg.n_kv_heads % split or cfg.n_heads % split:
        head_axes, split = (), 1  # the heads are not split over those axes (logical_to_spec) here either
    n = mesh.shape[axes[0]]
    if mode == "all_to_all" and (cfg.n_kv_heads // split) % n:
        raise ValueError(
            f"model.context_attention=all_to_all splits the kv heads over mesh.{axes[0]}={n} devices, but each "
            f"device holds {cfg.n_kv_heads // split} kv heads; use context_attention=ring, or a context size that "
            "divides them"
        )
    return ContextParallel(mesh, axes[0], split_axes(mesh, rules, "batch"), head_axes, mode)


# ------------------------------------------------------------------------------- ring


def _to_rows(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh):
    """Head-major layout: q [B, K, L*G, Dh] scaled by 1/sqrt(Dh) (the G query heads of a kv
    head as extra rows), k and v [B, K, L, Dh]."""
    B, L, H, Dh = q_BxLxHxDh.shape
    K = k_BxLxKxDh.shape[2]
    q = (q_BxLxHxDh * (1.0 / math.sqrt(Dh))).reshape(B, L, K, H // K, Dh).transpose(0, 2, 1, 3, 4)
    return q.reshape(B, K, L * (H // K), Dh), k_BxLxKxDh.transpose(0, 2, 1, 3), v_BxLxKxDh.transpose(0, 2, 1, 3)


def _block_mask(seg_q_BxC, seg_k_BxC, q_chunk, k_chunk, window):
    """[B, C, C]: query slot q_chunk*C + r may see key slot k_chunk*C + s."""
    C = seg_q_BxC.shape[1]
    qs = q_chunk * C + jnp.arange(C)
    ks = k_chunk * C + jnp.arange(C)
    allowed = qs[:, None] >= ks[None, :]
    if window is not None:
        allowed = allowed & (qs[:, None] - ks[None, :] < window)
    return allowed[None] & (seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :])


def _scores(q_BxKxRxDh, k_BxKxCxDh, mask_BxCxC):
    """Masked float32 scores [B, K, R, C] (R = C*G rows)."""
    B, K, R, _ = q_BxKxRxDh.shape
    C = k_BxKxCxDh.shape[2]
    s = jnp.einsum("bkrd,bksd->bkrs", q_BxKxRxDh, k_BxKxCxDh, preferred_element_type=jnp.float32)
    s = s.reshape(B, K, C, R // C, C)
    return jnp.where(mask_BxCxC[:, None, :, None, :], s, MASK_VALUE).reshape(B, K, R, C)


def _ring_local(q, k, v, seg, *, axis, n, window):
    """Per device: q, k, v [B, C, H|K, Dh] and seg [B, C] of chunk `axis_index`."""
    B, C, H, Dh = q.shape
    rows, kh, vh = _to_rows(q, k, v)
    out = _ring(rows, kh, vh, seg, axis, n, window)
    K = kh.shape[1]
    return out.reshape(B, K, C, H // K, Dh).transpose(0, 2, 1, 3, 4).reshape(B, C, H, Dh)


def _pass_on(xs, axis, n):
    """Each device's arrays to its successor on the ring."""
    return jax.lax.ppermute(xs, axis, [(i, (i + 1) % n) for i in range(n)])


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, seg, axis, n, window):
    return _ring_fwd(q, k, v, seg, axis, n, window)[0]


def _ring_fwd(q, k, v, seg, axis, n, window):
    """Online softmax over the ring: step t attends to chunk (c - t) mod N, which is causally
    visible only when t <= c; the diagonal step comes first, and as every row sees its own
    slot there, the running max is finite from then on and masked blocks add exactly 0."""
    c = jax.lax.axis_index(axis)

    def update(carry, kv):
        m, l, o = carry
        k_t, v_t, seg_t, t = kv
        s = _scores(q, k_t, _block_mask(seg, seg_t, c, (c - t) % n, window))
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - m_new)
        scale = jnp.exp(m - m_new)
        o = o * scale + jnp.einsum("bkrs,bksd->bkrd", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32)
        return m_new, l * scale + jnp.sum(p, axis=-1, keepdims=True), o

    zero = jnp.zeros_like(q[..., :1], dtype=jnp.float32)
    carry = update((zero + MASK_VALUE, zero, jnp.zeros_like(q, dtype=jnp.float32)), (k, v, seg, 0))
    k_t, v_t, seg_t = k, v, seg
    for t in range(1, n):
        k_t, v_t, seg_t = _pass_on((k_t, v_t, seg_t), axis, n)
        carry = jax.lax.cond(c >= t, update, lambda cr, _: cr, carry, (k_t, v_t, seg_t, t))
    m, l, o = carry
    out = (o / l).astype(q.dtype)
    return out, (q, k, v, seg, out, m + jnp.log(l))


def _ring_bwd(axis, n, window, residuals, dout):
    """Flash-style backward over a second ring: with p = exp(s - lse) and
    delta = rowsum(dO * O): dS = p (dO V^T - delta), dQ = dS K, dK = dS^T Q, dV = p^T dO.
    dK and dV of a chunk ride with it round the ring, and one last hop takes them home."""
    q, k, v, seg, out, lse = residuals
    c = jax.lax.axis_index(axis)
    do = dout.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1, keepdims=True)
    do = do.astype(v.dtype)

    def grads(acc, kv):
        dq, dk, dv = acc
        k_t, v_t, seg_t, t = kv
        p = jnp.exp(_scores(q, k_t, _block_mask(seg, seg_t, c, (c - t) % n, window)) - lse)
        dp = jnp.einsum("bkrd,bksd->bkrs", do, v_t, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta)).astype(q.dtype)
        dq = dq + jnp.einsum("bkrs,bksd->bkrd", ds, k_t, preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkrs,bkrd->bksd", ds, q, preferred_element_type=jnp.float32)
        dv = dv + jnp.einsum("bkrs,bkrd->bksd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
        return dq, dk, dv

    dq, dk, dv = grads(
        (
            jnp.zeros_like(q, dtype=jnp.float32),
            jnp.zeros_like(k, dtype=jnp.float32),
            jnp.zeros_like(v, dtype=jnp.float32),
        ),
        (k, v, seg, 0),
    )
    k_t, v_t, seg_t = k, v, seg
    for t in range(1, n):
        k_t, v_t, seg_t, dk, dv = _pass_on((k_t, v_t, seg_t, dk, dv), axis, n)
        dq, dk, dv = jax.lax.cond(c >= t, grads, lambda acc, _: acc, (dq, dk, dv), (k_t, v_t, seg_t, t))
    dk, dv = _pass_on((dk, dv), axis, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------------- all-to-all


def _all_to_all_local(q, k, v, seg, *, axis, n, window):
    """Per device: trade the sequence split for a heads split, attend, trade back. Query
    heads and kv heads split into the same N contiguous groups, so each device's query
    heads find their kv heads on the same device."""
    del n
    to_heads = partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    seg_all = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    out = causal_attend(to_heads(q), to_heads(k), to_heads(v), attention_mask(seg_all, window), window)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
