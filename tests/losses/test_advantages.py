"""Group advantages: hand-derived values, zero-std groups, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from ptrain.losses import group_advantages


def test_mean_baseline_with_std_hand_values():
    """Rewards (1, 0, 1, 0): mean 1/2, sample std sqrt(((1/2)^2 * 4) / 3) = sqrt(1/3) = 0.5773503,
    so A = +-0.5 / (0.5773503 + eps) = +-0.8660254 (eps 1e-6 shifts the 7th digit)."""
    adv, aux = group_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]]), eps=0.0)
    np.testing.assert_allclose(adv, [[0.8660254, -0.8660254, 0.8660254, -0.8660254]], rtol=1e-6)
    np.testing.assert_allclose([aux.reward_mean, aux.reward_std, aux.frac_zero_std], [0.5, 0.5773503, 0.0], rtol=1e-6)
    pop, _ = group_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]]), eps=0.0, ddof=0)  # population std 1/2
    np.testing.assert_allclose(pop, [[1.0, -1.0, 1.0, -1.0]], rtol=1e-6)


def test_dr_grpo_no_std_and_leave_one_out_hand_values():
    """Rewards (1, 0, 0): mean 1/3.
    no std: A = r - 1/3 = (2/3, -1/3, -1/3).
    leave-one-out: A_0 = 1 - mean(0, 0) = 1, A_1 = 0 - mean(1, 0) = -1/2, A_2 = -1/2
    (= 3/2 (r - 1/3)).
    """
    r = jnp.array([[1.0, 0.0, 0.0]])
    adv, _ = group_advantages(r, normalize_std=False)
    np.testing.assert_allclose(adv, [[2 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
    loo, _ = group_advantages(r, baseline="leave_one_out", normalize_std=False)
    np.testing.assert_allclose(loo, [[1.0, -0.5, -0.5]], rtol=1e-6)
    loo_std, _ = group_advantages(r, baseline="leave_one_out", eps=0.0)
    np.testing.assert_allclose(loo_std, np.array([[1.0, -0.5, -0.5]]) / np.sqrt(1 / 3), rtol=1e-6)


def test_all_equal_groups_get_exact_zero_and_are_counted():
    """0.3 is not exact in binary: the mean of (0.3, 0.3, 0.3) can differ from 0.3 by rounding, and
    that noise divided by eps would be a spurious advantage; equal groups must give exactly 0."""
    r = jnp.array([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 1.0, 0.25], [0.7, 0.7, 0.7]])
    for kw in (dict(), dict(baseline="leave_one_out"), dict(normalize_std=False)):
        adv, aux = group_advantages(r, **kw)
        assert np.all(np.asarray(adv)[[0, 1, 3]] == 0.0)
        assert np.all(np.asarray(adv)[2] != 0.0)
        np.testing.assert_allclose(aux.frac_zero_std, 0.75)


def test_advantages_sum_to_zero_per_group():
    r = jnp.array([[0.1, 2.0, -1.0, 0.5, 3.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    for kw in (dict(), dict(baseline="leave_one_out")):
        adv, _ = group_advantages(r, **kw)
        np.testing.assert_allclose(np.asarray(adv).sum(1), 0.0, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="reshape"):
        group_advantages(jnp.zeros(8))
    with pytest.raises(ValueError, match="baseline must be one of"):
        group_advantages(jnp.zeros((2, 4)), baseline="median")
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(jnp.zeros((2, 4)), ddof=2)
