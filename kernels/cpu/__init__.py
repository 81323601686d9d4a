"""CPU kernels for the decode step, built from C++ at first use and called through the XLA FFI.

    from ptrain.kernels import cpu
    if cpu.available():
        out_BxHxDh = cpu.decode_attention(q_BxHxDh, k_cache, v_cache, mask_BxS)
    packed = cpu.pack(w_KxN)  # once per weight version
    y_BxN = cpu.dense(x_BxK, packed)  # the matmul kernel; cpu.dense(x, w_KxN) is XLA's dot

XLA:CPU runs single-token attention over a KV cache as many tiny batched matmuls, after
copying the cache's used slots out, and each of the step's dense projections as a dot on
one thread at half of one core's read bandwidth (docs/performance.md, issue 15).
`decode.cc` reads each visible key and value once, in place; `matmul.cc` multiplies a few
rows by a weight held in panels (`PackedWeight`), reading it as sequential streams. Both
split their work over XLA's intra-op threads.

The library is compiled with the host's C++ compiler (`$CXX`, else c++ or g++) and
`-march=native` into `$PTRAIN_CACHE_DIR/kernels` (default `~/.cache/ptrain/kernels`), keyed
by the source, the jaxlib headers and the CPU's feature flags, so a shared home directory
never hands one CPU another's binary. Without a compiler, or with PTRAIN_CPU_KERNELS=0,
`available()` is False and callers keep their XLA path. A failed build is logged once with
the compiler's message.
"""

from __future__ import annotations

import ctypes
import dataclasses
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

HERE = Path(__file__).parent
SOURCES = (HERE / "decode.cc", HERE / "matmul.cc")
HEADERS = (HERE / "parallel.h",)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = ("ptrain_decode_attention", "ptrain_packed_matmul")
MAX_GROUP = 64
"""Most query heads per kv head the attention kernel takes (decode.cc checks the same bound)."""


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
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(jax.ffi.include_dir().encode())
    key.update(jax.__version__.encode())
    key.update(_cpu_signature().encode())
    root = Path(os.environ.get("PTRAIN_CACHE_DIR") or Path.home() / ".cache" / "ptrain") / "kernels"
    return root / f"libptrain_cpu_{key.hexdigest()[:16]}.so"


def build(out: Path) -> None:
    """Compile the sources into one library at `out` (atomically: concurrent builds each
    write a temporary file and rename it). Raises RuntimeError with the compiler's message
    on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
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
        for target in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("ptrain CPU decode kernels unavailable, using XLA's attention and dots instead: %s", e)
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
    return jax.ffi.ffi_call(TARGETS[0], jax.ShapeDtypeStruct((B, H, Dh), jnp.float32), vmap_method="sequential")(
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


PANEL = 16
"""Columns per panel of a packed weight (matmul.cc's register block width)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A float32 weight [K, N] in the matmul kernel's layout: panels [..., ceil(N / 16), K, 16],
    panel p holding columns [16 p, 16 p + 16) (zeros past N) row after row, so a thread reads
    its panels as one stream. Leading axes stack layers (a scanned model).

    `parts` (static, summing to n) marks several weights of one input fused along N, read by
    one kernel call: `split` cuts the product back into them. A model's decode step takes
    these in place of its dense weights (`pack`, `pack_fused`). Indexing with `[...]` returns
    the weight itself, as it does for an nnx.Param's array."""

    panels: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    parts: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("a PackedWeight is read whole: w[...]")
        return self

    @property
    def k(self) -> int:
        return self.panels.shape[-2]

    def split(self, y):
        """The product y [..., n] cut into the fused weights' outputs, one per part."""
        return jnp.split(y, np.cumsum(self.parts)[:-1].tolist(), axis=-1)


@jax.jit
def pack(w_KxN) -> PackedWeight:
    """w [..., K, N] float32 -> PackedWeight. Run once per weight version, outside the step."""
    K, N = w_KxN.shape[-2:]
    P = -(-N // PANEL)
    w = jnp.pad(jnp.asarray(w_KxN, jnp.float32), [(0, 0)] * (w_KxN.ndim - 1) + [(0, P * PANEL - N)])
    panels = jnp.moveaxis(w.reshape(*w.shape[:-1], P, PANEL), -2, -3)
    return PackedWeight(panels, int(N))


@jax.jit
def pack_fused(*ws_KxN) -> PackedWeight:
    """Weights [..., K, N_i] of the same input as one PackedWeight with parts (N_1, N_2, ...)."""
    fused = pack(jnp.concatenate([jnp.asarray(w, jnp.float32) for w in ws_KxN], axis=-1))
    return dataclasses.replace(fused, parts=tuple(int(w.shape[-1]) for w in ws_KxN))


def unpack(w: PackedWeight):
    """The [..., K, N] weight back from its panels."""
    panels = jnp.moveaxis(w.panels, -3, -2)
    return panels.reshape(*panels.shape[:-2], -1)[..., : w.n]


def packed_dense(x, w: PackedWeight):
    """x [..., K] float32 @ the packed weight -> [..., N], by the kernel (call only when
    `available()`, on CPU). Not differentiable: packed weights serve inference steps."""
    if x.shape[-1] != w.k or w.panels.ndim != 3:
        raise ValueError(f"packed_dense: x {x.shape} against a packed [{w.k}, {w.n}] weight")
    x2 = x.reshape(int(np.prod(x.shape[:-1])), w.k).astype(jnp.float32)
    out = jax.ffi.ffi_call(TARGETS[1], jax.ShapeDtypeStruct((x2.shape[0], w.n), jnp.float32), vmap_method="sequential")(
        x2, w.panels
    )
    return out.reshape(*x.shape[:-1], w.n)


def dense(x, w):
    """x [..., K] @ w: a [K, N] array by XLA, a PackedWeight by the kernel."""
    if isinstance(w, PackedWeight):
        return packed_dense(x, w)
    return x @ w


def packing_applies(params) -> bool:
    """Whether a decode step should take packed weights: float32 params, each on one CPU
    device (not sharded over a mesh), and the kernels built."""
    leaves = jax.tree.leaves(params)
    return (
        bool(leaves)
        and all(x.dtype == jnp.float32 for x in leaves)
        and all(len(x.sharding.device_set) == 1 for x in leaves if isinstance(x, jax.Array))
        and jax.default_backend() == "cpu"
        and available()
    )
