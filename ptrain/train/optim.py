"""Optimizers and learning-rate schedules from OptimConfig, as optax transformations.

The names they take are ptrain.config.choices.OPTIMIZERS and SCHEDULES; a new one is added
there (so the config accepts it) and built here.
"""

from __future__ import annotations

import jax
import optax

from ptrain.config.choices import OPTIMIZERS, SCHEDULES, one_of
from ptrain.config.optim import OptimConfig


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to cfg.lr, then constant / linear / cosine decay to lr * min_lr_ratio."""
    warmup = max(cfg.warmup_steps, int(cfg.warmup_ratio * total_steps))
    warmup = min(warmup, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        raise ValueError(f"optim.schedule: unknown schedule '{cfg.schedule}'; pass {one_of(SCHEDULES)}")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def decay_mask(params, cfg: OptimConfig):
    """True where weight decay applies: matrices, plus norms/biases/embeddings when asked.

    Decided from the parameter's path and rank, so it works for every model family.
    """

    def leaf_mask(path, x) -> bool:
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()
        if "norm" in names:
            return cfg.decay_norms
        if "bias" in names.rsplit("/", 1)[-1]:
            return cfg.decay_biases
        if "embed" in names or "lm_head" in names:
            return cfg.decay_embeddings
        return x.ndim >= 2

    return jax.tree_util.tree_map_with_path(leaf_mask, params)


def make_optimizer(
    cfg: OptimConfig, total_steps: int, *, frozen: tuple[str, ...] = ()
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax chain: clip by global norm, then the optimizer driven by the schedule.

    frozen: parameter names (a path component, e.g. "router") that never change: their
    updates are zero (weight decay included), and their gradients stay out of the clip."""
    lr = make_schedule(cfg, total_steps)
    if cfg.name in ("adamw", "adam"):
        wd = cfg.weight_decay if cfg.name == "adamw" else 0.0
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=lambda p: decay_mask(p, cfg))
    elif cfg.name == "lion":
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=lambda p: decay_mask(p, cfg))
    elif cfg.name == "adafactor":
        opt = optax.adafactor(
            lr, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=lambda p: decay_mask(p, cfg)
        )
    elif cfg.name == "sgd":
        opt = optax.sgd(lr, momentum=cfg.b1 or None)
    else:
        raise ValueError(f"optim.name: unknown optimizer '{cfg.name}'; pass {one_of(OPTIMIZERS)}")
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    tx = optax.chain(*chain, opt)
    if frozen:
        tx = optax.multi_transform(
            {"train": tx, "frozen": optax.set_to_zero()}, lambda params: frozen_labels(params, frozen)
        )
    return tx, lr


def frozen_labels(params, frozen: tuple[str, ...]):
    """ "frozen" for every leaf whose path holds one of the names, else "train"."""

    def label(path, _):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return "frozen" if names & set(frozen) else "train"

    return jax.tree_util.tree_map_with_path(label, params)
