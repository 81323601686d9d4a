"""Process-wide settings that entry points apply before JAX starts its first backend.

XLA reads `XLA_FLAGS` once, when the first backend starts, so this module only edits the
environment; the CLI and the benchmarks call `tune_xla_cpu()` before any JAX compute.

The XLA:CPU flag (`tune_xla_cpu`) routes elementwise fusions to YNNPACK and dots to XLA's
default library. It helps the dense float32 train step, whose backward pass otherwise runs
its elementwise work as strided loops fused into transposes; it slows tiled MoE grouped
matmuls and moves bfloat16 dots off YNNPACK's bf16 kernels. So it is set for dense float32
models only. PTRAIN_XLA_CPU_TUNING=0 turns it off; a `ynn_fusion_type` already in
XLA_FLAGS is left alone.

The malloc setting (`reexec_with_malloc_tuning`): XLA:CPU allocates each execution's
temporaries in one large block, which glibc serves with a fresh mmap and unmaps after the
step, so every step page-faults the block in again at 4 KiB a fault.
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35) asks for transparent huge pages on
those blocks instead. glibc reads tunables only at process start, so the process restarts
itself once with the variable set; entry points call this first thing. It does nothing
where transparent huge pages are off (or on for everything), off Linux/glibc, when the user
set a `glibc.malloc.hugetlb` tunable, or with PTRAIN_MALLOC_TUNING=0.

PTRAIN_MALLOC_TUNING=retain also keeps freed blocks in the process (one arena, no mmap, no
trimming), so the next step reuses pages already faulted in: faster CPU steps, at two to
three blocks of peak memory, because XLA frees a step's block only after the next step has
been dispatched. Opt-in, for CPU runs with memory to spare; splitting the batch with
train.grad_accum shrinks the block instead. The measurements behind each choice are in
docs/performance.md ("Page faults", and the SFT step sections).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, MutableMapping

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


def tune_xla_cpu(
    environ: MutableMapping[str, str] = os.environ,
    jaxlib_version: tuple[int, ...] | None = None,
    *,
    compute_dtype: str = "float32",
    moe: bool = False,
) -> list[str]:
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
MALLOC_MODES = {
    "1": "huge pages for large blocks (the default)",
    "retain": "huge pages and keep freed memory",
    "0": "glibc's defaults",
}
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise", "never" or "" if unknown."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


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
    environ: Mapping[str, str] = os.environ,
    *,
    system: str | None = None,
    glibc_version: tuple[int, ...] | None = None,
    thp_mode: str | None = None,
) -> dict[str, str] | None:
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
    if (
        glibc >= (2, 35)
        and "glibc.malloc.hugetlb" not in current
        and (thp_mode if thp_mode is not None else _thp_mode()) == "madvise"
    ):
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
