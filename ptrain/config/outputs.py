"""What a stage writes besides its export: metric sinks (`logging/`) and checkpoints (`checkpoint/`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Write train metrics every N steps (JSONL/TensorBoard/console)."""
    console: bool = True
    """Rich progress bar with step, loss, tokens/s and ETA."""
    jsonl: bool = True
    """metrics.jsonl in the stage folder: every metric of every logged step."""
    tensorboard: bool = True
    """TensorBoard event files in the stage folder."""
    wandb_project: str | None = None
    """Weights & Biases project; None: off (needs the wandb package)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 50
    """Save every N steps (and always at the end of a stage); 0 saves only at the end."""
    keep: int = 2
    """Checkpoints kept per stage (the newest K, >= 1)."""
    async_save: bool = True
    """Save in a background thread while training continues."""
    resume: bool = True
    """Resume an unfinished stage from its newest valid checkpoint on re-launch."""
