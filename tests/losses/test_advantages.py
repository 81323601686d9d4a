"""Group advantages: hand-derived values, zero-std groups, the invalid-tool-call override, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from ptrain.config import AdvantageConfig
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
    adv, _ = group_advantages(r, cfg=AdvantageConfig(normalize_std=False))
    np.testing.assert_allclose(adv, [[2 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
    loo, _ = group_advantages(r, cfg=AdvantageConfig(baseline="leave_one_out", normalize_std=False))
    np.testing.assert_allclose(loo, [[1.0, -0.5, -0.5]], rtol=1e-6)
    loo_std, _ = group_advantages(r, cfg=AdvantageConfig(baseline="leave_one_out"), eps=0.0)
    np.testing.assert_allclose(loo_std, np.array([[1.0, -0.5, -0.5]]) / np.sqrt(1 / 3), rtol=1e-6)


def test_all_equal_groups_get_exact_zero_and_are_counted():
    """0.3 is not exact in binary: the mean of (0.3, 0.3, 0.3) can differ from 0.3 by rounding, and
    that noise divided by eps would be a spurious advantage; equal groups must give exactly 0."""
    r = jnp.array([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 1.0, 0.25], [0.7, 0.7, 0.7]])
    for kw in (dict(), dict(baseline="leave_one_out"), dict(normalize_std=False)):
        adv, aux = group_advantages(r, cfg=AdvantageConfig(**kw))
        assert np.all(np.asarray(adv)[[0, 1, 3]] == 0.0)
        assert np.all(np.asarray(adv)[2] != 0.0)
        np.testing.assert_allclose(aux.frac_zero_std, 0.75)


def test_advantages_sum_to_zero_per_group():
    r = jnp.array([[0.1, 2.0, -1.0, 0.5, 3.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    for kw in (dict(), dict(baseline="leave_one_out")):
        adv, _ = group_advantages(r, cfg=AdvantageConfig(**kw))
        np.testing.assert_allclose(np.asarray(adv).sum(1), 0.0, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="reshape"):
        group_advantages(jnp.zeros(8))
    with pytest.raises(ValueError, match="baseline must be one of"):
        group_advantages(jnp.zeros((2, 4)), cfg=AdvantageConfig(baseline="median"))
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(jnp.zeros((2, 4)), ddof=2)


def test_invalid_tool_call_samples_get_the_configured_advantage():
    """Nemotron 3's override: flagged samples get the configured advantage, the others keep the
    group-relative one (the group statistics still come from every reward); unset, the flags
    change nothing."""
    r = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    invalid = jnp.array([[False, True, False, False], [True, False, False, False]])
    plain, plain_aux = group_advantages(r, eps=0.0)
    adv, aux = group_advantages(r, cfg=AdvantageConfig(invalid_tool_call_advantage=-5.0), invalid_BxG=invalid, eps=0.0)
    np.testing.assert_allclose(adv, np.where(invalid, -5.0, plain), rtol=1e-6)
    np.testing.assert_allclose([aux.reward_std, aux.frac_zero_std], [plain_aux.reward_std, 0.5], rtol=1e-6)
    np.testing.assert_allclose(aux.advantage_abs_mean, np.abs(np.asarray(adv)).mean(), rtol=1e-6)
    unset, _ = group_advantages(r, invalid_BxG=invalid, eps=0.0)
    np.testing.assert_array_equal(unset, plain)
    with pytest.raises(ValueError, match="invalid_BxG"):
        group_advantages(r, cfg=AdvantageConfig(invalid_tool_call_advantage=-5.0), invalid_BxG=invalid[:, :2])


def test_bad_options_raise_the_config_checks_message():
    """The function checks its group with AdvantageConfig.advantage_problems, as the config does."""
    cfg = AdvantageConfig(baseline="median", invalid_tool_call_advantage=float("nan"))
    assert [f for f, _ in cfg.advantage_problems()] == ["baseline", "invalid_tool_call_advantage"]
    assert AdvantageConfig().advantage_problems() == []
    with pytest.raises(ValueError, match="invalid_tool_call_advantage must be a finite number"):
        group_advantages(jnp.zeros((2, 4)), cfg=AdvantageConfig(invalid_tool_call_advantage=float("inf")))
