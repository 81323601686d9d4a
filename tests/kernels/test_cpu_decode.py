"""The CPU decode-attention kernel (ptrain.kernels.cpu) against its jnp reference, and its
build: cached by source and CPU, off by PTRAIN_CPU_KERNELS=0, a clear log line and the XLA
path when no compiler works."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptrain.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler on this machine")


def _case(seed, B, R, K, G, Dh, S, S_max, holes=False, empty_row=None):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, K * G, Dh)), jnp.float32)
    k = jnp.asarray(r.normal(size=(R, K, S_max, Dh)), jnp.float32)
    v = jnp.asarray(r.normal(size=(R, K, S_max, Dh)), jnp.float32)
    lengths = r.integers(1, S + 1, B)
    mask = np.arange(S)[None, :] < lengths[:, None]
    if holes:  # a sliding window, or left padding: visible slots need not start at 0
        mask &= r.random((B, S)) < 0.7
        mask[:, 0] = True
    if empty_row is not None:
        mask[empty_row] = False
    return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize(
    "B,R,K,G,Dh,S,S_max,holes",
    [
        (4, 4, 2, 2, 64, 48, 48, False),  # the engine's shape family: GQA, head_dim 64
        (3, 8, 1, 4, 32, 20, 64, True),  # fewer rows than cache rows, S < S_max, holes in the mask
        (2, 2, 3, 1, 80, 33, 40, False),  # head_dim not a multiple of 16, multi-head (G = 1)
        (5, 6, 2, 8, 16, 130, 160, True),
    ],
)
def test_decode_attention_matches_the_reference(B, R, K, G, Dh, S, S_max, holes):
    q, k, v, mask = _case(0, B, R, K, G, Dh, S, S_max, holes)
    got = jax.jit(cpu.decode_attention)(q, k, v, mask)
    want = cpu.decode_attention_reference(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)


def test_a_row_with_no_visible_slot_gets_zeros():
    q, k, v, mask = _case(1, 3, 3, 2, 2, 64, 16, 16, empty_row=1)
    got = np.asarray(jax.jit(cpu.decode_attention)(q, k, v, mask))
    assert np.all(got[1] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np.asarray(cpu.decode_attention_reference(q, k, v, mask)), atol=2e-6)


def test_large_scores_do_not_overflow():
    q, k, v, mask = _case(2, 2, 2, 1, 2, 64, 24, 24)
    q = q * 300.0  # scores of order 1e3: the softmax must subtract its maximum
    got = np.asarray(jax.jit(cpu.decode_attention)(q, k, v, mask))
    np.testing.assert_allclose(got, np.asarray(cpu.decode_attention_reference(q, k, v, mask)), atol=1e-5)


def test_the_gradient_is_the_references():
    q, k, v, mask = _case(3, 2, 2, 2, 2, 32, 12, 12)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, mask)))

    got = jax.grad(lambda *a: loss(cpu.decode_attention, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(cpu.decode_attention_reference, *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_the_model_uses_the_kernel_only_for_float32_single_token_steps():
    q1 = jnp.zeros((2, 1, 4, 64), jnp.float32)
    cache = jnp.zeros((2, 2, 16, 64), jnp.float32)
    mask1 = jnp.ones((2, 1, 16), bool)
    assert cpu.use_decode_attention(q1, cache, mask1)
    assert not cpu.use_decode_attention(jnp.zeros((2, 3, 4, 64)), cache, jnp.ones((2, 3, 16), bool))  # prefill
    assert not cpu.use_decode_attention(q1.astype(jnp.bfloat16), cache.astype(jnp.bfloat16), mask1)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def test_switched_off_by_the_environment():
    proc = _python("from ptrain.kernels import cpu; print(cpu.available())", PTRAIN_CPU_KERNELS="0")
    assert proc.stdout.strip() == "False", proc.stderr


def test_a_failed_build_logs_the_reason_and_falls_back(tmp_path):
    proc = _python(
        "from ptrain.kernels import cpu; print(cpu.available())", CXX="/bin/false", PATH="/nonexistent",
        PTRAIN_CACHE_DIR=str(tmp_path),
    )  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stderr
    assert "CPU decode kernels unavailable" in proc.stderr and "XLA" in proc.stderr
    assert not list((tmp_path / "kernels").glob("*.so")), "a failed build must not leave a library behind"


def test_the_library_is_cached_by_source_and_cpu(tmp_path):
    code = "from ptrain.kernels import cpu; print(cpu.available(), cpu.library_path())"
    first = _python(code, PTRAIN_CACHE_DIR=str(tmp_path))
    second = _python(code, PTRAIN_CACHE_DIR=str(tmp_path))
    assert first.stdout.split()[0] == "True", first.stderr
    assert first.stdout == second.stdout
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
