"""The generic train step: exact gradient accumulation, optimizer masks and schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ptrain.config import OptimConfig, SFTAlgoConfig
from ptrain.train.objectives import make_sft_objective, sft_denominator
from ptrain.train.optim import decay_mask, make_optimizer, make_schedule
from ptrain.train.state import init_train_state, split_model
from ptrain.train.step import make_train_step
from tests.train.helpers import random_batch, tiny_model


@pytest.fixture(scope="module")
def split():
    return split_model(tiny_model())


def run_steps(split, aggregation, grad_accum, n=2):
    model_def, params, rest = split
    cfg = SFTAlgoConfig(aggregation=aggregation)
    # plain SGD: parameters move linearly in the gradient, so any accumulation error would show
    # (Adam's normalisation would amplify float noise in near-zero gradients instead)
    tx, lr = make_optimizer(OptimConfig(name="sgd", b1=0.0, lr=0.5, schedule="constant", grad_clip=0.0), 10)
    step = jax.jit(
        make_train_step(make_sft_objective(model_def, cfg), sft_denominator(cfg, 128.0), tx, lr, grad_accum=grad_accum)
    )
    state = init_train_state(params, tx, seed=0, model_state=rest)
    losses = []
    for i in range(n):
        state, m = step(state, random_batch(seed=i))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
def test_gradient_accumulation_is_exact(split, aggregation):
    """One step over 8 rows equals 4 micro-batches of 2: same loss, same updated params.

    The rows have very different numbers of loss tokens, so averaging micro-batch means
    (the common shortcut) would differ; the global denominator makes them agree.
    """
    s1, l1 = run_steps(split, aggregation, 1)
    s4, l4 = run_steps(split, aggregation, 4)
    np.testing.assert_allclose(l1, l4, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_loss_decreases_on_a_repeated_batch(split):
    model_def, params, rest = split
    cfg = SFTAlgoConfig()
    tx, lr = make_optimizer(OptimConfig(lr=3e-3, schedule="constant"), 20)
    step = jax.jit(make_train_step(make_sft_objective(model_def, cfg), sft_denominator(cfg, 1.0), tx, lr))
    state = init_train_state(params, tx, seed=0, model_state=rest)
    batch = random_batch()
    first = None
    for _ in range(15):
        state, m = step(state, batch)
        first = first if first is not None else float(m["loss"])
    assert float(m["loss"]) < 0.7 * first
    assert int(state.step) == 15


def test_decay_mask_skips_norms_biases_and_embeddings(split):
    _, params, _ = split
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(decay_mask(params, OptimConfig()))[0]
    }
    assert not any(v for k, v in flat.items() if "norm" in k.lower())
    assert not any(v for k, v in flat.items() if "embed" in k.lower())
    assert any(v for k, v in flat.items() if "mlp" in k.lower() or "proj" in k.lower())
    flat_all = jax.tree.leaves(decay_mask(params, OptimConfig(decay_norms=True, decay_embeddings=True)))
    assert all(flat_all) or sum(flat_all) > sum(flat.values())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules_warm_up_then_decay(schedule):
    cfg = OptimConfig(lr=1.0, schedule=schedule, warmup_steps=10, min_lr_ratio=0.1)
    lr = make_schedule(cfg, 110)
    assert float(lr(0)) == 0.0 and abs(float(lr(5)) - 0.5) < 1e-6 and abs(float(lr(10)) - 1.0) < 1e-6
    end = float(lr(110))
    assert end == pytest.approx(1.0 if schedule == "constant" else 0.1, abs=1e-5)
    if schedule == "cosine":
        assert float(lr(60)) == pytest.approx(0.55, abs=1e-5)


def test_grad_clip_bounds_the_update():
    params = {"w": jnp.ones((4, 4))}
    tx, _ = make_optimizer(OptimConfig(name="sgd", lr=1.0, b1=0.0, schedule="constant", grad_clip=1.0), 1)
    updates, _ = tx.update({"w": jnp.full((4, 4), 100.0)}, tx.init(params), params)
    assert float(optax.global_norm(updates)) == pytest.approx(1.0, rel=1e-5)


def test_chunked_vocabulary_path_matches_full_logits(split):
    """train.vocab_chunk > 0 (hidden states + head, chunked) computes the same loss and gradient."""
    model_def, params, rest = split
    cfg = SFTAlgoConfig()
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)
    batch = random_batch()
    denom = sft_denominator(cfg, 1.0)(batch)
    grads = {}
    for chunk in (0, 16):
        obj = make_sft_objective(model_def, cfg, vocab_chunk=chunk)
        (loss, _), g = jax.jit(jax.value_and_grad(lambda p: obj(p, state, batch, denom), has_aux=True))(params)
        grads[chunk] = (float(loss), g)
    assert grads[0][0] == pytest.approx(grads[16][0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads[0][1]), jax.tree.leaves(grads[16][1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
def test_moe_balance_term_weighs_the_same_under_every_aggregation(aggregation):
    """The objective adds aux_loss_coef x the load-balancing loss whatever divides the
    cross-entropy (sequence_mean once scaled it by the tokens per sequence); with 4
    micro-batches it adds the token-weighted mean of theirs."""
    model_def, params, rest = split_model(tiny_model(n_layers=1, n_experts=4, top_k=2, d_ff_expert=16))
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)
    cfg = SFTAlgoConfig(aggregation=aggregation)
    batch = {k: jnp.asarray(v) for k, v in random_batch(batch=4, length=16).items()}
    denoms = jax.tree.map(lambda d: jnp.maximum(d, 1.0), sft_denominator(cfg, 64.0)(batch))
    plain, _ = make_sft_objective(model_def, cfg, aux_loss_coef=0.0)(state.params, state, batch, denoms)
    with_lb, m = make_sft_objective(model_def, cfg, aux_loss_coef=0.5)(state.params, state, batch, denoms)
    assert float(with_lb - plain) == pytest.approx(0.5 * float(m["moe_lb_loss"]), rel=1e-5)
