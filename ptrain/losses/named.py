"""The named losses of `ptrain.TrainingClient` (Tinker's set), as sums over tokens.

Every loss here is a pure function of `[B, L]` arrays: the policy's log-probs of the target
tokens `logp` (differentiable) and the datum inputs, all aligned so that position t holds
the log-prob of `target_tokens[t]`. Each returns `(loss, metrics)`, the loss a plain *sum*
over tokens and datums (Tinker's `loss:sum`: scale `weights` or `advantages` yourself for
a mean). Notation: w = weights, q = the sampler's log-probs (`logprobs`), A = advantages,
r = exp(logp - q), m = the positions that count (below):

  cross_entropy        -sum w logp
  importance_sampling  -sum m r A                                      (REINFORCE with IS)
  ppo                  -sum m min(r A, clip(r, lo, hi) A)              Schulman et al. 1707.06347
  cispo                -sum m sg(clip(r, lo, hi)) A logp               MiniMax-M1 2506.13585
  gspo                 ppo with r_t = s_i exp(logp_t - sg(logp_t)),
                       s_i = exp(mean_{t in m} (logp - q))             Zheng et al. 2507.18071
  dro                  -sum m (A logp - beta/2 (logp - q)^2)           Richemond et al. 2405.19107

`lo` and `hi` are ratio thresholds (`loss_fn_config` keys `clip_low_threshold`, default 0.8,
and `clip_high_threshold`, default 1.2); dro needs `beta`. The RL losses count the positions
whose `weights` are positive when the datum carries `weights`, else every position: a prompt
position adds nothing to importance_sampling, ppo, cispo or dro because its advantage is 0,
but it would enter gspo's sequence mean, so pass `weights` for gspo.

importance_sampling, ppo, cispo and gspo are `ptrain.losses.policy_loss` with the ratio taken
against the sampler (old = q), no engine correction, and the sum aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ptrain.config.policy_loss import PolicyLossConfig
from ptrain.losses.policy import policy_loss

NAMED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
"""The loss names forward_backward accepts (beside a Python callable)."""

REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    **{name: ("target_tokens", "logprobs", "advantages") for name in NAMED_LOSSES[1:]},
}
"""Per-token inputs each loss needs in every datum's loss_fn_inputs."""

OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    **{name: ("weights",) for name in NAMED_LOSSES[1:]},
}

CONFIG_KEYS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
}
"""loss_fn_config keys each loss reads, with their defaults (None: required)."""


def loss_config(name: str, given: Mapping[str, Any] | None) -> dict[str, float]:
    """The loss's config with defaults filled; ValueError names an unknown or missing key."""
    if name not in CONFIG_KEYS:
        raise ValueError(f"unknown loss_fn '{name}'; pass one of {', '.join(NAMED_LOSSES)} or a callable")
    given = dict(given or {})
    known = CONFIG_KEYS[name]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"loss_fn_config {unknown} are not options of '{name}'; it takes {sorted(known) or 'none'}")
    out = {}
    for key, default in known.items():
        value = given.get(key, default)
        if value is None:
            raise ValueError(f"loss_fn '{name}' needs loss_fn_config={{'{key}': ...}}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"loss_fn_config['{key}'] must be a number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out:
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(
                f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold (ratio bounds), "
                f"got {lo} and {hi}"
            )
    if "beta" in out and not out["beta"] >= 0:
        raise ValueError(f"loss_fn_config['beta'] must be >= 0, got {out['beta']}")
    return out


def named_loss(
    name: str, logp_BxL: jax.Array, inputs: Mapping[str, jax.Array], valid_BxL: jax.Array, config: Mapping[str, float]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The summed loss `name` (module docstring) and its metrics (float32 scalars).

    inputs: the datums' per-token arrays `[B, L]` (padding positions hold zeros);
    valid_BxL: 1.0 on real datum positions, 0.0 on padding; config: `loss_config`'s output.
    """
    f32 = jnp.float32
    valid = valid_BxL.astype(f32)
    logp = jnp.where(valid > 0, logp_BxL.astype(f32), 0.0)
    if name == "cross_entropy":
        w = inputs["weights"].astype(f32) * valid
        loss = -jnp.sum(w * logp)
        return loss, {"loss:sum": loss, "weight_sum": jnp.sum(w)}
    q = inputs["logprobs"].astype(f32)
    adv = inputs["advantages"].astype(f32)
    mask = valid * (inputs["weights"].astype(f32) > 0) if "weights" in inputs else valid
    if name == "dro":
        beta = config["beta"]
        per_token = adv * logp - 0.5 * beta * jnp.square(logp - q)
        loss = -jnp.sum(per_token * mask)
        return loss, {"loss:sum": loss, "tokens": jnp.sum(mask)}
    if name == "importance_sampling":
        clip_low = clip_high = jnp.inf
    else:
        clip_low, clip_high = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
    cfg = PolicyLossConfig(
        objective="cispo" if name == "cispo" else "ppo",
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_level="sequence" if name == "gspo" else "token",
        aggregation="seq_mean_token_sum",
    )
    loss, aux = policy_loss(logp, q, adv, mask, cfg=cfg, denominator=1.0)
    metrics = {
        "loss:sum": loss,
        "tokens": aux.token_count,
        "ratio_mean": aux.ratio_mean,
        "ratio_max": aux.ratio_max,
        "clip_frac_low": aux.clip_frac_low,
        "clip_frac_high": aux.clip_frac_high,
    }
    return loss, metrics
