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
  step is skipped. Within a step the queries go in blocks (`RING_QUERY_BLOCK`), so one
  [block, chunk] score matrix exists at a time. The backward pass is a second ring in which
  each chunk's key and value gradients travel with it and arrive home after N hops. No
  device holds more than two chunks of keys and values.
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
from ptrain.kernels.shard_map import shard_map
from ptrain.models.layers import MASK_VALUE, attention_mask, causal_attend

RING_QUERY_BLOCK = 512
"""Queries per score block of a ring step: each step forms [block, chunk] scores at a time,
not [chunk, chunk], which at a 32k-token chunk would be 4 GiB per head."""


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
    query_block: int = RING_QUERY_BLOCK
    """Ring mode: queries per score block (the largest divisor of the chunk up to this)."""

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
        if self.mode == "ring":
            fn = partial(_ring_local, axis=self.axis, n=self.size, window=window, query_block=self.query_block)
        else:
            fn = partial(_all_to_all_local, axis=self.axis, window=window)
        return shard_map(fn, self.mesh, (heads, heads, heads, rows), heads)(
            q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL
        )


def context_parallel_plan(cfg: Any, mesh: jax.sharding.Mesh | None, rules=None) -> ContextParallel | None:
    """The ContextParallel plan for `cfg` on `mesh` under `rules` (default
    ptrain.parallel.DEFAULT_RULES), or None when no mesh axis of size > 1 holds the logical
    `length` axis. ValueError when the split cannot work, with the fix."""
    if mesh is None:
        return None
    from ptrain.parallel.sharding import sole_split_axis, split_axes

    axis = sole_split_axis(mesh, rules, "length", "context parallelism passes keys round one axis")
    if axis is None:
        return None
    mode = cfg.context_attention
    if mode not in choices.CONTEXT_ATTENTION:
        raise ValueError(f"model.context_attention={mode!r}: pass {' | '.join(choices.CONTEXT_ATTENTION)}")
    head_axes = split_axes(mesh, rules, "kv_heads")
    split = math.prod(mesh.shape[a] for a in head_axes)
    if cfg.n_kv_heads % split or cfg.n_heads % split:
        head_axes, split = (), 1  # the heads are not split over those axes (logical_to_spec) here either
    n = mesh.shape[axis]
    if mode == "all_to_all" and (cfg.n_kv_heads // split) % n:
        raise ValueError(
            f"model.context_attention=all_to_all splits the kv heads over mesh.{axis}={n} devices, but each "
            f"device holds {cfg.n_kv_heads // split} kv heads; use context_attention=ring, or a context size that "
            "divides them"
        )
    return ContextParallel(mesh, axis, split_axes(mesh, rules, "batch"), head_axes, mode)


# ------------------------------------------------------------------------------- ring


def _query_block(chunk: int, most: int) -> int:
    """The largest divisor of the chunk length that is at most `most`."""
    return next(b for b in range(min(chunk, most), 0, -1) if chunk % b == 0)


def _ring_local(q, k, v, seg, *, axis, n, window, query_block):
    """Per device: q, k, v [B, C, H|K, Dh] and seg [B, C] of chunk `axis_index`. Queries go
    in blocks of Q rows: [nb, B, K, Q*G, Dh], scaled by 1/sqrt(Dh), the G query heads of a kv
    head as extra rows; keys and values head-major [B, K, C, Dh]."""
    B, C, H, Dh = q.shape
    K = k.shape[2]
    G, Q = H // K, _query_block(C, query_block)
    nb = C // Q
    qb = (
        (q * (1.0 / math.sqrt(Dh))).reshape(B, nb, Q, K, G, Dh).transpose(1, 0, 3, 2, 4, 5).reshape(nb, B, K, Q * G, Dh)
    )
    seg_b = seg.reshape(B, nb, Q).transpose(1, 0, 2)
    out = _ring(qb, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg_b, seg, axis, n, window)
    return out.reshape(nb, B, K, Q, G, Dh).transpose(1, 0, 3, 2, 4, 5).reshape(B, C, H, Dh)


def _block_mask(seg_q_BxQ, seg_k_BxC, q_start, k_start, window):
    """[B, Q, C]: query slot q_start + r may see key slot k_start + s."""
    qs = q_start + jnp.arange(seg_q_BxQ.shape[1])
    ks = k_start + jnp.arange(seg_k_BxC.shape[1])
    allowed = qs[:, None] >= ks[None, :]
    if window is not None:
        allowed = allowed & (qs[:, None] - ks[None, :] < window)
    return allowed[None] & (seg_q_BxQ[:, :, None] == seg_k_BxC[:, None, :])


def _scores(q_BxKxRxDh, k_BxKxCxDh, mask_BxQxC):
    """Masked float32 scores [B, K, R, C] (R = Q*G rows)."""
    B, K, R, _ = q_BxKxRxDh.shape
    Q, C = mask_BxQxC.shape[1:]
    s = jnp.einsum("bkrd,bksd->bkrs", q_BxKxRxDh, k_BxKxCxDh, preferred_element_type=jnp.float32)
    s = s.reshape(B, K, Q, R // Q, C)
    return jnp.where(mask_BxQxC[:, None, :, None, :], s, MASK_VALUE).reshape(B, K, R, C)


def _pass_on(xs, axis, n):
    """Each device's arrays to its successor on the ring."""
    return jax.lax.ppermute(xs, axis, [(i, (i + 1) % n) for i in range(n)])


def _starts(c, t, n, nb, Q):
    """Global slots of the first query of each block, and of the first key of the chunk held
    at ring step t."""
    C = nb * Q
    return c * C + jnp.arange(nb) * Q, ((c - t) % n) * C


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, seg_q, seg_k, axis, n, window):
    return _ring_fwd(q, k, v, seg_q, seg_k, axis, n, window)[0]


def _ring_fwd(q, k, v, seg_q, seg_k, axis, n, window):
    """Online softmax over the ring: step t attends to chunk (c - t) mod N, which is causally
    visible only when t <= c; the diagonal step comes first, and as every row sees its own
    slot there, the running max is finite from then on and masked blocks add exactly 0. Each
    step walks the query blocks (lax.map), so one [Q*G, C] score block lives at a time."""
    c = jax.lax.axis_index(axis)
    nb, Q = seg_q.shape[0], seg_q.shape[2]

    def update(carry, kv):
        k_t, v_t, seg_t, t = kv
        q_starts, k_start = _starts(c, t, n, nb, Q)

        def one(block):
            q_b, seg_b, q_start, m, l, o = block
            s = _scores(q_b, k_t, _block_mask(seg_b, seg_t, q_start, k_start, window))
            m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.exp(s - m_new)
            scale = jnp.exp(m - m_new)
            pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32)
            return m_new, l * scale + jnp.sum(p, axis=-1, keepdims=True), o * scale + pv

        return jax.lax.map(one, (q, seg_q, q_starts, *carry))

    zero = jnp.zeros_like(q[..., :1], dtype=jnp.float32)
    carry = update((zero + MASK_VALUE, zero, jnp.zeros_like(q, dtype=jnp.float32)), (k, v, seg_k, 0))
    k_t, v_t, seg_t = k, v, seg_k
    for t in range(1, n):
        k_t, v_t, seg_t = _pass_on((k_t, v_t, seg_t), axis, n)
        carry = jax.lax.cond(c >= t, update, lambda cr, _: cr, carry, (k_t, v_t, seg_t, t))
    m, l, o = carry
    out = (o / l).astype(q.dtype)
    return out, (q, k, v, seg_q, seg_k, out, m + jnp.log(l))


def _ring_bwd(axis, n, window, residuals, dout):
    """Flash-style backward over a second ring: with p = exp(s - lse) and
    delta = rowsum(dO * O): dS = p (dO V^T - delta), dQ = dS K, dK = dS^T Q, dV = p^T dO.
    dK and dV of a chunk ride with it round the ring, and one last hop takes them home."""
    q, k, v, seg_q, seg_k, out, lse = residuals
    c = jax.lax.axis_index(axis)
    nb, Q = seg_q.shape[0], seg_q.shape[2]
    do = dout.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1, keepdims=True)
    do = do.astype(v.dtype)

    def grads(acc, kv):
        dq, dk, dv = acc
        k_t, v_t, seg_t, t = kv
        q_starts, k_start = _starts(c, t, n, nb, Q)

        def one(dkv, block):
            q_b, do_b, delta_b, lse_b, seg_b, q_start, dq_b = block
            p = jnp.exp(_scores(q_b, k_t, _block_mask(seg_b, seg_t, q_start, k_start, window)) - lse_b)
            dp = jnp.einsum("bkrd,bksd->bkrs", do_b, v_t, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_b)).astype(q_b.dtype)
            dq_b = dq_b + jnp.einsum("bkrs,bksd->bkrd", ds, k_t, preferred_element_type=jnp.float32)
            dk_t = dkv[0] + jnp.einsum("bkrs,bkrd->bksd", ds, q_b, preferred_element_type=jnp.float32)
            dv_t = dkv[1] + jnp.einsum(
                "bkrs,bkrd->bksd", p.astype(do_b.dtype), do_b, preferred_element_type=jnp.float32
            )
            return (dk_t, dv_t), dq_b

        (dk, dv), dq = jax.lax.scan(one, (dk, dv), (q, do, delta, lse, seg_q, q_starts, dq))
        return dq, dk, dv

    zeros = (jnp.zeros_like(x, dtype=jnp.float32) for x in (q, k, v))
    dq, dk, dv = grads(tuple(zeros), (k, v, seg_k, 0))
    k_t, v_t, seg_t = k, v, seg_k
    for t in range(1, n):
        k_t, v_t, seg_t, dk, dv = _pass_on((k_t, v_t, seg_t, dk, dv), axis, n)
        dq, dk, dv = jax.lax.cond(c >= t, grads, lambda acc, _: acc, (dq, dk, dv), (k_t, v_t, seg_t, t))
    dk, dv = _pass_on((dk, dv), axis, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------------- all-to-all


def _all_to_all_local(q, k, v, seg, *, axis, window):
    """Per device: trade the sequence split for a heads split, attend, trade back. Query
    heads and kv heads split into the same N contiguous groups, so each device's query
    heads find their kv heads on the same device."""
    to_heads = partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    seg_all = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    out = causal_attend(to_heads(q), to_heads(k), to_heads(v), attention_mask(seg_all, window), window)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
