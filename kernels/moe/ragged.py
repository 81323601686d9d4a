"""`lax.ragged_dot` behind the gmm/tgmm interface: the baseline the other paths are measured against.

On XLA:CPU it masks a dense product per group (cost grows with G); on GPU it pads to
the worst case. Kept for benchmarks and as a cross-check, not as a default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs_MxK, rhs_GxKxN, group_sizes_G, *, transpose_rhs=False, out_dtype=None):
    rhs = jnp.swapaxes(rhs_GxKxN, 1, 2) if transpose_rhs else rhs_GxKxN
    out = jax.lax.ragged_dot(lhs_MxK, rhs, group_sizes_G, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or lhs_MxK.dtype)


def tgmm(lhs_MxK, dout_MxN, group_sizes_G, *, out_dtype=None):
    G, K, N = group_sizes_G.shape[0], lhs_MxK.shape[1], dout_MxN.shape[1]

    def f(rhs):
        return jax.lax.ragged_dot(lhs_MxK, rhs, group_sizes_G, preferred_element_type=jnp.float32)

    _, vjp = jax.vjp(f, jnp.zeros((G, K, N), lhs_MxK.dtype))
    (drhs,) = vjp(dout_MxN.astype(jnp.float32))
    return drhs.astype(out_dtype or lhs_MxK.dtype)
