"""Process-wide settings that entry points apply before JAX starts its first backend.

XLA reads `XLA_FLAGS` once, when the first backend starts, so this module only edits the
environment; the CLI and the benchmarks call `tune_xla_cpu()` before any JAX compute.

Why the CPU flag: on jaxlib 0.10 XLA:CPU sends dots to YNNPACK and leaves elementwise
work to its own loop emitter, which fuses the backward pass's elementwise ops (the SiLU
gradient, the softmax gradient) into the transposes that feed the weight-gradient dots;
those strided loops took 1.4 s of a 10 s train step of the 8-layer benchmark model.
Routing elementwise fusions to YNNPACK and dots to the default library instead measured
8.1-9.1 s against 10.0-10.5 s for the same step, with the same loss to 7 digits
(docs/performance.md). The same flag slows the MoE layer's tiled grouped matmuls (536 ->
654 ms at 16 experts, tools/bench_moe.py) and bfloat16 compute: it moves bfloat16 dots off
YNNPACK's bf16 kernels (a 4096^2 bf16 matmul with float32 output, 338 against 74 GFLOP/s on
an AVX-512-bf16 CPU), and the bfloat16 SFT bench step ran 4.75-4.88 s with it against
4.51-4.54 s without. So it is set for dense float32 models only. Set PTRAIN_XLA_CPU_TUNING=0
to turn it off; a `ynn_fusion_type` already in XLA_FLAGS is left alone.

Why the malloc setting: XLA:CPU allocates each execution's temporary buffers in one block
(308 MB for the 16-expert MoE layer step), which glibc serves with a fresh mmap and
unmaps afterwards, so every step page-faults the whole block in again at 4 KiB a fault:
80,000 faults and 0.22 s of kernel time per 0.5 s step (measured with getrusage). With
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35) malloc asks for transparent huge
pages on those blocks: 2,300 faults a step and the layer alone 15-20% faster (with torch
in the same process it got slower instead; tools/bench_moe.py says more). glibc reads
tunables only at process start, so `reexec_with_malloc_tuning()` restarts the process
once with the variable set; entry points call it first thing. It does nothing where the
kernel has transparent huge pages off or on for everything, off Linux/glibc, when the
user set a `glibc.malloc.hugetlb` tunable, or when PTRAIN_MALLOC_TUNING=0.

PTRAIN_MALLOC_TUNING=retain goes further and keeps the freed block in the process: one
malloc arena (so worker threads' blocks come from the main heap, not from mmap), no mmap,
no trimming. The next step then reuses pages that are already faulted in, which removes
the kernel's zeroing of fresh pages (1.4-2.7 s of kernel CPU per SFT bench step, 9 s per
DPO step): the SFT bench step ran 6.9-7.0 s against 7.9-9.4 s in interleaved pairs, the
DPO step 17.5 against 23.6 s. The price is memory: XLA frees a step's block a few
milliseconds after the step's outputs are ready, so a step dispatched at once cannot reuse
it and the heap settles at two to three blocks (SFT bench peak RSS 12.0 GiB against 4.7,
DPO 23.1 against 8.9; with a 5 ms pause between steps the SFT bench stayed at 4.6 GiB). It
is therefore opt-in, for CPU runs with memory to spare (docs/performance.md, "Page faults").
Splitting the batch with train.grad_accum shrinks the block instead, and then `retain`
gained nothing (2 x 512-token micro-batches: 6.55-6.75 s against 6.14-6.20 s without it).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, MutableMapping, Optional

CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=eltwise",)
# The flag is experimental and XLA aborts the process on an unknown flag, so it is only
# added on the jaxlib releases it was measured on.
TUNED_JAXLIB = ((0, 10, 2), (0, 11, 0))  # [first, end)


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("jaxlib")
    except PackageNotFoundError:
        return ()
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def tune_xla_cpu(environ: MutableMapping[str, str] = os.environ, jaxlib_version: tuple[int, ...] | None = None,
                 *, compute_dtype: str = "float32", moe: bool = False) -> list[str]:
    """Add the CPU flags to `environ["XLA_FLAGS"]` for a model that computes in
    `compute_dtype` (a config dtype name) and is or is not MoE; returns the flags it added.
    The flags are measured to pay only for dense float32 models (module docstring)."""
    if environ.get("PTRAIN_XLA_CPU_TUNING", "1") == "0" or moe or compute_dtype != "float32":
        return []
    current = environ.get("XLA_FLAGS", "")
    if "ynn_fusion_type" in current:
        return []
    v = _jaxlib_version() if jaxlib_version is None else jaxlib_version
    first, end = TUNED_JAXLIB
    if not (first <= v < end):
        return []
    environ["XLA_FLAGS"] = " ".join([current, *CPU_FLAGS]).strip()
    return list(CPU_FLAGS)


MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"
# PTRAIN_MALLOC_TUNING=retain: every thread allocates from the main heap, which never
# shrinks (trim threshold 64 GiB), so a freed step block stays faulted in for the next step.
RETAIN_TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=68719476736")
MALLOC_MODES = {"1": "huge pages for large blocks (the default)", "retain": "huge pages and keep freed memory",
                "0": "glibc's defaults"}
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise", "never" or "" if unknown."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _glibc_version() -> tuple[int, ...]:
    """The running glibc's (major, minor), or () under another libc."""
    try:
        lib, _, text = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):  # no confstr name here: ask the binary instead
        lib, text = platform.libc_ver()
    if lib != "glibc" or not text:
        return ()
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def malloc_tuning_env(
    environ: Mapping[str, str] = os.environ, *, system: Optional[str] = None,
    glibc_version: Optional[tuple[int, ...]] = None, thp_mode: Optional[str] = None,
) -> Optional[dict[str, str]]:
    """The environment to restart with (`environ` plus the malloc tunables), or None when
    restarting would change nothing (see the module docstring for the cases).

    Tunables the user already set are kept as they are, and only the missing ones are
    added, so the restarted process (which has them all) returns None.
    """
    mode = environ.get("PTRAIN_MALLOC_TUNING", "1")
    if mode not in MALLOC_MODES:
        choices = ", ".join(f"{k} ({v})" for k, v in MALLOC_MODES.items())
        raise ValueError(f"PTRAIN_MALLOC_TUNING={mode!r} is not a malloc mode; set it to one of: {choices}")
    if mode == "0" or (system if system is not None else sys.platform) != "linux":
        return None
    glibc = glibc_version if glibc_version is not None else _glibc_version()
    current = environ.get("GLIBC_TUNABLES", "")
    wanted = []
    # "always" already backs these blocks with huge pages; "never" makes the tunable moot.
    if glibc >= (2, 35) and "glibc.malloc.hugetlb" not in current and \
            (thp_mode if thp_mode is not None else _thp_mode()) == "madvise":
        wanted.append(MALLOC_TUNABLE)
    if mode == "retain" and glibc >= (2, 26):  # GLIBC_TUNABLES arrived in 2.26
        wanted += [t for t in RETAIN_TUNABLES if t.partition("=")[0] not in current]
    if not wanted:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (current, *wanted) if t)
    return env


def reexec_with_malloc_tuning() -> None:
    """Restart this process with the same command line and the malloc tunable, if it helps.

    Call it first thing in a process entry point (never from library code): the process
    image is replaced, so nothing done before the call survives.
    """
    try:
        env = malloc_tuning_env()
    except ValueError as e:
        raise SystemExit(f"ptrain: {e}") from None
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:  # could not restart (odd launcher): run on untuned, which is only slower
        return
