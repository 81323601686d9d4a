"""CPU kernels for the decode step, built from C++ at first use and called through the XLA FFI.

    from ptrain.kernels import cpu
    if cpu.available():
        out_BxHxDh = cpu.decode_attention(q_BxHxDh, k_cache, v_cache, mask_BxS)
    packed = cpu.pack(w_KxN)  # once per weight version
    y_BxN = cpu.dense(x_BxK, packed)  # the matmul kernel; cpu.dense(x, w_KxN) is XLA's dot

XLA:CPU runs single-token attention over a KV cache as many tiny batched matmuls, after
copying the cache's used slots out, and each of the step's dense projections as a dot on
one thread at half of one core's read bandwidth (docs/performance.md, the rollout engine).
`decode.cc` reads each visible key and value once, in place; `matmul.cc` multiplies a few
rows by a weight held in panels (`PackedWeight`), reading it as sequential streams. Both
split their work over XLA's intra-op threads.

The library is compiled with the host's C++ compiler (`$CXX`, else c++ or g++) and
`-march=native` into `$PTRAIN_CACHE_DIR/kernels` (default `~/.cache/ptrain/kernels`), keyed
by the source, the jaxlib headers and the CPU's feature flags, so a shared home directory
never hands one CPU another's binary. Without a compiler, or with PTRAIN_CPU_KERNELS=0,
`available()` is False and callers keep their XLA path. A failed build is logged once with
the compiler's message.

A kernel that builds is not always faster: how it compares with XLA's own path depends on
the CPU (its vector width, its memory). So on first use each kernel is timed against XLA's
path at decode shapes (`choose`), and a caller takes the kernel only where it won
(`use_decode_attention`, `packing_applies`). The choice is stored beside the library, so it
is made once per CPU and build, and printed as one `ptrain: CPU decode kernels ...` line.
PTRAIN_CPU_KERNELS=force takes both kernels without timing (for tests and benchmarks of
the kernels themselves). The matmul kernel's register block is sized at compile time by the
vector width: 16 rows on AVX-512 (16 accumulators of one register each), 6 rows on AVX2 and
NEON, where 16 lanes span two registers. PTRAIN_CPU_KERNEL_ISA=avx2 builds the AVX2 variant
on an AVX-512 machine (for testing it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "decode.cc", HERE / "matmul.cc")
HEADERS = (HERE / "parallel.h",)
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
"""PTRAIN_CPU_KERNEL_ISA: the vector instructions to build for (native: all the CPU has)."""


def _flags() -> tuple[str, ...]:
    isa = os.environ.get("PTRAIN_CPU_KERNEL_ISA", "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"PTRAIN_CPU_KERNEL_ISA={isa!r}: pass one of {', '.join(ISA_FLAGS)}")
    return BASE_FLAGS + ISA_FLAGS[isa]


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
    key.update(" ".join(_flags()).encode())
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
    cmd = [cxx, *_flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _mode() -> str:
    """PTRAIN_CPU_KERNELS: off (0/false/no/off), force, or auto (anything else: timed)."""
    value = os.environ.get("PTRAIN_CPU_KERNELS", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "force" if value == "force" else "auto"


@functools.cache
def available() -> bool:
    """True when the kernels are built (building them now if needed) and registered with XLA."""
    if _mode() == "off":
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
        and choose().attention
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
        and choose().matmul
    )


# ------------------------------------------------------------------ kernel or XLA, per CPU


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which decode paths take the kernels on this CPU, and the timings behind it (ms)."""

    attention: bool
    matmul: bool
    timings_ms: dict
    """{"attention": {"kernel": t, "xla": t}, "matmul": {...}}; empty when forced."""
    source: str
    """measured (now), cached (read from the file beside the library) or forced."""

    def describe(self) -> str:
        parts = []
        for name, label in (("attention", "attention"), ("matmul", "projections")):
            use = getattr(self, name)
            t = self.timings_ms.get(name)
            times = f" {t['kernel']:.3f} ms vs XLA {t['xla']:.3f} ms" if t else ""
            parts.append(f"{label}{times} -> {'kernel' if use else 'XLA'}")
        return f"ptrain: CPU decode kernels ({self.source}): " + "; ".join(parts)


def choice_path() -> Path:
    return library_path().with_suffix(".choice.json")


@functools.cache
def choose() -> KernelChoice:
    """Kernel or XLA for each decode path on this CPU (call only when `available()`): read
    from the file beside the library, else timed now and stored there. Printed once."""
    if _mode() == "force":
        choice = KernelChoice(True, True, {}, "forced")
    else:
        path = choice_path()
        try:
            stored = json.loads(path.read_text())
            choice = KernelChoice(bool(stored["attention"]), bool(stored["matmul"]), stored["timings_ms"], "cached")
        except (OSError, ValueError, KeyError, TypeError):
            timings = measure()
            choice = KernelChoice(
                attention=timings["attention"]["kernel"] < timings["attention"]["xla"],
                matmul=timings["matmul"]["kernel"] < timings["matmul"]["xla"],
                timings_ms=timings,
                source="measured",
            )
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"attention": choice.attention, "matmul": choice.matmul, "timings_ms": timings}, f)
            os.replace(tmp, path)
    print(choice.describe(), flush=True)
    return choice


def measure(rounds: int = 5, reps: int = 8) -> dict:
    """Median time (ms) of each kernel and of XLA's path for the same work, at shapes of a
    decode step (16 rows; a 1024-wide model's fused projections; 512 cached slots, 256 of
    them visible), interleaved in rounds so that a noisy neighbour hits both alike."""
    with jax.ensure_compile_time_eval():  # concrete work even when first asked inside a trace
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((16, 1024)), jnp.float32)
        ws = [jnp.asarray(rng.standard_normal((1024, n)) * 0.02, jnp.float32) for n in (3072, 1024)]
        packed = [pack(w) for w in ws]
        mm_kernel = jax.jit(lambda x, a, b: packed_dense(packed_dense(x, a)[:, :1024], b))
        mm_xla = jax.jit(lambda x, a, b: (x @ a)[:, :1024] @ b)
        B, H, K, S, Dh = 16, 16, 4, 512, 64
        q = jnp.asarray(rng.standard_normal((B, H, Dh)), jnp.float32)
        kc = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
        vc = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
        mask = jnp.asarray(np.arange(S)[None, :] < 256).repeat(B, axis=0)
        at_kernel = jax.jit(decode_attention)
        at_xla = jax.jit(decode_attention_reference)
        cases = {
            "matmul": {"kernel": (mm_kernel, (x, *packed)), "xla": (mm_xla, (x, *ws))},
            "attention": {"kernel": (at_kernel, (q, kc, vc, mask)), "xla": (at_xla, (q, kc, vc, mask))},
        }
        samples: dict = {name: {path: [] for path in paths} for name, paths in cases.items()}
        for paths in cases.values():
            for fn, args in paths.values():
                jax.block_until_ready(fn(*args))  # compile and warm
        for _ in range(rounds):
            for name, paths in cases.items():
                for path, (fn, args) in paths.items():
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(*args))
                        samples[name][path].append(time.perf_counter() - t0)
    return {
        name: {p: round(float(np.median(ts)) * 1e3, 4) for p, ts in paths.items()} for name, paths in samples.items()
    }
