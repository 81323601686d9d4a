"""Preference losses: hand-derived values per kind, gradient signs, invariances, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ptrain.losses import PREFERENCE_KINDS, preference_loss

SP1 = np.log1p(np.exp(-1.0))  # softplus(-1) = -log sigma(1) = 0.3132617
SP1P = np.log1p(np.exp(1.0))  # softplus(1) = -log sigma(-1) = 1.3132617

# A pair where the policy raised the chosen log-prob by 1 and lowered the rejected one by 1:
# rho_w = -3 - (-4) = 1, rho_l = -5 - (-4) = -1, h = rho_w - rho_l = 2.
PC, PR, RC, RR = -3.0, -5.0, -4.0, -4.0


def _loss(kind, pc=PC, pr=PR, rc=RC, rr=RR, **kw):
    v = lambda x: jnp.array([x], jnp.float32)  # noqa: E731
    ref = {} if kind in ("simpo", "orpo") else dict(ref_chosen_logps=v(rc), ref_rejected_logps=v(rr))
    loss, aux = preference_loss(v(pc), v(pr), kind=kind, **ref, **kw)
    return float(loss[0]), aux


def test_sigmoid_dpo_hand_value():
    """beta = 0.5: loss = -log sigma(0.5 * 2) = softplus(-1) = 0.3132617; rewards 0.5 and -0.5."""
    loss, aux = _loss("sigmoid", beta=0.5)
    np.testing.assert_allclose(loss, SP1, rtol=1e-6)
    np.testing.assert_allclose([aux.chosen_rewards[0], aux.rejected_rewards[0], aux.margin[0]], [0.5, -0.5, 1.0])
    assert float(aux.accuracy[0]) == 1.0


def test_conservative_and_robust_dpo_hand_values():
    """eps = 0.1, x = beta h = 1.

    cDPO (sigmoid + smoothing): 0.9 softplus(-1) + 0.1 softplus(1) = 0.2819355 + 0.1313262 = 0.4132617
    rDPO (robust): (0.9 softplus(-1) - 0.1 softplus(1)) / 0.8 = (0.2819355 - 0.1313262) / 0.8 = 0.1882617
    """
    np.testing.assert_allclose(_loss("sigmoid", beta=0.5, label_smoothing=0.1)[0], 0.9 * SP1 + 0.1 * SP1P, rtol=1e-6)
    np.testing.assert_allclose(_loss("sigmoid", beta=0.5, label_smoothing=0.1)[0], 0.4132617, rtol=1e-6)
    np.testing.assert_allclose(_loss("robust", beta=0.5, label_smoothing=0.1)[0], 0.1882617, rtol=1e-5)
    # With eps = 0 both reduce to DPO.
    np.testing.assert_allclose(_loss("robust", beta=0.5)[0], SP1, rtol=1e-6)


def test_ipo_and_hinge_hand_values():
    """IPO: (h - 1/(2 beta))^2 = (2 - 1)^2 = 1 at beta = 0.5; (2 - 0.5)^2 = 2.25 at beta = 1.
    hinge: max(0, 1 - beta h) = 0 at beta = 0.5, 0.5 at beta = 0.25.
    """
    np.testing.assert_allclose(_loss("ipo", beta=0.5)[0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(_loss("ipo", beta=1.0)[0], 2.25, rtol=1e-6)
    np.testing.assert_allclose(_loss("hinge", beta=0.5)[0], 0.0, atol=1e-7)
    np.testing.assert_allclose(_loss("hinge", beta=0.25)[0], 0.5, rtol=1e-6)


def test_length_normalised_kinds_hand_values():
    """Counts |y_w| = 2, |y_l| = 4.

    dpo_norm, beta 2: rho_w = 1/2, rho_l = -1/4, x = 2 * 0.75 = 1.5, loss = softplus(-1.5) = 0.2014133;
      rewards 1.0 and -0.5.
    simpo, beta 2, gamma 0.5, pc = -2, pr = -8: x = 2 (-1 - (-2)) - 0.5 = 1.5 -> 0.2014133 again.
    rpo, alpha 0.5 (counts 2 / 4): DPO loss softplus(-1) at beta 0.5 plus 0.5 * (3 / 2) = 1.0632617.
    """
    counts = dict(chosen_token_counts=jnp.array([2.0]), rejected_token_counts=jnp.array([4.0]))
    loss, aux = _loss("dpo_norm", beta=2.0, **counts)
    np.testing.assert_allclose(loss, np.log1p(np.exp(-1.5)), rtol=1e-6)
    np.testing.assert_allclose([aux.chosen_rewards[0], aux.rejected_rewards[0]], [1.0, -0.5], rtol=1e-6)
    loss, aux = _loss("simpo", pc=-2.0, pr=-8.0, beta=2.0, gamma=0.5, **counts)
    np.testing.assert_allclose(loss, 0.2014133, rtol=1e-5)
    np.testing.assert_allclose([aux.chosen_rewards[0], aux.rejected_rewards[0]], [-2.0, -4.0], rtol=1e-6)
    loss, aux = _loss("rpo", beta=0.5, nll_weight=0.5, **counts)
    np.testing.assert_allclose(loss, SP1 + 0.75, rtol=1e-6)
    np.testing.assert_allclose(aux.chosen_nll[0], 1.5, rtol=1e-6)


def test_orpo_hand_value():
    """Average log-probs a_w = log 1/2 (odds 1, log-odds 0), a_l = log 1/5 (odds 1/4, log-odds -log 4).

    loss = -a_w - lambda log sigma(0 + log 4) = log 2 - 0.1 log(4/5) = 0.6931472 + 0.0223144 = 0.7154616.
    """
    counts = dict(chosen_token_counts=jnp.array([2.0]), rejected_token_counts=jnp.array([3.0]))
    loss, aux = _loss("orpo", pc=2 * np.log(0.5), pr=3 * np.log(0.2), beta=0.1, **counts)
    np.testing.assert_allclose(loss, 0.7154616, rtol=1e-6)
    np.testing.assert_allclose(aux.chosen_nll[0], np.log(2.0), rtol=1e-6)


def _grads(kind, pc, pr, **kw):
    """d loss / d (policy_chosen, policy_rejected, ref_chosen, ref_rejected) at one example."""

    def f(pc, pr, rc, rr):
        return preference_loss(pc, pr, rc, rr, kind=kind, **kw)[0].sum()

    x = lambda v: jnp.array([v], jnp.float32)  # noqa: E731
    return [float(g[0]) for g in jax.grad(f, argnums=(0, 1, 2, 3))(x(pc), x(pr), x(RC), x(RR))]


def test_dpop_hand_values():
    """DPO-Positive = DPO while the chosen log-prob is at or above the reference's.

    At (PC, RC) = (-3, -4), rho_w = 1 > 0: no penalty, loss = softplus(-1) at beta 0.5.
    With pc = -4.5 (rho_w = -0.5, h = -0.5 + 1 = 0.5), lambda 2: logit 0.5 * (0.5 - 2 * 0.5)
    = -0.25, loss = softplus(0.25) = 0.8259394; plain DPO would give softplus(-0.25) = 0.5759394.
    The gradient on the chosen log-prob grows by the penalty: dL/d pi_w = -beta (1 + lambda)
    sigma(-x) = -0.5 * 3 * sigma(0.25) = -0.8341529 (plain DPO: -0.5 sigma(-0.25) = -0.2189...).
    """
    loss, _ = _loss("dpop", beta=0.5, dpop_lambda=2.0)
    np.testing.assert_allclose(loss, SP1, rtol=1e-6)
    loss, _ = _loss("dpop", pc=-4.5, beta=0.5, dpop_lambda=2.0)
    np.testing.assert_allclose(loss, np.log1p(np.exp(0.25)), rtol=1e-6)
    gw, gl, *_ = _grads("dpop", -4.5, PR, beta=0.5, dpop_lambda=2.0)
    np.testing.assert_allclose(gw, -0.5 * 3 / (1 + np.exp(-0.25)), rtol=1e-5)
    np.testing.assert_allclose(gl, 0.5 / (1 + np.exp(-0.25)), rtol=1e-5)
    with pytest.raises(ValueError, match="dpop_lambda"):
        _loss("dpop", dpop_lambda=-1.0)


def test_dpo_and_ipo_gradient_signs():
    """Minimising must raise the chosen and lower the rejected log-prob; the reference gets none.

    DPO: dL/d pi_w = -beta sigma(-beta h) < 0 and dL/d pi_l = +beta sigma(-beta h) > 0 always;
    at h = 2, beta = 0.5: -0.5 sigma(-1) = -0.1344707.
    IPO: dL/d pi_w = 2 (h - 1/(2 beta)), negative below the target margin 1/(2 beta) and
    positive above it (IPO pulls h back to the margin instead of pushing it to infinity).
    """
    gw, gl, grw, grl = _grads("sigmoid", PC, PR, beta=0.5)
    np.testing.assert_allclose([gw, gl], [-0.1344707, 0.1344707], rtol=1e-5)
    assert grw == 0.0 and grl == 0.0
    gw, gl, *_ = _grads("ipo", PC, PR, beta=0.1)  # h = 2 < 1 / 0.2 = 5
    assert gw < 0 < gl
    np.testing.assert_allclose(gw, 2 * (2 - 5), rtol=1e-6)
    gw, gl, *_ = _grads("ipo", PC, PR, beta=1.0)  # h = 2 > 0.5
    assert gw > 0 > gl
    for kind in ("robust", "hinge"):
        gw, gl, *_ = _grads(kind, -4.0, -4.0, beta=0.5, **({"label_smoothing": 0.1} if kind == "robust" else {}))
        assert gw < 0 < gl, kind


def test_dpo_invariant_to_shared_offsets():
    """Only log-ratios matter: adding c to a completion's policy and reference log-probs changes nothing."""
    base, _ = _loss("sigmoid", beta=0.3)
    shifted, _ = _loss("sigmoid", pc=PC + 7.0, rc=RC + 7.0, pr=PR - 3.0, rr=RR - 3.0, beta=0.3)
    np.testing.assert_allclose(shifted, base, rtol=1e-6)


@pytest.fixture(scope="module")
def pairs():
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    lp = lambda key: -20.0 * jax.random.uniform(key, (4,)) - 1.0  # noqa: E731
    return dict(
        pc=lp(k[0]),
        pr=lp(k[1]),
        rc=lp(k[2]),
        rr=lp(k[3]),
        counts=dict(chosen_token_counts=jnp.array([3.0, 5, 8, 2]), rejected_token_counts=jnp.array([4.0, 5, 2, 9])),
    )


@pytest.mark.parametrize("kind", PREFERENCE_KINDS)
def test_check_grads_jit_equals_eager_and_extremes(pairs, kind):
    kw = dict(kind=kind, beta=0.2, **pairs["counts"])
    if kind in ("robust", "sigmoid"):
        kw["label_smoothing"] = 0.1
    if kind == "simpo":
        kw["gamma"] = 0.3

    def f(pc, pr, rc, rr):
        ref = (None, None) if kind in ("simpo", "orpo") else (rc, rr)
        return preference_loss(pc, pr, *ref, **kw)

    args = (pairs["pc"], pairs["pr"], pairs["rc"], pairs["rr"])
    eager_loss, eager_aux = f(*args)
    jit_loss, jit_aux = jax.jit(f)(*args)
    np.testing.assert_allclose(eager_loss, jit_loss, rtol=1e-6)
    np.testing.assert_allclose(eager_aux.margin, jit_aux.margin, rtol=1e-6)
    # Only the policy log-probs: the reference ones are constants (stop_gradient) by design.
    # (The seed keeps hinge's beta * h = 1 kink more than eps away from every example.)
    policy_only = jax.jit(lambda pc, pr: f(pc, pr, args[2], args[3])[0].sum())
    check_grads(policy_only, args[:2], order=1, modes=("rev",), eps=1e-2, atol=1e-2, rtol=1e-2)
    # Log-probs of very long sequences (-1e4) keep every kind finite, loss and gradient.
    big = tuple(a * 500.0 for a in args)
    loss, _ = f(*big)
    grads = jax.grad(lambda *a: f(*a)[0].sum(), argnums=(0, 1))(*big)
    assert np.all(np.isfinite(loss)) and all(np.all(np.isfinite(g)) for g in grads), kind


def test_bad_inputs_raise_clear_errors(pairs):
    pc, pr, rc, rr = pairs["pc"], pairs["pr"], pairs["rc"], pairs["rr"]
    with pytest.raises(ValueError, match="kind must be one of"):
        preference_loss(pc, pr, rc, rr, kind="kto")
    with pytest.raises(ValueError, match="pass ref_chosen_logps"):
        preference_loss(pc, pr, kind="sigmoid")
    with pytest.raises(ValueError, match="or neither"):
        preference_loss(pc, pr, rc, None)
    with pytest.raises(ValueError, match="chosen_token_counts"):
        preference_loss(pc, pr, kind="simpo")
    with pytest.raises(ValueError, match="label_smoothing applies"):
        preference_loss(pc, pr, rc, rr, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        preference_loss(pc, pr, rc, rr, kind="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="per-example vector"):
        preference_loss(pc, pr[:2], rc, rr)
