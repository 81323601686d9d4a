"""Shared checks of grouped_matmul implementations against kernels/moe/reference.py.

Shapes are fixed (one compile per implementation, dtype and tiling); the group sizes
are traced values, so hypothesis examples and the hand-picked cases reuse the compiled code.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from ptrain.kernels import moe
from ptrain.kernels.moe import reference

M, K, N, G = 40, 32, 24, 5
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=6e-2, rtol=6e-2)}

# Hand-picked cases: ragged, empty groups, all rows in one group, rows past the groups,
# sizes that are not multiples of any tile, nothing at all.
CASES = [
    [8, 8, 8, 8, 8],
    [3, 0, 17, 0, 20],
    [0, 0, 40, 0, 0],
    [1, 2, 3, 4, 5],
    [0, 0, 0, 0, 0],
    [13, 0, 0, 0, 27],
]


@functools.cache
def _compiled(impl, dtype, tiling):
    """value_and_grad of a fixed cotangent contraction, jitted once per implementation/dtype."""

    def f(fn, lhs, rhs, gs, cot):
        return jnp.sum(fn(lhs, rhs, gs).astype(jnp.float32) * cot)

    impl_fn = functools.partial(moe.grouped_matmul, implementation=impl, tiling=tiling)
    ref_fn = reference.grouped_matmul
    run = jax.jit(lambda *a: (impl_fn(*a[:3]), jax.grad(functools.partial(f, impl_fn), argnums=(0, 1))(*a)))
    ref = jax.jit(lambda *a: (ref_fn(*a[:3]), jax.grad(functools.partial(f, ref_fn), argnums=(0, 1))(*a)))
    return run, ref


def _operands(dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(k1, (M, K)).astype(dtype)
    rhs = (jax.random.normal(k2, (G, K, N)) / 4).astype(dtype)
    cot = jax.random.normal(k3, (M, N))
    return lhs, rhs, cot


def check_gmm(impl, dtype, sizes, tiling=None):
    lhs, rhs, cot = _operands(dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    run, ref = _compiled(impl, dtype, tiling)
    (out, (dl, dr)), (out_r, (dl_r, dr_r)) = run(lhs, rhs, gs, cot), ref(lhs, rhs, gs, cot)
    tol = TOL[dtype]
    assert out.dtype == dtype and dl.dtype == dtype and dr.dtype == dtype
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_r), **tol, err_msg=f"forward {impl} {sizes}")
    np.testing.assert_allclose(f32(dl), f32(dl_r), **tol, err_msg=f"d lhs {impl} {sizes}")
    np.testing.assert_allclose(f32(dr), f32(dr_r), **tol, err_msg=f"d rhs {impl} {sizes}")
    # Rows past the groups are exactly zero, and so are their input gradients.
    total = int(sum(sizes))
    assert not np.any(f32(out)[total:]) and not np.any(f32(dl)[total:])


# G sorted cut points in [0, M] -> G sizes summing to at most M (empty groups are likely).
GROUP_SIZES = st.lists(st.integers(0, M), min_size=G, max_size=G).map(lambda cuts: list(np.diff([0] + sorted(cuts))))
