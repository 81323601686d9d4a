"""CPU kernels for the decode step, built from C++ at first use and called through the XLA FFI.

    from ptrain.kernels import cpu
    if cpu.available():
        out_BxHxDh = cpu.decode_attention(q_BxHxDh, k_cache, v_cache, mask_BxS)

XLA:CPU runs single-token attention over a KV cache as many tiny batched matmuls, after
copying the cache's used slots out: about half of a small model's decode step
(docs/performance.md, issue 15). `decode.cc` reads each visible key and value once, in
place, split over XLA's intra-op threads.

The library is compiled with the host's C++ compiler (`$CXX`, else c++ or g++) and
`-march=native` into `$PTRAIN_CACHE_DIR/kernels` (default `~/.cache/ptrain/kernels`), keyed
by the source, the jaxlib headers and the CPU's feature flags, so a shared home directory
never hands one CPU another's binary. Without a compiler, or with PTRAIN_CPU_KERNELS=0,
`available()` is False and callers keep their XLA path. A failed build is logged once with
the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cc")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
TARGET = "ptrain_decode_attention"
MAX_GROUP = 64
"""Most query heads per kv head the kernel takes (decode.cc checks the same bound)."""


def _cpu_signature() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def library_path() -> Path:
    """Where the compiled library for this source, jaxlib and CPU lives (or will)."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(jax.ffi.include_dir().encode())
    key.update(jax.__version__.encode())
    key.update(_cpu_signature().encode())
    root = Path(os.environ.get("PTRAIN_CACHE_DIR") or Path.home() / ".cache" / "ptrain") / "kernels"
    return root / f"libptrain_cpu_{key.hexdigest()[:16]}.so"


def build(out: Path) -> None:
    """Compile decode.cc into `out` (atomically: concurrent builds each write a temporary file
    and rename it). Raises RuntimeError with the compiler's message on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """True when the kernels are built (building them now if needed) and registered with XLA."""
    if os.environ.get("PTRAIN_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        path = library_path()
        if not path.exists():
            build(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, TARGET)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("ptrain CPU decode kernels unavailable, using XLA's attention instead: %s", e)
        return False
    return True


def decode_attention_reference(q_BxHxDh, k_cache, v_cache, mask_BxS):
    """What `decode_attention` computes, in jnp: per row b and query head h, the softmax over
    the visible slots s < S (mask_BxS) of q . k / sqrt(Dh), times the values; the cache rows
    are [0, B) of caches [R, K, S_max, Dh]. A row with no visible slot gets zeros."""
    B, H, Dh = q_BxHxDh.shape
    K, S = k_cache.shape[1], mask_BxS.shape[1]
    q = q_BxHxDh.reshape(B, K, H // K, Dh)
    k, v = k_cache[:B, :, :S], v_cache[:B, :, :S]
    s = jnp.einsum("bkgd,bksd->bkgs", q, k) / np.float32(np.sqrt(Dh))
    s = jnp.where(mask_BxS[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask_BxS[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksd->bkgd", p / jnp.where(total > 0, total, 1.0), v)
    return out.reshape(B, H, Dh)


@jax.custom_vjp
def decode_attention(q_BxHxDh, k_cache, v_cache, mask_BxS):
    """Single-token attention against a head-major KV cache, float32 (see the module
    docstring and `decode_attention_reference`). Call only when `available()`. Its gradient is
    the reference's, so a differentiated caller stays correct."""
    B, H, Dh = q_BxHxDh.shape
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, H, Dh), jnp.float32), vmap_method="sequential")(
        q_BxHxDh, k_cache, v_cache, mask_BxS, scale=np.float32(1.0 / np.sqrt(Dh))
    )


def _fwd(q, k, v, mask):
    return decode_attention(q, k, v, mask), (q, k, v, mask)


def _bwd(res, g):
    q, k, v, mask = res
    _, vjp = jax.vjp(lambda q, k, v: decode_attention_reference(q, k, v, mask), q, k, v)
    return (*vjp(g), None)


decode_attention.defvjp(_fwd, _bwd)


def use_decode_attention(q_BxTxHxDh, k_cache, mask_BxTxS) -> bool:
    """Whether `decode_attention` serves this call: one query token, float32 throughout,
    CPU, and the kernels built."""
    return (
        q_BxTxHxDh.shape[1] == 1
        and q_BxTxHxDh.dtype == jnp.float32
        and k_cache.dtype == jnp.float32
        and mask_BxTxS.dtype == jnp.bool_
        and q_BxTxHxDh.shape[2] // k_cache.shape[1] <= MAX_GROUP
        and jax.default_backend() == "cpu"
        and available()
    )
