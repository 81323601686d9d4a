"""The optimizer and its schedule (Hydra group `optim/`), built by ptrain.train.optim."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: adamw | adam | sgd | adafactor | lion."""
    lr: float = 3e-4
    """Peak learning rate (> 0)."""
    schedule: str = "cosine"
    """constant | linear | cosine: shape after warmup."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many steps (>= 0)."""
    warmup_ratio: float = 0.0
    """Alternative to warmup_steps: fraction of the stage's steps (0 <= r < 1); the larger wins."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr for linear/cosine decay (0 <= r <= 1)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW); applied to matrices only unless the flags below say otherwise."""
    decay_norms: bool = False
    """Also decay normalisation scales."""
    decay_biases: bool = False
    """Also decay biases."""
    decay_embeddings: bool = False
    """Also decay the token embedding (and untied output head)."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping threshold; 0 disables."""
