"""Shared test setup: strict JAX numerics and a persistent compilation cache.

The cache directory is passed through the environment so that the CLI subprocesses
of the end-to-end tests reuse compiled programs too.
"""

import os
import pathlib

_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The decode paths take the CPU kernels without timing them against XLA first, so that a
# test sees the same path on every machine (tests/kernels/test_cpu_choice.py times them).
os.environ.setdefault("PTRAIN_CPU_KERNELS", "force")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", _CACHE)
