"""Pallas kernels (TPU Mosaic and GPU Triton) in interpret mode on CPU, against the reference.

The TPU variant runs under `pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")`:
rows a kernel forgets to write come back as NaN and fail the comparison. Lowering to the
real backends (Mosaic for TPU, Triton for CUDA) is checked too: it runs the Pallas
lowering rules on CPU without a device (layout and VMEM limits still need the chip).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from ptrain.kernels import moe
from ptrain.kernels.moe import pallas_gpu, pallas_tpu, reference

from .moe_gmm_checks import CASES, GROUP_SIZES, _operands, check_gmm

# Small tiles so that the 40x32x24 problem spans several row, k and n tiles (few grid steps).
TILINGS = {"pallas_tpu_interpret": (8, 16, 24), "pallas_gpu_interpret": (16, 16, 16)}


@pytest.mark.parametrize("impl", list(TILINGS))
@pytest.mark.parametrize("sizes", CASES)
def test_pallas_cases_float32(impl, sizes):
    check_gmm(impl, jnp.float32, sizes, TILINGS[impl])


# bfloat16 changes only the dtypes inside the same index arithmetic: two cases suffice here
# (ragged with empty groups, everything in one group); the rest run with -m slow.
@pytest.mark.parametrize("impl", list(TILINGS))
@pytest.mark.parametrize("sizes", [CASES[1], CASES[2]])
def test_pallas_cases_bfloat16(impl, sizes):
    check_gmm(impl, jnp.bfloat16, sizes, TILINGS[impl])


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(TILINGS))
@pytest.mark.parametrize("sizes", [c for i, c in enumerate(CASES) if i not in (1, 2)])
def test_pallas_cases_bfloat16_rest(impl, sizes):
    check_gmm(impl, jnp.bfloat16, sizes, TILINGS[impl])


@pytest.mark.parametrize("impl", list(TILINGS))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=GROUP_SIZES)
def test_pallas_hypothesis(sizes, impl):
    check_gmm(impl, jnp.float32, sizes, TILINGS[impl])


def test_pallas_default_tiling_single_tile():
    # Default (large) tiles clip to the problem: one tile holding every group.
    check_gmm("pallas_tpu_interpret", jnp.float32, [3, 0, 17, 0, 20])


@pytest.mark.parametrize("platform, module", [("tpu", pallas_tpu), ("cuda", pallas_gpu)])
def test_kernels_lower_for_the_real_backend(platform, module):
    M, K, N, G = 1024, 256, 512, 8
    lhs = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16)
    dout = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((G,), jnp.int32)
    for fn, args in (
        (module.gmm, (lhs, rhs, gs)),
        (lambda a, b, c: module.gmm(a, b, c, transpose_rhs=True), (dout, rhs, gs)),
        (module.tgmm, (lhs, dout, gs)),
    ):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "ptrain_" in text or "custom_call" in text


@pytest.mark.parametrize("impl", list(TILINGS))
def test_moe_ffn_with_pallas_kernels(impl):
    T, D, F, E, k = 16, 32, 16, 4, 2
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(ks[0], (T, D))
    r = moe.route(jax.random.normal(ks[1], (T, E)), top_k=k)
    ws = (
        jax.random.normal(ks[2], (E, D, F)) / 4,
        jax.random.normal(ks[3], (E, D, F)) / 4,
        jax.random.normal(ks[4], (E, F, D)) / 4,
    )

    def loss(fn, x, *w):
        return jnp.sum(fn(x, r.expert_ids_Txk, r.weights_Txk, *w) ** 2)

    got = jax.jit(
        jax.value_and_grad(
            lambda *a: loss(functools.partial(moe.moe_ffn, implementation=impl), *a), argnums=(0, 1, 2, 3)
        )
    )(x, *ws)
    want = jax.value_and_grad(lambda *a: loss(reference.moe_ffn, *a), argnums=(0, 1, 2, 3))(x, *ws)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_tpu_kernels_have_no_races(capfd):
    # Three n tiles (and three k tiles for tgmm) on the "parallel" grid axes, split over two
    # simulated cores; the detector prints "RACE DETECTED" for any unordered read/write pair.
    from jax.experimental.pallas import tpu as pltpu

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=2)
    lhs, rhs, cot = _operands(jnp.float32)
    lhs = lhs[:, :24]
    rhs = rhs[:, :24]
    gs = jnp.asarray(CASES[1], jnp.int32)
    out = pallas_tpu.gmm(lhs, rhs, gs, tiling=(8, 8, 8), interpret=params)
    drhs = pallas_tpu.tgmm(lhs, cot, gs, tiling=(8, 8, 8), interpret=params)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(reference.grouped_matmul(lhs, rhs, gs)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(drhs), np.asarray(reference.transposed_grouped_matmul(lhs, cot, gs)), rtol=1e-5, atol=1e-5
    )
    assert "RACE DETECTED" not in capfd.readouterr().out
