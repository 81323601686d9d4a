"""grouped_matmul / permute / combine / moe_ffn against kernels/moe/reference.py.

Shapes are fixed per module (one compile per implementation and dtype); hypothesis
varies the group sizes, which are traced values, so examples reuse the compiled code.
"""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ptrain.kernels import moe
from ptrain.kernels.moe import reference

M, K, N, G = 40, 16, 24, 5
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=6e-2, rtol=6e-2)}
# "xla" and "ragged_dot" here; the Pallas kernels have their own module (interpret mode).
IMPLS = ["xla", "ragged_dot"]

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


@functools.lru_cache(maxsize=None)
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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", CASES)
def test_grouped_matmul_cases(impl, dtype, sizes):
    check_gmm(impl, dtype, sizes)


# G sorted cut points in [0, M] -> G sizes summing to at most M (empty groups are likely).
group_sizes_strategy = st.lists(st.integers(0, M), min_size=G, max_size=G).map(
    lambda cuts: list(np.diff([0] + sorted(cuts))))


@pytest.mark.parametrize("tiling", [None, (8, 16, 24)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=group_sizes_strategy)
def test_grouped_matmul_xla_hypothesis(sizes, tiling):
    check_gmm("xla", jnp.float32, sizes, tiling)


def test_grouped_matmul_rejects_bad_input():
    lhs, rhs, _ = _operands(jnp.float32)
    gs = jnp.full((G,), 8, jnp.int32)
    with pytest.raises(ValueError, match="implementation"):
        moe.grouped_matmul(lhs, rhs, gs, implementation="cuda")
    with pytest.raises(ValueError, match="cast the weights"):
        moe.grouped_matmul(lhs, rhs.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="disagree"):
        moe.grouped_matmul(lhs, rhs[:, :8], gs)
    with pytest.raises(ValueError, match="integer"):
        moe.grouped_matmul(lhs, rhs, gs.astype(jnp.float32))


# ----------------------------------------------------------------------------- permute / combine / moe_ffn

T, D, F, E, TOPK = 19, 16, 8, 6, 2


@pytest.fixture(scope="module")
def ffn_inputs():
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    x = jax.random.normal(ks[0], (T, D))
    r = moe.route(jax.random.normal(ks[1], (T, E)), top_k=TOPK)
    # Expert 5 gets nobody: empty groups must work end to end.
    ids = jnp.where(r.expert_ids_Txk == 5, 4 - jnp.arange(TOPK)[None, :], r.expert_ids_Txk)
    ids = jnp.where(ids[:, :1] == ids[:, 1:], jnp.stack([ids[:, 0], (ids[:, 0] + 1) % 5], 1), ids)
    wg = jax.random.normal(ks[2], (E, D, F)) / 4
    wu = jax.random.normal(ks[3], (E, D, F)) / 4
    wd = jax.random.normal(ks[4], (E, F, D)) / 4
    return x, ids.astype(jnp.int32), r.weights_Txk, wg, wu, wd


def test_permute_and_combine_roundtrip(ffn_inputs):
    x, ids, w = ffn_inputs[:3]
    xs, gs, perm = moe.permute(x, ids, E)
    xs_r, gs_r, _ = reference.permute(x, ids, E)
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(xs_r))
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(gs_r))
    assert int(gs[5]) == 0
    # Combining the unchanged rows with weights w gives x * sum_j w[t, j].
    y = moe.combine(xs, perm, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x * w.sum(1, keepdims=True)), rtol=1e-5, atol=1e-6)


def test_permute_combine_gradients_are_gathers(ffn_inputs):
    x, ids, w = ffn_inputs[:3]

    def f(x, w):
        xs, _, perm = moe.permute(x, ids, E)
        return jnp.sum(moe.combine(xs * jnp.arange(1.0, T * TOPK + 1)[:, None], perm, w) ** 2)

    def f_ref(x, w):
        xs, _, order = reference.permute(x, ids, E)
        return jnp.sum(reference.combine(xs * jnp.arange(1.0, T * TOPK + 1)[:, None], order, w) ** 2)

    g, g_ref = jax.grad(f, (0, 1))(x, w), jax.grad(f_ref, (0, 1))(x, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # Only integer scatters (the inverse permutation, the group sizes) may appear.
    hlo = jax.jit(jax.grad(f)).lower(x, w).as_text(dialect="hlo")
    float_scatters = re.findall(r"= (?:f32|bf16)\[[^\]]*\][^ ]* scatter\(", hlo)
    assert not float_scatters, f"permute/combine backward should gather, found {float_scatters}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_ffn_matches_dense_reference(ffn_inputs, impl, dtype):
    x, ids, w, wg, wu, wd = ffn_inputs
    x = x.astype(dtype)

    def loss(fn, x, w, wg, wu, wd):
        return jnp.sum(fn(x, ids, w, wg, wu, wd).astype(jnp.float32) ** 2)

    fn = functools.partial(moe.moe_ffn, implementation=impl)
    out, out_r = jax.jit(fn)(x, ids, w, wg, wu, wd), reference.moe_ffn(x, ids, w, wg, wu, wd)
    assert out.dtype == dtype
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_r, np.float32), **tol)
    grads = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3, 4)))(x, w, wg, wu, wd)
    grads_r = jax.grad(functools.partial(loss, reference.moe_ffn), argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wd)
    for name, a, b in zip(["x", "weights", "gate", "up", "down"], grads, grads_r):
        assert a.dtype == b.dtype, name
        scale = float(jnp.abs(b.astype(jnp.float32)).max()) + 1e-6
        err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) / scale
        assert err < (1e-5 if dtype == jnp.float32 else 5e-2), f"grad {name}: relative error {err}"


def test_moe_ffn_rejects_bad_shapes(ffn_inputs):
    x, ids, w, wg, wu, wd = ffn_inputs
    with pytest.raises(ValueError, match="reshape"):
        moe.moe_ffn(x[None], ids, w, wg, wu, wd)
    with pytest.raises(ValueError, match="down"):
        moe.moe_ffn(x, ids, w, wg, wu, wd[:, :, :3])
    with pytest.raises(ValueError, match="both"):
        moe.moe_ffn(x, ids, w, wg, wu, wd, expert_axis="expert")
