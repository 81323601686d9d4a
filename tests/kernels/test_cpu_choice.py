"""Kernel or XLA per CPU: each decode kernel is timed against XLA's path once, the choice is
stored beside the library and printed; a stored XLA choice keeps the callers on XLA; the AVX2
build (6-row register blocks, 8-lane vectors) computes what the AVX-512 one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from ptrain.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler on this machine")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )


CHOOSE = "from ptrain.kernels import cpu; assert cpu.available(); c = cpu.choose(); print(cpu.choice_path())"


def test_the_choice_is_timed_once_stored_and_printed(tmp_path):
    first = _python(CHOOSE, PTRAIN_CACHE_DIR=str(tmp_path), PTRAIN_CPU_KERNELS="1")
    assert first.returncode == 0, first.stderr
    line, path = first.stdout.strip().splitlines()[-2:]
    assert line.startswith("ptrain: CPU decode kernels (measured): attention ") and "projections" in line
    stored = json.load(open(path))
    for name in ("attention", "matmul"):
        t = stored["timings_ms"][name]
        assert t["kernel"] > 0 and t["xla"] > 0
        assert stored[name] == (t["kernel"] < t["xla"])
    second = _python(CHOOSE, PTRAIN_CACHE_DIR=str(tmp_path), PTRAIN_CPU_KERNELS="1")
    assert "CPU decode kernels (cached)" in second.stdout, second.stderr


def test_a_stored_xla_choice_keeps_the_decode_paths_on_xla(tmp_path):
    code = (
        "import json, jax.numpy as jnp\n"
        "from ptrain.kernels import cpu\n"
        "assert cpu.available()\n"
        "json.dump({'attention': False, 'matmul': False, 'timings_ms': {}}, open(cpu.choice_path(), 'w'))\n"
        "q, cache, mask = jnp.zeros((2, 1, 4, 64)), jnp.zeros((2, 2, 16, 64)), jnp.ones((2, 1, 16), bool)\n"
        "print(cpu.use_decode_attention(q, cache, mask), cpu.packing_applies({'w': jnp.zeros((4, 4))}))\n"
    )
    proc = _python(code, PTRAIN_CACHE_DIR=str(tmp_path), PTRAIN_CPU_KERNELS="1")
    assert proc.returncode == 0, proc.stderr
    assert "-> XLA; projections -> XLA" in proc.stdout and proc.stdout.strip().endswith("False False")
    forced = _python(code, PTRAIN_CACHE_DIR=str(tmp_path), PTRAIN_CPU_KERNELS="force")
    assert "(forced)" in forced.stdout and forced.stdout.strip().endswith("True True"), forced.stderr


def test_the_avx2_build_computes_what_the_reference_does(tmp_path):
    code = (
        "import numpy as np, jax.numpy as jnp\n"
        "from ptrain.kernels import cpu\n"
        "assert cpu.available()\n"
        "r = np.random.default_rng(0)\n"
        "for M in (1, 5, 6, 7, 13, 16, 17, 33):\n"
        "    for K, N in ((64, 40), (96, 16), (33, 100)):\n"
        "        x = jnp.asarray(r.normal(size=(M, K)), jnp.float32)\n"
        "        w = jnp.asarray(r.normal(size=(K, N)), jnp.float32)\n"
        "        np.testing.assert_allclose(cpu.packed_dense(x, cpu.pack(w)), x @ w, rtol=2e-5, atol=2e-5)\n"
        "for Dh in (64, 80, 12):\n"
        "    q = jnp.asarray(r.normal(size=(3, 8, Dh)), jnp.float32)\n"
        "    k = jnp.asarray(r.normal(size=(4, 2, 40, Dh)), jnp.float32)\n"
        "    v = jnp.asarray(r.normal(size=(4, 2, 40, Dh)), jnp.float32)\n"
        "    mask = jnp.asarray(np.arange(37)[None, :] < np.array([[5], [37], [20]]))\n"
        "    np.testing.assert_allclose(cpu.decode_attention(q, k, v, mask),\n"
        "                               cpu.decode_attention_reference(q, k, v, mask), rtol=2e-5, atol=2e-5)\n"
        "print('ok', cpu.library_path())\n"
    )
    proc = _python(code, PTRAIN_CACHE_DIR=str(tmp_path), PTRAIN_CPU_KERNEL_ISA="avx2", PTRAIN_CPU_KERNELS="force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")
    native = _python("from ptrain.kernels import cpu; print(cpu.library_path())", PTRAIN_CACHE_DIR=str(tmp_path))
    assert native.stdout.strip() != proc.stdout.strip().split()[-1]  # the ISA is part of the library's key


def test_an_unknown_isa_is_refused_and_the_xla_path_kept(tmp_path):
    proc = _python("from ptrain.kernels import cpu; print(cpu.available())", PTRAIN_CACHE_DIR=str(tmp_path),
                   PTRAIN_CPU_KERNEL_ISA="sse9")  # fmt: skip
    assert proc.stdout.strip() == "False"
    assert "PTRAIN_CPU_KERNEL_ISA='sse9': pass one of native, avx2" in proc.stderr


def test_forced_in_this_test_session():
    assert os.environ["PTRAIN_CPU_KERNELS"] == "force"
    assert cpu.use_decode_attention(jnp.zeros((2, 1, 4, 64)), jnp.zeros((2, 2, 16, 64)), jnp.ones((2, 1, 16), bool))
