"""grouped_matmul / permute / combine / moe_ffn against kernels/moe/reference.py.

Shapes are fixed per module (one compile per implementation and dtype); hypothesis
varies the group sizes, which are traced values, so examples reuse the compiled code.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from ptrain.kernels import moe
from ptrain.kernels.moe import reference

from .moe_gmm_checks import CASES, GROUP_SIZES, TOL, G, _operands, check_gmm

# "xla" and "ragged_dot" here; the Pallas kernels have their own module (interpret mode).
IMPLS = ["xla", "ragged_dot"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", CASES)
def test_grouped_matmul_cases(impl, dtype, sizes):
    check_gmm(impl, dtype, sizes)


@pytest.mark.parametrize("tiling", [None, (8, 16, 24)])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=GROUP_SIZES)
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


@pytest.mark.parametrize("n_keys", [5, 2**30])  # packed single-key sort; argsort when the key would overflow
def test_stable_argsort_of_expert_ids_matches_numpy(n_keys):
    from ptrain.kernels.moe.ops import _stable_argsort_small_keys

    keys = np.random.default_rng(0).integers(0, 5, 200).astype(np.int32)  # many ties: stability matters
    got = np.asarray(_stable_argsort_small_keys(jnp.asarray(keys), n_keys))
    np.testing.assert_array_equal(got, np.argsort(keys, kind="stable"))


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


def test_xla_path_large_groups_use_three_tile_sizes():
    # Mean group of 1050 rows: tiles of 512, then 128, then 32 rows (xla.pick_tiles).
    from ptrain.kernels.moe import xla

    M2, G2 = 2100, 2
    assert xla.pick_tiles(M2, G2, None) == (512, 128, 32)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
    lhs = jax.random.normal(k1, (M2, 16))
    rhs = jax.random.normal(k2, (G2, 16, 8))
    cot = jax.random.normal(k3, (M2, 8))
    gs = jnp.array([1500, 587], jnp.int32)  # 13 rows past the groups

    def f(fn, lhs, rhs):
        return jnp.sum(fn(lhs, rhs, gs) * cot)

    got = jax.jit(
        jax.grad(functools.partial(f, functools.partial(moe.grouped_matmul, implementation="xla")), argnums=(0, 1))
    )(lhs, rhs)
    want = jax.grad(functools.partial(f, reference.grouped_matmul), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)
    out = moe.grouped_matmul(lhs, rhs, gs, implementation="xla")
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(reference.grouped_matmul(lhs, rhs, gs)), rtol=2e-5, atol=2e-5
    )
    assert not np.any(np.asarray(out)[2087:])


def test_out_of_range_expert_ids_contribute_nothing(ffn_inputs):
    x, ids, w, wg, wu, wd = ffn_inputs
    bad = ids.at[0, 0].set(-1).at[1, 1].set(E)
    y = moe.moe_ffn(x, bad, w, wg, wu, wd, implementation="xla")
    w_ok = w.at[0, 0].set(0.0).at[1, 1].set(0.0)
    y_ref = reference.moe_ffn(x, jnp.clip(bad, 0, E - 1), w_ok, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    _, gs, _ = moe.permute(x, bad, E)
    assert int(gs.sum()) == T * TOPK - 2
