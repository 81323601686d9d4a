"""The price table behind the cost accounting of sampling stages (`cost`). Jax-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostConfig:
    """Prices behind the per-step cost accounting (dollars); the defaults are placeholders
    a user sets to their own contract (0 turns an item off)."""

    accelerator_hour_usd: float = 0.0
    """Price of one accelerator-hour; times the stage's wall time and device count."""
    input_uncached_per_mtok_usd: float = 0.0
    """Per million prompt tokens the engine computed."""
    input_cached_per_mtok_usd: float = 0.0
    """Per million prompt tokens served from the prefix cache."""
    output_per_mtok_usd: float = 0.0
    """Per million generated tokens."""
