"""The policy objective of GRPO stages: trajectories pack into aligned rows; the objective is
the policy loss on the model's own log-probs; accumulation over micro-batches is exact."""

import dataclasses

import jax
import numpy as np
import pytest

from ptrain.config import OptimConfig
from ptrain.config.grpo import GRPOAlgoConfig
from ptrain.data.buckets import MIN_BUCKET, bucket_length, trimmed
from ptrain.envs.base import Task, Trajectory
from ptrain.losses.policy import policy_loss
from ptrain.stages.grpo.batch import packed_rows, policy_batch
from ptrain.train.optim import make_optimizer
from ptrain.train.policy_objective import (
    finalize_policy_metrics,
    make_policy_objective,
    policy_denominator,
    policy_logprobs,
)
from ptrain.train.state import init_train_state, split_model
from ptrain.train.step import make_train_step
from tests.train.helpers import tiny_model

TASK = Task(env="t", id="0", messages=({"role": "user", "content": "x"},))


def traj(prompt, response, *, env_tokens=(), reward=1.0, finish="stop", seed=0):
    """prompt + response (+ an environment turn masked out, + more response)."""
    rng = np.random.default_rng(seed)
    ids = list(prompt) + list(response) + list(env_tokens) + list(response)
    mask = [0] * len(prompt) + [1] * len(response) + [0] * len(env_tokens) + [1] * len(response)
    logp = [float(-rng.random()) if m else 0.0 for m in mask]
    return Trajectory(task=TASK, sample_index=0, token_ids=tuple(ids), prompt_length=len(prompt),
                      loss_mask=tuple(mask), logprobs=tuple(logp), reward=reward, finish_reason=finish)  # fmt: skip


def test_policy_batch_aligns_targets_masks_and_engine_logprobs():
    t = traj([1, 2, 3], [7, 8], env_tokens=[40, 41])
    batch, counts = policy_batch([t, traj([5], [9], finish="length")], [0.5, -1.0], rows=4, seq_len=12,
                                 mask_truncated=True)  # fmt: skip
    n = len(t.token_ids) - 1
    np.testing.assert_array_equal(batch["input_ids"][0, :n], t.token_ids[:-1])
    np.testing.assert_array_equal(batch["target_ids"][0, :n], t.token_ids[1:])
    np.testing.assert_array_equal(batch["loss_mask"][0, :n], t.loss_mask[1:])  # target i+1 was sampled
    np.testing.assert_allclose(batch["engine_logp"][0, :n], t.logprobs[1:])
    assert batch["loss_mask"][0].sum() == 4 and batch["segment_ids"][0, n:].sum() == 0
    assert batch["loss_mask"][1].sum() == 0  # truncated and overlong-filtered
    assert batch["row_valid"].tolist() == [1, 1, 0, 0] and batch["advantages"].tolist() == [0.5, -1.0, 0, 0]
    assert counts["masked_truncated"] == 1 and counts["loss_tokens"] == 4
    with pytest.raises(ValueError, match="do not fit"):
        policy_batch([t] * 5, [0.0] * 5, rows=4, seq_len=12)


@pytest.mark.parametrize(
    "longest, seq_len, multiple, want",
    [(10, 1024, 1, 128), (129, 1024, 1, 256), (512, 1024, 1, 512), (513, 1024, 1, 1024), (1024, 1024, 1, 1024),
     (10, 96, 1, 96), (10, 1000, 1, 250), (300, 1536, 1, 384), (10, 768, 128, 384), (10, 768, 3, 192)],
)  # fmt: skip
def test_a_batch_trains_at_the_shortest_halving_of_seq_len_that_holds_it(longest, seq_len, multiple, want):
    assert bucket_length(longest, seq_len, multiple) == want
    assert want >= longest and want % multiple == 0 and (want >= MIN_BUCKET or want == seq_len)


def test_a_bucketed_batch_has_the_loss_and_gradient_of_the_full_length_one():
    """Rows cut to their bucket lose only padding: the objective and its gradient agree with the
    seq_len batch's (Dr. GRPO's constant pinned, as the stage pins it to seq_len)."""
    model_def, params, rest = split_model(tiny_model())
    trajs = [traj([1 + i, 2, 3], [7 + i, 8, 9 + i], env_tokens=[40], seed=i) for i in range(4)]
    full, _ = policy_batch(trajs, [1.0, -0.5, 0.25, -0.75], rows=4, seq_len=64)
    short = trimmed(full, bucket_length(int(full["segment_ids"].sum(axis=1).max()), 64) // 4)  # 16 tokens
    assert short["input_ids"].shape == (4, 16) and short["segment_ids"].sum() == full["segment_ids"].sum()
    with pytest.raises(ValueError, match="past 8"):
        trimmed(full, 8)
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)
    for cfg in (GRPOAlgoConfig(), GRPOAlgoConfig(aggregation="seq_mean_token_sum_norm", norm_constant=64.0)):
        obj = make_policy_objective(model_def, cfg)
        denom = policy_denominator(cfg.aggregation)
        (l_full, _), g_full = jax.value_and_grad(lambda p, b=full: obj(p, state, b, denom(b)), has_aux=True)(params)
        (l_short, _), g_short = jax.value_and_grad(lambda p, b=short: obj(p, state, b, denom(b)), has_aux=True)(params)
        assert float(l_short) == pytest.approx(float(l_full), rel=1e-5)
        for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_short)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "needed, rows, multiple, want",
    [(27, 96, 1, 36), (37, 96, 1, 48), (49, 96, 1, 72), (73, 96, 1, 96), (1, 96, 1, 3), (3, 8, 1, 3),
     (3, 8, 4, 4), (5, 8, 4, 8), (0, 8, 2, 2), (10, 12, 6, 12)],
)  # fmt: skip
def test_a_packed_batch_rounds_its_rows_up_to_a_few_sizes(needed, rows, multiple, want):
    assert packed_rows(needed, rows, multiple) == want


def mixed_trajectories():
    sizes = [(3, 9), (1, 2), (2, 4), (1, 1), (2, 11), (1, 3), (4, 5), (2, 2)]  # (prompt, response) tokens
    return [traj(list(range(1, p + 1)), [20 + i + j for j in range(r)], seed=i, finish="length" if i == 4 else "stop")
            for i, (p, r) in enumerate(sizes)]  # fmt: skip


def test_packing_puts_several_trajectories_in_a_row_each_its_own_segment():
    trajs = mixed_trajectories()
    adv = np.linspace(-1, 1, len(trajs), dtype=np.float32)
    flat, _ = policy_batch(trajs, adv, rows=8, seq_len=32)
    packed, counts = policy_batch(trajs, adv, rows=8, seq_len=32, pack=True)
    assert packed["input_ids"].shape == (3, 32) and packed["advantages"].shape == (3, 32)  # 82 tokens
    assert counts["loss_tokens"] == flat["loss_mask"].sum() == packed["loss_mask"].sum()
    seen = 0
    for row in range(3):
        seg, pos = packed["segment_ids"][row], packed["positions"][row]
        for k in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == k)
            assert (np.diff(at) == 1).all() and (pos[at] == np.arange(len(at))).all()  # contiguous, from 0
            # It is one of the trajectories, with its own advantage on each of its tokens.
            i = next(i for i in range(8) if (flat["input_ids"][i, : len(at)] == packed["input_ids"][row, at]).all()
                     and flat["segment_ids"][i].sum() == len(at))  # fmt: skip
            np.testing.assert_array_equal(packed["engine_logp"][row, at], flat["engine_logp"][i, : len(at)])
            assert (packed["advantages"][row, at] == adv[i]).all()
            seen += 1
    assert seen == 8
    masked = [dataclasses.replace(t, masked=True) if i == 0 else t for i, t in enumerate(trajs)]
    packed, counts = policy_batch(masked, adv, rows=8, seq_len=32, pack=True, multiple=2)
    assert counts["masked_samples"] == 1 and packed["input_ids"].shape[0] == 2
    assert packed["segment_ids"].max(axis=1).sum() == 7


@pytest.mark.parametrize(
    "options",
    [dict(), dict(aggregation="seq_mean_token_mean", kl_coef=0.1), dict(aggregation="seq_mean_token_sum_norm",
     norm_constant=32.0), dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"),
     dict(is_correction="is", is_level="sequence", max_seq_mult_prob_error=1.3, aggregation="seq_mean_token_mean")],
)  # fmt: skip
def test_a_packed_batch_has_the_loss_and_gradient_of_the_unpacked_one(options):
    """Packing changes the layout only: per token the model's log-probs are the same (attention
    and positions stay inside a segment), and the loss, its gradient and every count agree for
    each aggregation, the sequence-level ratio and IS weight, and the sequence drop."""
    model_def, params, rest = split_model(tiny_model())
    trajs = mixed_trajectories()
    adv = np.linspace(-1, 1, len(trajs), dtype=np.float32)
    flat, _ = policy_batch(trajs, adv, rows=8, seq_len=32, mask_truncated=True)
    packed, _ = policy_batch(trajs, adv, rows=8, seq_len=32, mask_truncated=True, pack=True, multiple=2)
    assert packed["input_ids"].shape[0] == 4  # 3 full, 1 of padding
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=params)
    out = {}
    for name, batch, pack in (("flat", flat, False), ("packed", packed, True)):
        logp = np.asarray(policy_logprobs(model_def, params, rest, batch, temperature=1.0, vocab_chunk=0))
        out.setdefault("logp", []).append(np.sort(logp[batch["loss_mask"] > 0]))
        # The engine is close to the trainer, except on tokens >= 28 (in three of the sequences that
        # count), which the sequence drop takes out.
        batch = dict(
            batch,
            old_logp=logp - 0.05,
            engine_logp=logp - 0.05 - np.where(batch["target_ids"] >= 28, 3.0, 0.05).astype(np.float32),
        )
        cfg = GRPOAlgoConfig(epochs=2, pack_rows=pack, **options)
        obj = make_policy_objective(model_def, cfg)
        denom = policy_denominator(cfg.aggregation, packed=pack)(batch)
        (loss, m), g = jax.value_and_grad(lambda p, b=batch, d=denom: obj(p, state, b, d), has_aux=True)(params)
        out[name] = (float(loss), {k: float(v) for k, v in m.items() if np.ndim(v) == 0}, g, denom)
    np.testing.assert_allclose(*out["logp"], rtol=1e-5, atol=1e-6)
    (l_flat, m_flat, g_flat, d_flat), (l_packed, m_packed, g_packed, d_packed) = out["flat"], out["packed"]
    assert l_packed == pytest.approx(l_flat, rel=1e-5, abs=1e-7)
    assert float(d_packed["seqs"]) == float(d_flat["seqs"]) == 7  # the overlong one is filtered out
    for k in ("loss_seqs", "loss_tokens", "frac_seq_dropped", "pg_loss", "kl_loss", "ratio_mean"):
        assert m_packed[k] == pytest.approx(m_flat[k], rel=1e-5, abs=1e-7), k
    if "max_seq_mult_prob_error" in options:
        assert m_flat["frac_seq_dropped"] == pytest.approx(3 / 7)
        # Means over the kept tokens stay means when sequences are dropped: old = logp - 0.05
        # makes every ratio exp(0.05).
        step = finalize_policy_metrics(m_flat, 1)
        assert step["ratio_mean"] == pytest.approx(np.exp(0.05), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g_flat), jax.tree.leaves(g_packed)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def setup():
    model_def, params, rest = split_model(tiny_model())
    trajs = [traj([1 + i, 2, 3], [7 + i, 8, 9 + i], env_tokens=[40], seed=i) for i in range(4)]
    batch, _ = policy_batch(trajs, [1.0, -0.5, 0.25, -0.75], rows=4, seq_len=16)
    return model_def, params, rest, batch


def test_objective_is_the_policy_loss_on_the_models_logprobs(setup):
    model_def, params, rest, batch = setup
    cfg = GRPOAlgoConfig(temperature=0.7, clip_high=0.28, is_correction="tis", is_high=2.0)
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest)
    denom = policy_denominator(cfg.aggregation)(batch)
    loss, m = make_policy_objective(model_def, cfg)(params, state, batch, denom)
    logp = policy_logprobs(model_def, params, rest, batch, temperature=0.7, vocab_chunk=0)
    ref, aux = policy_loss(logp, None, batch["advantages"], batch["loss_mask"], clip_low=0.2, clip_high=0.28,
                           engine_logp=batch["engine_logp"], is_correction="tis", is_high=2.0)  # fmt: skip
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert float(m["loss_tokens"]) == float(batch["loss_mask"].sum())
    assert float(m["mismatch_kl"]) == pytest.approx(float(aux.mismatch_kl), rel=1e-5)
    # On-policy, a single update: the ratio is 1 and the gradient is -A grad logp per token.
    g = jax.grad(lambda p: make_policy_objective(model_def, cfg)(p, state, batch, denom)[0])(params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_two_micro_batches_equal_one(setup, aggregation):
    model_def, params, rest, batch = setup
    cfg = GRPOAlgoConfig(aggregation=aggregation, kl_coef=0.1, epochs=2)
    batch = dict(batch, old_logp=np.asarray(policy_logprobs(model_def, params, rest, batch, temperature=1.0,
                                                             vocab_chunk=0)) - 0.05)  # fmt: skip
    # SGD: Adam's first step is lr * sign(g), which turns float noise in a near-zero gradient
    # into a full-size difference.
    tx, lr = make_optimizer(OptimConfig(name="sgd", lr=1e-1, schedule="constant", grad_clip=0.0), 10)
    obj = make_policy_objective(model_def, cfg, vocab_chunk=16)
    out = []
    for accum in (1, 2):
        step = jax.jit(make_train_step(obj, policy_denominator(aggregation), tx, lr, grad_accum=accum))
        state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=params)
        out.append(step(state, batch))
    (s1, m1), (s2, m2) = out
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
    assert float(m1["pg_loss"]) == pytest.approx(float(m2["pg_loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_validation_names_the_key():
    from ptrain.config import ConfigError, RunConfig
    from ptrain.config.run import validate

    for change, key in [
        ({"group_size": 1}, "algo.grpo.group_size"),
        ({"aggregation": "mean"}, "algo.grpo.aggregation"),
        ({"mini_batches": 3}, "algo.grpo.mini_batches"),
        ({"is_correction": "tis", "is_low": 0.5}, "algo.grpo.is_low"),
        ({"mode": "fast"}, "algo.grpo.mode"),
    ]:
        run = RunConfig()
        run.algo.grpo = dataclasses.replace(run.algo.grpo, **change)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(run)


PRESETS = {
    "grpo": dict(aggregation="seq_mean_token_mean", normalize_std=True, kl_coef=0.04),
    "dr_grpo": dict(aggregation="seq_mean_token_sum_norm", normalize_std=False),
    "dapo": dict(aggregation="token_mean", clip_high=0.28, dual_clip=10.0, dynamic_sampling=True, overlong_buffer=8),
    "gspo": dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"),
    "cispo": dict(objective="cispo", clip_low=1.0, clip_high=4.0),
    "rloo": dict(baseline="leave_one_out", normalize_std=False),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_named_algorithm_is_a_valid_config_with_a_finite_gradient(setup, name):
    """GRPO, Dr. GRPO, DAPO, GSPO, CISPO and RLOO are settings of algo.grpo (ptrain/config/grpo.py)."""
    from ptrain.config import RunConfig
    from ptrain.config.run import validate

    model_def, params, rest, batch = setup
    cfg = GRPOAlgoConfig(max_new_tokens=12, epochs=2, **PRESETS[name])
    run = RunConfig()
    run.algo.grpo = cfg
    validate(run)
    batch = dict(batch, old_logp=np.asarray(policy_logprobs(model_def, params, rest, batch, temperature=1.0,
                                                             vocab_chunk=0)) + 0.01)  # fmt: skip
    tx, _ = make_optimizer(OptimConfig(), 10)
    state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=params)
    obj = make_policy_objective(model_def, cfg)
    loss, g = jax.value_and_grad(lambda p: obj(p, state, batch, policy_denominator(cfg.aggregation)(batch))[0])(params)
    assert np.isfinite(float(loss))
    norms = [float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g)]
    assert all(np.isfinite(norms)) and max(norms) > 0
