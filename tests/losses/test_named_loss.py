"""The training client's named losses against values derived by hand (ptrain.losses.named)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptrain.losses.named import loss_config, named_loss

# Two datums of three positions; the second has one padding position.
LOGP = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -1.5, 0.0]])
Q = jnp.array([[-1.2, -1.9, -0.5], [-0.5, -1.0, 0.0]])
ADV = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
VALID = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def run(name, config=None, **extra):
    inputs = {"logprobs": Q, "advantages": ADV, **extra}
    return named_loss(name, LOGP, inputs, VALID, loss_config(name, config))


def test_importance_sampling_is_minus_the_summed_ratio_times_advantage():
    r = np.exp(np.array([[0.2, -0.1, 0.0], [0.2, -0.5, 0.0]]))
    expected = -(r[0].sum() * 1.0 + (r[1, :2] * -2.0).sum())
    loss, m = run("importance_sampling")
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(m["tokens"]) == 5


def test_ppo_clips_the_ratio_at_the_thresholds_on_the_pessimistic_side():
    r = np.exp(np.array([[0.2, -0.1, 0.0], [0.2, -0.5, 0.0]]))
    clipped = np.clip(r, 0.9, 1.1)
    a = np.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    per = np.minimum(r * a, clipped * a)
    loss, m = run("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert float(loss) == pytest.approx(-(per[0].sum() + per[1, :2].sum()), abs=1e-6)
    # Token (0, 0) gains with r = e^0.2 > 1.1 (clipped high); token (1, 1) has A < 0 and r = e^-0.5 < 0.9.
    assert float(m["clip_frac_high"]) == pytest.approx(1 / 5)
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 5)


def test_cispo_weights_the_log_prob_by_the_clipped_ratio_without_its_gradient():
    r = np.exp(np.array([[0.2, -0.1, 0.0], [0.2, -0.5, 0.0]]))
    w = np.clip(r, 0.8, 1.2)
    a = np.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    lp = np.asarray(LOGP)
    expected = -((w * a * lp)[0].sum() + (w * a * lp)[1, :2].sum())
    assert float(run("cispo")[0]) == pytest.approx(expected, rel=1e-6)
    grad = jax.grad(lambda x: named_loss("cispo", x, {"logprobs": Q, "advantages": ADV}, VALID,
                                         loss_config("cispo", None))[0])(LOGP)  # fmt: skip
    np.testing.assert_allclose(grad, -(w * a) * np.asarray(VALID), rtol=1e-6)


def test_gspo_uses_one_ratio_per_sequence_over_the_weighted_positions():
    # Row 0 counts its first two positions only: s = exp(mean(0.2, -0.1)) = e^0.05, inside [0.8, 1.2].
    weights = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    s0, s1 = np.exp(0.05), np.exp((0.2 - 0.5) / 2)
    expected = -(2 * s0 * 1.0 + 2 * min(s1 * -2.0, max(s1, 0.8) * -2.0))
    assert float(run("gspo", weights=weights)[0]) == pytest.approx(expected, rel=1e-6)


def test_dro_penalises_the_squared_log_ratio():
    lp, q = np.asarray(LOGP), np.asarray(Q)
    a = np.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    per = a * lp - 0.5 * 0.4 * (lp - q) ** 2
    assert float(run("dro", {"beta": 0.4})[0]) == pytest.approx(-(per[0].sum() + per[1, :2].sum()), abs=1e-6)


def test_cross_entropy_is_the_weighted_negative_log_likelihood():
    w = jnp.array([[0.0, 1.0, 0.5], [2.0, 1.0, 9.0]])  # the padding position's weight never counts
    loss, m = named_loss("cross_entropy", LOGP, {"weights": w}, VALID, {})
    assert float(loss) == pytest.approx(2.0 + 0.25 + 0.6 + 1.5, rel=1e-6)
    assert float(m["weight_sum"]) == pytest.approx(4.5)


@pytest.mark.parametrize(
    "name, config, message",
    [
        ("ppo", {"clip_low_threshold": 1.2}, r"0 <= clip_low_threshold <= 1 <= clip_high_threshold"),
        ("ppo", {"eps": 0.2}, r"\['eps'\] are not options of 'ppo'"),
        ("dro", {}, r"'dro' needs loss_fn_config=\{'beta'"),
        ("dro", {"beta": "x"}, r"must be a number"),
        ("kto", {}, "unknown loss_fn 'kto'"),
    ],
)
def test_bad_configs_name_the_key(name, config, message):
    with pytest.raises(ValueError, match=message):
        loss_config(name, config)
