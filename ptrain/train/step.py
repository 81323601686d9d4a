"""The generic pure train step: accumulate gradients over micro-batches, clip, update.

An algorithm supplies an *objective* and a *denominator*; this module turns them into
`step(state, batch) -> (state, metrics)`. The driver applies jit, shardings and donation
once; nothing here logs or has side effects.

Exact accumulation: the denominator (e.g. the number of loss tokens) is computed once
over the whole global batch, and every micro-batch contributes numerator / denominator.
The summed gradient therefore equals the gradient of the full-batch loss for any
grad_accum, whatever the aggregation mode (token-mean needs this; a mean of
micro-batch means would weight short micro-batches wrongly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ptrain.train.state import TrainState

PyTree = Any
# objective(params, state, micro_batch, denominator) -> (loss, metrics); `loss` is this
# micro-batch's share of the full-batch loss, `metrics` a dict of scalars that add up
# over micro-batches (divide by `denominator` inside for means).
Objective = Callable[[PyTree, TrainState, dict, Any], tuple[jax.Array, dict]]
# denominator(global batch) -> a scalar, or a dict of scalars (each clamped to >= 1), handed
# to every micro-batch's objective unchanged.
Denominator = Callable[[dict], Any]
# post_update(model_state, metrics) -> model_state, e.g. the MoE router-bias update.
PostUpdate = Callable[[PyTree, dict], PyTree]


def split_micro_batches(batch: dict, grad_accum: int) -> dict:
    """[B, ...] leaves -> [grad_accum, B / grad_accum, ...]."""

    def split(x):
        if x.shape[0] % grad_accum:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into grad_accum={grad_accum} micro-batches")
        return x.reshape((grad_accum, x.shape[0] // grad_accum) + x.shape[1:])

    return jax.tree.map(split, batch)


def accumulate_gradients(
    objective: Objective, state: TrainState, batch: dict, denom: Any, grad_accum: int
) -> tuple[PyTree, dict]:
    """Sum of per-micro-batch gradients and metrics (a scan when grad_accum > 1)."""
    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def one(mb):
        (loss, metrics), grads = grad_fn(state.params, state, mb, denom)
        return grads, dict(metrics, loss=loss)

    if grad_accum == 1:
        return one(batch)
    micro = split_micro_batches(batch, grad_accum)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    first_metrics = jax.eval_shape(lambda: one(jax.tree.map(lambda x: x[0], micro))[1])
    zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first_metrics)

    def body(carry, mb):
        g_acc, m_acc = carry
        g, m = one(mb)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, m_acc, m)), None

    (grads, metrics), _ = jax.lax.scan(body, (zeros, zero_metrics), micro)
    return grads, metrics


def make_train_step(
    objective: Objective,
    denominator: Denominator,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    *,
    grad_accum: int = 1,
    post_update: PostUpdate | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Build the pure `step(state, batch) -> (state, metrics)` of one optimizer update."""

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        denom = jax.tree.map(lambda d: jnp.maximum(jnp.asarray(d, jnp.float32), 1.0), denominator(batch))
        grads, metrics = accumulate_gradients(objective, state, batch, denom, grad_accum)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = post_update(state.model_state, metrics) if post_update else state.model_state
        metrics = dict(
            metrics,
            grad_norm=optax.global_norm(grads),
            lr=lr_schedule(state.step),
            param_norm=optax.global_norm(params),
        )
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        return new_state, metrics

    return step
