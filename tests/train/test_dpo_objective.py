"""The DPO objective: in-step and precomputed reference log-probs agree; policy == reference gives log 2."""

import jax
import numpy as np
import optax
import pytest

from ptrain.config import DataConfig, DPOAlgoConfig, GeneratedTaskConfig, OptimConfig
from ptrain.data.preference import make_preference_pass
from ptrain.data.tokenizer import build_tokenizer
from ptrain.train.objectives import dpo_denominator, make_dpo_objective, pair_logprobs
from ptrain.train.optim import make_optimizer
from ptrain.train.state import init_train_state, split_model
from ptrain.train.step import make_train_step
from tests.train.helpers import tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    cfg = DataConfig(format="preference", generated=GeneratedTaskConfig(n_train=16, n_eval=4))
    batch = next(iter(make_preference_pass(cfg, tok, batch_size=8, seq_len=128)))
    model_def, params, rest = split_model(tiny_model(vocab_size=len(tok), max_seq_len=256))
    return model_def, params, rest, batch


def test_policy_equal_to_reference_gives_log_two(setup):
    model_def, params, rest, batch = setup
    obj = make_dpo_objective(model_def, DPOAlgoConfig(kind="sigmoid", beta=0.1))
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=params)
    loss, m = obj(params, state, batch, dpo_denominator(batch))
    assert float(loss) == pytest.approx(np.log(2.0), rel=1e-6)
    assert float(m["margin"]) == pytest.approx(0.0, abs=1e-6)


def test_precomputed_reference_equals_in_step_reference(setup):
    """Two steps each way from the same start: identical losses and parameters."""
    model_def, params, rest, batch = setup
    cfg = DPOAlgoConfig(kind="sigmoid", beta=0.5)
    tx, lr = make_optimizer(OptimConfig(lr=1e-2, schedule="constant"), 10)
    step = jax.jit(make_train_step(make_dpo_objective(model_def, cfg), dpo_denominator, tx, lr))
    rc, rr, _, _ = jax.jit(lambda p, b: pair_logprobs(model_def, p, rest, b))(params, batch)
    pre_batch = dict(batch, ref_chosen_logps=np.asarray(rc), ref_rejected_logps=np.asarray(rr))

    in_step = init_train_state(params, tx, seed=0, model_state=rest, ref_params=params)
    pre = init_train_state(params, tx, seed=0, model_state=rest)
    for _ in range(2):
        in_step, m1 = step(in_step, batch)
        pre, m2 = step(pre, pre_batch)
        assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(in_step.params), jax.tree.leaves(pre.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(m1["loss"]) < np.log(2.0)  # the policy moved towards the chosen answers


def test_reference_free_kinds_need_no_reference(setup):
    model_def, params, rest, batch = setup
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)  # no ref_params at all
    for kind in ("simpo", "orpo"):
        loss, _ = make_dpo_objective(model_def, DPOAlgoConfig(kind=kind))(params, state, batch, dpo_denominator(batch))
        assert np.isfinite(float(loss))


def test_moe_policy_gets_the_balance_term_and_its_load(setup):
    """An MoE policy in DPO adds aux_loss_coef x its load-balancing loss, as in SFT, and
    reports the expert load that the router-bias update reads."""
    _, _, _, batch = setup
    vocab = int(max(np.max(batch["chosen_input_ids"]), np.max(batch["rejected_input_ids"]))) + 1
    model_def, params, rest = split_model(
        tiny_model(vocab_size=max(vocab, 64), max_seq_len=256, n_layers=1, n_experts=4, top_k=2, d_ff_expert=16)
    )
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)
    cfg = DPOAlgoConfig(kind="simpo")  # reference-free: no reference weights needed
    plain, _ = make_dpo_objective(model_def, cfg)(params, state, batch, dpo_denominator(batch))
    with_lb, m = make_dpo_objective(model_def, cfg, aux_loss_coef=0.5)(params, state, batch, dpo_denominator(batch))
    assert float(with_lb - plain) == pytest.approx(0.5 * float(m["moe_lb_loss"]), rel=1e-5)
    assert m["expert_load"].shape == (1, 4)


def test_a_batch_cut_to_its_bucket_has_the_loss_and_gradient_of_the_full_length_one(tmp_path):
    """Preference rows at seq_len 512 whose sides are at most about 100 tokens train at 128
    (ptrain.data.buckets): the cut loses only padding, so the loss and gradient agree."""
    from ptrain.data.buckets import longest_row, to_bucket, trimmed

    tok = build_tokenizer(str(tmp_path / "tok"))
    cfg = DataConfig(format="preference", generated=GeneratedTaskConfig(n_train=16, n_eval=4))
    full = next(iter(make_preference_pass(cfg, tok, batch_size=8, seq_len=512)))
    longest = longest_row(full)
    assert 0 < longest <= 128
    assert longest == max(int((full[f"{s}_segment_ids"] > 0).sum(axis=1).max()) for s in ("chosen", "rejected"))
    short = to_bucket(full, 512)
    assert short["chosen_input_ids"].shape == short["rejected_loss_mask"].shape == (8, 128)
    assert short["pair_index"].shape == full["pair_index"].shape
    with pytest.raises(ValueError, match="past"):
        trimmed(full, longest - 1)
    model_def, params, rest = split_model(tiny_model(vocab_size=len(tok), max_seq_len=512))
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=jax.tree.map(lambda x: x * 0.9, params))
    obj = make_dpo_objective(model_def, DPOAlgoConfig(kind="sigmoid", beta=0.5))
    out = [jax.value_and_grad(lambda p, b=b: obj(p, state, b, dpo_denominator(b)), has_aux=True)(params)
           for b in (full, short)]  # fmt: skip
    ((l_full, _), g_full), ((l_short, _), g_short) = out
    assert float(l_short) == pytest.approx(float(l_full), rel=1e-5)
    # float32 sums over 512 and over 128 positions: equal up to rounding, in norm
    diff = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_short))))
    assert diff <= 1e-5 * float(optax.global_norm(g_full))
