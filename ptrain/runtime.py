"""Process-wide XLA settings that entry points apply before JAX starts its first backend.

XLA reads `XLA_FLAGS` once, when the first backend starts, so this module only edits the
environment; the CLI and the benchmarks call `tune_xla_cpu()` before any JAX compute.

Why the CPU flag: on jaxlib 0.10 XLA:CPU sends dots to YNNPACK and leaves elementwise
work to its own loop emitter, which fuses the backward pass's elementwise ops (the SiLU
gradient, the softmax gradient) into the transposes that feed the weight-gradient dots;
those strided loops took 1.4 s of a 10 s train step of the 8-layer benchmark model.
Routing elementwise fusions to YNNPACK and dots to the default library instead measured
8.1-9.1 s against 10.0-10.5 s for the same step, with the same loss to 7 digits
(docs/performance.md). The same flag slows the MoE layer's tiled grouped matmuls (536 ->
654 ms at 16 experts, tools/bench_moe.py), so the CLI sets it for dense models only. Set
PTRAIN_XLA_CPU_TUNING=0 to turn it off; a `ynn_fusion_type` already in XLA_FLAGS is left
alone.
"""

from __future__ import annotations

import os
from typing import MutableMapping

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


def tune_xla_cpu(environ: MutableMapping[str, str] = os.environ, jaxlib_version: tuple[int, ...] | None = None) -> list[str]:
    """Add the CPU flags to `environ["XLA_FLAGS"]`; returns the flags it added."""
    if environ.get("PTRAIN_XLA_CPU_TUNING", "1") == "0":
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
