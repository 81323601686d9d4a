"""The price table behind the cost accounting of sampling stages (`cost`). Jax-free.

The defaults are public on-demand list prices, so that every run's cost and reward per
dollar are real numbers out of the box; a user's own contract replaces them
(`cost.cpu_core_hour_usd=...`, `cost.accelerator_hour_usd=...`, or 0 to turn an item off):

  CPU          AWS EC2 c7a.large (2 vCPU, AMD EPYC Zen 4), Linux on-demand, us-east-1:
               $0.1026 an hour, i.e. $0.0513 per vCPU-hour (AWS's price list, read 2026-12).
  accelerator  an NVIDIA H100 80GB on AWS EC2 P5, on-demand, after AWS's June 2025 price cut:
               about $3.90 per GPU-hour (costnimbus.com, "GPU cost management for ML teams",
               March 2026); other accelerators differ, so set yours.

The token prices (per million prompt or generated tokens) are for an engine billed by the
token (a hosted API); they default to 0 since a self-hosted engine's tokens are already
paid for by the machine hour.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_CORE_HOUR_USD = 0.0513
"""AWS c7a.large on-demand ($0.1026/h, us-east-1) per vCPU, read 2026-12."""
ACCELERATOR_HOUR_USD = 3.90
"""One H100 on AWS P5 on-demand, per GPU-hour (March 2026)."""


@dataclass
class CostConfig:
    """Prices behind the per-step cost accounting (dollars); module docstring for the sources."""

    cpu_core_hour_usd: float = CPU_CORE_HOUR_USD
    """Price of one CPU core-hour; times the cores the process may use and the wall time,
    when JAX runs on the CPU."""
    accelerator_hour_usd: float = ACCELERATOR_HOUR_USD
    """Price of one accelerator-hour (a GPU or TPU chip); times the stage's wall time and
    device count, when JAX runs on accelerators."""
    input_uncached_per_mtok_usd: float = 0.0
    """Per million prompt tokens the engine computed."""
    input_cached_per_mtok_usd: float = 0.0
    """Per million prompt tokens served from the prefix cache."""
    output_per_mtok_usd: float = 0.0
    """Per million generated tokens."""

    def machine_hour_usd(self, platform: str, devices: int, cpu_cores: int) -> float:
        """What one wall-clock hour of this process's machine costs: its CPU cores on the
        cpu platform, else its accelerators."""
        if platform == "cpu":
            return self.cpu_core_hour_usd * max(cpu_cores, 1)
        return self.accelerator_hour_usd * max(devices, 1)

    def tokens_usd(self, prompt_uncached: float, prompt_cached: float, output: float) -> float:
        """The per-token part of a cost (0 with the default prices)."""
        return (
            prompt_uncached * self.input_uncached_per_mtok_usd
            + prompt_cached * self.input_cached_per_mtok_usd
            + output * self.output_per_mtok_usd
        ) / 1e6


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
