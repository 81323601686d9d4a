"""Policy-gradient loss: hand-derived clipping, aggregation, KL, IS correction; GSPO/GRPO; invariances."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ptrain.losses import kl_penalty, policy_loss

LOG = np.log


def _one_token(log_ratio, adv, **kw):
    """Loss, d loss / d logp and aux for one sequence of one token with ratio exp(log_ratio)."""
    old = jnp.array([[-1.0]])
    f = lambda lp: policy_loss(lp, old, jnp.array([adv]), jnp.ones((1, 1)), **kw)  # noqa: E731
    (loss, aux), g = jax.value_and_grad(f, has_aux=True)(old + log_ratio)
    return float(loss), float(g[0, 0]), aux


def test_ppo_clip_hand_values():
    """One token, clip 0.2 (so r is kept in [0.8, 1.2]); loss = max(-A r, -A clip(r)).

    r = 1.5, A = +1: max(-1.5, -1.2) = -1.2, clipped so d/d logp = 0; counted in clip_frac_high.
    r = 1.5, A = -1: max(1.5, 1.2) = 1.5, unclipped: d/d logp = -A r = 1.5.
    r = 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped (clip_frac_low), gradient 0.
    r = 0.5, A = +1: max(-0.5, -0.8) = -0.5, unclipped: gradient -0.5.
    """
    loss, g, aux = _one_token(LOG(1.5), 1.0)
    np.testing.assert_allclose([loss, g], [-1.2, 0.0], atol=1e-6)
    assert float(aux.clip_frac_high) == 1.0 and float(aux.clip_frac_low) == 0.0
    np.testing.assert_allclose(aux.ratio_mean, 1.5, rtol=1e-6)
    loss, g, _ = _one_token(LOG(1.5), -1.0)
    np.testing.assert_allclose([loss, g], [1.5, 1.5], rtol=1e-6)
    loss, g, aux = _one_token(LOG(0.5), -1.0)
    np.testing.assert_allclose([loss, g], [0.8, 0.0], atol=1e-6)
    assert float(aux.clip_frac_low) == 1.0
    loss, g, _ = _one_token(LOG(0.5), 1.0)
    np.testing.assert_allclose([loss, g], [-0.5, -0.5], rtol=1e-6)


def test_clip_higher_and_dual_clip_hand_values():
    """DAPO clip-higher 0.2 / 0.28: r = 1.25, A = 1 is inside [0.8, 1.28]: loss -1.25, gradient -1.25.
    Dual clip c = 3: r = 5, A = -1: min(max(5, 1.2), 3) = 3, gradient 0, counted in clip_frac_dual;
    r = 2, A = -1: 2 < 3 so the dual clip is inactive: loss 2, gradient 2.
    """
    loss, g, _ = _one_token(LOG(1.25), 1.0, clip_low=0.2, clip_high=0.28)
    np.testing.assert_allclose([loss, g], [-1.25, -1.25], rtol=1e-6)
    loss, _, _ = _one_token(LOG(1.25), 1.0, clip_low=0.2)
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    loss, g, aux = _one_token(LOG(5.0), -1.0, dual_clip=3.0)
    np.testing.assert_allclose([loss, g], [3.0, 0.0], atol=1e-6)
    assert float(aux.clip_frac_dual) == 1.0
    loss, g, aux = _one_token(LOG(2.0), -1.0, dual_clip=3.0)
    np.testing.assert_allclose([loss, g], [2.0, 2.0], rtol=1e-6)
    assert float(aux.clip_frac_dual) == 0.0


def test_cispo_keeps_gradient_of_clipped_tokens():
    """CISPO: loss = -sg(clip(r, 0.8, 1.2)) A logp. r = 1.5, A = 1, logp = -1 + log 1.5 = -0.5945349:
    loss = -1.2 * (-0.5945349) = 0.7134419 and d/d logp = -1.2 (PPO would give 0 here)."""
    loss, g, aux = _one_token(LOG(1.5), 1.0, objective="cispo")
    np.testing.assert_allclose([loss, g], [1.2 * (1.0 - LOG(1.5)), -1.2], rtol=1e-6)
    assert float(aux.clip_frac_high) == 1.0


@pytest.fixture(scope="module")
def ragged():
    """Two responses of lengths 1 and 3 on a padded length 3; on-policy (r = 1), so the per-token
    policy term is -A_t with per-token advantages A = [[-2, ., .], [1, 2, 3]]: l = [[2], [-1, -2, -3]]."""
    return dict(
        logp=jnp.full((2, 3), -1.0),
        adv=jnp.array([[-2.0, 9.0, 9.0], [1.0, 2.0, 3.0]]),
        mask=jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
    )


@functools.partial(jax.jit, static_argnames=("aggregation", "norm_constant"))
def _agg_loss(logp, adv, mask, denominator=None, *, aggregation, norm_constant=None):
    return policy_loss(
        logp, None, adv, mask, aggregation=aggregation, norm_constant=norm_constant, denominator=denominator
    )[0]


def test_aggregation_hand_values(ragged):
    """token_mean (2 - 6) / 4 = -1; seq_mean_token_mean (2 + (-2)) / 2 = 0;
    seq_mean_token_sum (2 - 6) / 2 = -2; seq_mean_token_sum_norm -2 / C: C = L = 3 by default, C = 4 given."""
    args = (ragged["logp"], ragged["adv"], ragged["mask"])
    want = {
        "token_mean": -1.0,
        "seq_mean_token_mean": 0.0,
        "seq_mean_token_sum": -2.0,
        "seq_mean_token_sum_norm": -2.0 / 3.0,
    }
    for agg, value in want.items():
        np.testing.assert_allclose(_agg_loss(*args, aggregation=agg), value, atol=1e-6, err_msg=agg)
    np.testing.assert_allclose(
        _agg_loss(*args, aggregation="seq_mean_token_sum_norm", norm_constant=4.0), -0.5, rtol=1e-6
    )


def test_aggregation_modes_coincide_on_equal_lengths():
    """All lengths L: token_mean = seq_mean_token_mean = seq_mean_token_sum / L = sum_norm with C = L."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
    logp = -jax.random.uniform(k1, (3, 4))
    old = logp + 0.3 * jax.random.normal(k2, (3, 4))
    adv = jax.random.normal(k3, (3,))
    mask = jnp.ones((3, 4))
    losses = {
        agg: policy_loss(logp, old, adv, mask, aggregation=agg)[0]
        for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
    }
    np.testing.assert_allclose(losses["seq_mean_token_mean"], losses["token_mean"], rtol=1e-6)
    np.testing.assert_allclose(losses["seq_mean_token_sum"] / 4, losses["token_mean"], rtol=1e-6)
    np.testing.assert_allclose(losses["seq_mean_token_sum_norm"], losses["token_mean"], rtol=1e-6)


@pytest.fixture(scope="module")
def rollout():
    k = jax.random.split(jax.random.PRNGKey(7), 6)
    b, l = 4, 5
    logp = -2.0 * jax.random.uniform(k[0], (b, l)) - 0.1
    return dict(
        logp=logp,
        old=logp + 0.3 * jax.random.normal(k[1], (b, l)),
        ref=logp + 0.5 * jax.random.normal(k[2], (b, l)),
        engine=logp + 0.2 * jax.random.normal(k[3], (b, l)),
        entropy=jax.random.uniform(k[4], (b, l)),
        adv=jax.random.normal(k[5], (b,)),
        mask=jnp.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], jnp.float32),
    )


FULL_OPTIONS = dict(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    kl_coef=0.05,
    kl_estimator="k3",
    entropy_coef=0.01,
    is_correction="tis",
    is_high=1.5,
)


def _full(r, logp, mask, ratio_level="token", aggregation="token_mean", **over):
    kw = dict(FULL_OPTIONS, **over)
    return policy_loss(
        logp,
        r["old"][:, : logp.shape[1]],
        r["adv"],
        mask,
        ratio_level=ratio_level,
        aggregation=aggregation,
        ref_logp=r["ref"][:, : logp.shape[1]],
        entropy=r["entropy"][:, : logp.shape[1]],
        engine_logp=r["engine"][:, : logp.shape[1]],
        **kw,
    )


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masking_equals_slicing(rollout, ratio_level):
    """Padding columns beyond every response change nothing (mask has zeros in the last column)."""
    mask = rollout["mask"].at[2, 4].set(0.0)
    f = jax.jit(functools.partial(_full, rollout, ratio_level=ratio_level, aggregation="seq_mean_token_mean"))
    full, aux_full = f(rollout["logp"], mask)
    sliced, aux_sliced = f(rollout["logp"][:, :4], mask[:, :4])
    np.testing.assert_allclose(full, sliced, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(aux_full), jax.tree.leaves(aux_sliced)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gspo_equals_grpo_on_one_token_responses(rollout):
    """With one token, the sequence ratio exp(mean log-ratio) is the token ratio: same loss and gradient."""
    logp, mask = rollout["logp"][:, :1], jnp.ones((4, 1))

    def both(logp):
        return [
            jax.value_and_grad(lambda lp: _full(rollout, lp, mask, ratio_level=lvl)[0])(logp)
            for lvl in ("token", "sequence")
        ]

    (l_tok, g_tok), (l_seq, g_seq) = jax.jit(both)(logp)
    np.testing.assert_allclose(l_seq, l_tok, rtol=1e-6)
    np.testing.assert_allclose(g_seq, g_tok, rtol=1e-6, atol=1e-7)


def test_gspo_gradient_is_the_sequence_objective(rollout):
    """GSPO (2507.18071): J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (logp - old)) as a
    function of all the sequence's tokens. The token form with seq_mean_token_mean gives its gradient."""
    logp, old, adv, mask = rollout["logp"], rollout["old"], rollout["adv"], rollout["mask"]
    eps = 0.5  # wide enough that some sequences clip and some do not

    def direct(lp):
        s = jnp.exp(jnp.sum((lp - old) * mask, 1) / jnp.sum(mask, 1))
        return jnp.mean(jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - eps, 1 + eps)))

    def token_form(lp):
        return policy_loss(lp, old, adv, mask, ratio_level="sequence", aggregation="seq_mean_token_mean", clip_low=eps)[
            0
        ]

    (l1, g1), (l2, g2) = jax.jit(lambda lp: (jax.value_and_grad(direct)(lp), jax.value_and_grad(token_form)(lp)))(logp)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-7)


def test_kl_estimators_hand_values():
    """x = ref - logp = log 2: k1 = -log 2, k2 = (log 2)^2 / 2 = 0.2402265, k3 = 2 - 1 - log 2 = 0.3068528.
    d k3 / d logp = 1 - e^x = -1."""
    logp, ref = jnp.array([[-2.0]]), jnp.array([[-2.0 + LOG(2.0)]])
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [[-LOG(2.0)]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), [[0.2402265]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [[0.3068528]], rtol=1e-6)
    # In the loss: on-policy, A = 0, so loss = kl_coef * k3 and the gradient is kl_coef * (1 - e^x) = -0.1.
    f = lambda lp: policy_loss(lp, None, jnp.zeros(1), jnp.ones((1, 1)), ref_logp=ref, kl_coef=0.1)  # noqa: E731
    (loss, aux), g = jax.value_and_grad(f, has_aux=True)(logp)
    np.testing.assert_allclose([loss, g[0, 0], aux.kl_loss], [0.03068528, -0.1, 0.3068528], rtol=1e-5)


def test_entropy_bonus():
    """A = 0: loss = -c mean(H) = -0.1 * 2 = -0.2; gradient wrt H is -c / N = -0.05 per counted token."""
    ent = jnp.array([[1.0, 3.0]])
    f = lambda h: policy_loss(
        jnp.full((1, 2), -1.0),
        None,
        jnp.zeros(1),
        jnp.ones((1, 2)),  # noqa: E731
        entropy=h,
        entropy_coef=0.1,
    )
    (loss, aux), g = jax.value_and_grad(f, has_aux=True)(ent)
    np.testing.assert_allclose([loss, aux.entropy], [-0.2, 2.0], rtol=1e-6)
    np.testing.assert_allclose(g, [[-0.05, -0.05]], rtol=1e-6)


def _is_case(is_correction, engine_delta, **kw):
    """Two one-token sequences, on-policy (r = 1, A = 1, term -1 each), old - eng = engine_delta per row."""
    old = jnp.full((2, 1), -1.0)
    eng = old - jnp.array(engine_delta)[:, None]
    return policy_loss(old, old, jnp.ones(2), jnp.ones((2, 1)), engine_logp=eng, is_correction=is_correction, **kw)


def test_truncated_and_masked_importance_sampling_hand_values():
    """Weights w = exp(old - eng) = (3, 1.5).
    tis, cap 2: w = (2, 1.5), loss = mean(-w) = -1.75; is_ratio_mean 2.25, max 3.
    mis, [0.5, 2]: w = (0, 1.5), loss = -0.75 (masked token stays in the denominator); frac masked 0.5.
    mismatch k3 with x = log w: mean(3 - 1 - log 3, 1.5 - 1 - log 1.5) = (0.9013877 + 0.0945349) / 2.
    """
    delta = [LOG(3.0), LOG(1.5)]
    loss, aux = _is_case("tis", delta, is_high=2.0)
    np.testing.assert_allclose([loss, aux.is_ratio_mean, aux.is_ratio_max], [-1.75, 2.25, 3.0], rtol=1e-6)
    np.testing.assert_allclose(aux.mismatch_kl, (0.9013877 + 0.0945349) / 2, rtol=1e-6)
    np.testing.assert_allclose(aux.mult_prob_error, 2.25, rtol=1e-6)
    loss, aux = _is_case("mis", delta, is_low=0.5, is_high=2.0)
    np.testing.assert_allclose([loss, aux.frac_is_masked], [-0.75, 0.5], rtol=1e-6)
    # is (untruncated): w = (3, 1.5), loss = -2.25 whatever the cap.
    loss, aux = _is_case("is", delta, is_high=2.0)
    np.testing.assert_allclose([loss, aux.frac_is_masked], [-2.25, 0.0], rtol=1e-6)


def test_sequence_level_weights_and_sequence_drop():
    """One sequence of 2 tokens with old - eng = (log 2, log 2) and one with (0, 0); on-policy, A = 1.
    sequence level: w = exp(sum) = 4 -> capped at 3; geometric: w = exp(mean) = 2.
    token_mean over 4 tokens: sequence-level tis -> (-3 - 3 - 1 - 1) / 4 = -2; geometric -> -1.5.
    Dropping sequences with mean exp(|old - eng|) > 1.5 removes the first (error 2): loss = -1 over 2 tokens.
    """
    old = jnp.full((2, 2), -1.0)
    eng = old - jnp.array([[LOG(2.0)] * 2, [0.0, 0.0]])
    f = functools.partial(policy_loss, old, old, jnp.ones(2), jnp.ones((2, 2)), engine_logp=eng)
    np.testing.assert_allclose(f(is_correction="tis", is_level="sequence", is_high=3.0)[0], -2.0, rtol=1e-6)
    np.testing.assert_allclose(f(is_correction="tis", is_level="geometric", is_high=3.0)[0], -1.5, rtol=1e-6)
    loss, aux = f(max_seq_mult_prob_error=1.5)
    np.testing.assert_allclose(
        [loss, aux.frac_seq_dropped, aux.token_count, aux.seq_count], [-1.0, 0.5, 2.0, 1.0], rtol=1e-6
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_microbatch_denominator_is_exact(rollout, aggregation):
    """Loss of the batch = sum of micro-batch losses with the global token / sequence count as denominator."""
    f = jax.jit(lambda lp, old, adv, m, den: policy_loss(lp, old, adv, m, aggregation=aggregation, denominator=den)[0])
    r = rollout
    full = f(r["logp"], r["old"], r["adv"], r["mask"], None)
    den = jnp.sum(r["mask"]) if aggregation == "token_mean" else jnp.float32(4)
    halves = [f(r["logp"][s], r["old"][s], r["adv"][s], r["mask"][s], den) for s in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(halves[0] + halves[1], full, rtol=1e-6)


def test_jit_equals_eager_and_check_grads(rollout):
    """Away from the clip boundaries the loss is smooth in logp; check_grads passes.

    The sequence level is checked with seq_mean_token_mean, where the token-form gradient is the
    gradient of the loss value (see test_gspo_gradient_is_the_sequence_objective); under other
    aggregations, or with per-token weights inside a sequence, GSPO-token's gradient is by design
    that of its surrogate, not of the value; so the sequence case uses sequence-level IS weights.
    """
    mask = rollout["mask"]
    eager, eager_aux = _full(rollout, rollout["logp"], mask)
    jitted, jit_aux = jax.jit(functools.partial(_full, rollout))(rollout["logp"], mask)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(eager_aux), jax.tree.leaves(jit_aux)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for level, agg, is_level in (
        ("token", "token_mean", "token"),
        ("token", "seq_mean_token_sum_norm", "token"),
        ("sequence", "seq_mean_token_mean", "geometric"),
    ):
        f = jax.jit(lambda lp: _full(rollout, lp, mask, ratio_level=level, aggregation=agg, is_level=is_level)[0])
        check_grads(f, (rollout["logp"],), order=1, modes=("rev",), eps=1e-3, atol=1e-2, rtol=1e-2)


def test_garbage_in_padding_is_ignored(rollout):
    """-inf / NaN at masked positions (padding from an engine) change neither loss nor gradient."""
    mask = rollout["mask"]
    pad = mask == 0
    dirty = dict(
        rollout,
        old=jnp.where(pad, jnp.nan, rollout["old"]),
        ref=jnp.where(pad, jnp.inf, rollout["ref"]),
        engine=jnp.where(pad, jnp.nan, rollout["engine"]),
        entropy=jnp.where(pad, jnp.nan, rollout["entropy"]),
    )
    f = lambda r, lp: jax.value_and_grad(lambda lp: _full(r, lp, mask, max_seq_mult_prob_error=3.0)[0])(lp)  # noqa: E731
    (l_clean, g_clean), (l_dirty, g_dirty) = jax.jit(
        lambda lp: (f(rollout, lp), f(dirty, jnp.where(pad, -jnp.inf, lp)))
    )(rollout["logp"])
    np.testing.assert_allclose(l_dirty, l_clean, rtol=1e-6)
    np.testing.assert_allclose(g_dirty, g_clean, rtol=1e-6)
    assert np.all(np.asarray(g_dirty)[np.asarray(pad)] == 0.0)


def test_empty_mask_gives_zero_not_nan(rollout):
    loss, aux = _full(rollout, rollout["logp"], jnp.zeros_like(rollout["mask"]))
    assert float(loss) == 0.0
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(aux))


def test_bad_inputs_raise_clear_errors(rollout):
    r = rollout
    args = (r["logp"], r["old"], r["adv"], r["mask"])
    cases = [
        (dict(objective="ppo2"), "objective must be one of"),
        (dict(aggregation="mean"), "aggregation must be one of"),
        (dict(ratio_level="seq"), "ratio_level must be one of"),
        (dict(kl_coef=0.1), "needs ref_logp"),
        (dict(entropy_coef=0.1), "needs entropy"),
        (dict(is_correction="tis"), "pass engine_logp"),
        (dict(dual_clip=0.5), "dual_clip must be > 1"),
        (dict(objective="cispo", dual_clip=3.0), "objective='ppo' only"),
        (dict(norm_constant=10.0), "seq_mean_token_sum_norm"),
        (dict(denominator=0), "denominator must be > 0"),
        (dict(engine_logp=r["engine"], is_correction="tis", is_low=0.5), "is_low is a masking bound"),
        (dict(engine_logp=r["engine"], max_seq_mult_prob_error=0.5), ">= 1"),
        (dict(kl_estimator="k4", ref_logp=r["ref"]), "kl_estimator must be one of"),
        (dict(clip_low=-0.1), "clip_low and clip_high"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            policy_loss(*args, **kw)
    with pytest.raises(ValueError, match="advantages must be per sequence"):
        policy_loss(r["logp"], r["old"], r["adv"][:2], r["mask"])
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(r["logp"], r["old"][:, :2], r["adv"], r["mask"])


def _numpy_reference(
    r,
    *,
    objective,
    ratio_level,
    aggregation,
    dual_clip,
    is_correction,
    clip_low=0.2,
    clip_high=0.28,
    kl_coef=0.05,
    is_low=0.5,
    is_high=1.5,
):
    """Independent float64 loop over sequences and tokens, written from the papers' formulas."""
    keys = ("logp", "old", "ref", "engine", "adv", "mask")
    logp, old, ref, eng, adv, mask = (np.asarray(r[k], np.float64) for k in keys)
    b, l = logp.shape
    per_token = np.zeros((b, l))
    for i in range(b):
        toks = [t for t in range(l) if mask[i, t] > 0]
        seq_ratio = np.exp(np.mean([logp[i, t] - old[i, t] for t in toks]))
        for t in toks:
            ratio = np.exp(logp[i, t] - old[i, t]) if ratio_level == "token" else seq_ratio
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            a = adv[i]
            if objective == "ppo":
                term = max(-a * ratio, -a * clipped)
                if dual_clip is not None and a < 0:
                    term = min(term, -a * dual_clip)
            else:
                term = -clipped * a * logp[i, t]
            w = np.exp(old[i, t] - eng[i, t])
            if is_correction == "is":
                pass
            elif is_correction == "tis":
                w = min(w, is_high)
            elif is_correction == "mis":
                w = w if is_low <= w <= is_high else 0.0
            else:
                w = 1.0
            x = ref[i, t] - logp[i, t]
            per_token[i, t] = w * term + kl_coef * (np.exp(x) - 1 - x)
    sums, counts = (per_token * mask).sum(1), mask.sum(1)
    n_seq = np.sum(counts > 0)
    if aggregation == "token_mean":
        return sums.sum() / counts.sum()
    if aggregation == "seq_mean_token_mean":
        return np.sum(sums[counts > 0] / counts[counts > 0]) / n_seq
    if aggregation == "seq_mean_token_sum":
        return sums.sum() / n_seq
    return sums.sum() / n_seq / l


@pytest.mark.parametrize(
    "objective,ratio_level,aggregation,dual_clip,is_correction",
    [
        ("ppo", "token", "token_mean", None, None),
        ("ppo", "token", "seq_mean_token_mean", 3.0, "tis"),
        ("ppo", "sequence", "seq_mean_token_mean", None, "mis"),
        ("ppo", "sequence", "seq_mean_token_sum", 3.0, None),
        ("ppo", "token", "seq_mean_token_sum_norm", None, "mis"),
        ("cispo", "token", "token_mean", None, "tis"),
        ("ppo", "token", "token_mean", None, "is"),
        ("cispo", "sequence", "seq_mean_token_sum_norm", None, None),
    ],
)
def test_matches_independent_numpy_reference(rollout, objective, ratio_level, aggregation, dual_clip, is_correction):
    r = dict(rollout, adv=jnp.array([1.5, -2.0, 0.7, -0.4]))
    loss, _ = policy_loss(
        r["logp"],
        r["old"],
        r["adv"],
        r["mask"],
        objective=objective,
        ratio_level=ratio_level,
        aggregation=aggregation,
        dual_clip=dual_clip,
        clip_low=0.2,
        clip_high=0.28,
        ref_logp=r["ref"],
        kl_coef=0.05,
        engine_logp=r["engine"],
        is_correction=is_correction,
        is_low=0.5 if is_correction == "mis" else 0.0,
        is_high=1.5,
    )
    want = _numpy_reference(
        r,
        objective=objective,
        ratio_level=ratio_level,
        aggregation=aggregation,
        dual_clip=dual_clip,
        is_correction=is_correction,
    )
    np.testing.assert_allclose(loss, want, rtol=2e-6)


def test_the_options_travel_as_one_group(rollout):
    """policy_loss takes PolicyLossConfig whole, or an algo.grpo config (which extends it), and
    keyword options on top; each gives the loss of the same options spelled out."""
    import dataclasses

    from ptrain.config import PolicyLossConfig
    from ptrain.config.grpo import GRPOAlgoConfig

    r = rollout
    args = (r["logp"], r["old"], r["adv"], r["mask"])
    opts = dict(clip_low=0.1, clip_high=0.3, aggregation="seq_mean_token_mean", kl_coef=0.05)
    want, _ = policy_loss(*args, ref_logp=r["ref"], **opts)
    group, _ = policy_loss(*args, ref_logp=r["ref"], cfg=PolicyLossConfig(**opts))
    grpo, _ = policy_loss(*args, ref_logp=r["ref"], engine_logp=r["engine"],
                          cfg=GRPOAlgoConfig(**opts, is_correction=None))  # fmt: skip
    override, _ = policy_loss(*args, ref_logp=r["ref"], cfg=PolicyLossConfig(clip_low=0.9), **opts)
    for got in (group, grpo, override):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    loss_fields = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    assert loss_fields <= {f.name for f in dataclasses.fields(GRPOAlgoConfig)}
    with pytest.raises(ValueError, match=r"unknown policy-loss option\(s\) \['clip'\]"):
        policy_loss(*args, clip=0.2)


def test_the_group_checks_itself_once_for_the_config_and_the_loss():
    from ptrain.config import PolicyLossConfig

    bad = PolicyLossConfig(kl_clamp=-1.0, aggregation="mean")
    fields = [f for f, _ in bad.problems()]
    assert fields == ["aggregation", "kl_clamp"]
    assert PolicyLossConfig().problems() == []
