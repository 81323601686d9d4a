"""The options of the clipped policy-gradient loss (`ptrain.losses.policy_loss`), as one group.

`PolicyLossConfig` is what the loss takes (`policy_loss(..., cfg=...)`) and what `algo.grpo`
extends (GRPOAlgoConfig adds rollouts, advantages and the rest to these fields, so the keys
stay `algo.grpo.clip_low`, ...). It checks itself once, in `problems`: the config reports
each problem under `algo.grpo.<field>` before any compute, the loss raises the first as a
ValueError. A new knob of the loss is a field here, its check in `problems`, and its use in
the loss. Formulas and papers: ptrain/losses/policy.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptrain.config.choices import (
    IS_CORRECTIONS,
    IS_LEVELS,
    KL_ESTIMATORS,
    POLICY_AGGREGATIONS,
    POLICY_OBJECTIVES,
    RATIO_LEVELS,
)


@dataclass
class PolicyLossConfig:
    objective: str = "ppo"
    """ppo (clipped surrogate) | cispo (clipped stop-gradient IS weight)."""
    clip_low: float = 0.2
    """Lower ratio bound 1 - clip_low (>= 0)."""
    clip_high: float | None = None
    """Upper ratio bound 1 + clip_high; None: clip_low (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (ppo only; DAPO recipe: 10)."""
    ratio_level: str = "token"
    """token (PPO/GRPO) | sequence (GSPO)."""
    aggregation: str = "token_mean"
    """token_mean (DAPO) | seq_mean_token_mean (GRPO) | seq_mean_token_sum |
    seq_mean_token_sum_norm (Dr. GRPO)."""
    norm_constant: float | None = None
    """Dr. GRPO's constant for seq_mean_token_sum_norm; None: the padded length (train.seq_len)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (>= 0). The reference (the stage's starting
    weights) is kept only when this is > 0."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman's estimators; GRPO uses k3)."""
    kl_clamp: float | None = None
    """Clip each token's KL estimate to [-kl_clamp, kl_clamp] (> 0; verl uses 10); None: no clip."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (>= 0)."""
    is_correction: str | None = None
    """Engine-vs-trainer importance weight exp(old - engine): null | is (untruncated, Nemotron 3
    Nano) | tis (truncated) | mis (masked, IcePop)."""
    is_level: str = "token"
    """token | sequence | geometric: where the weight is formed."""
    is_low: float = 0.0
    """mis: weights below this are masked (0 <= is_low < is_high)."""
    is_high: float = 2.0
    """tis: weights are capped here; mis: weights above it are masked."""
    max_seq_mult_prob_error: float | None = None
    """Drop sequences whose mean exp(|old - engine|) exceeds this (>= 1; Nemotron uses 2)."""

    def problems(self) -> list[tuple[str, str]]:
        """Every impossible value, as (field, a sentence that names it and the fix)."""
        out: list[tuple[str, str]] = []

        def need(cond: bool, field: str, text: str) -> None:
            if not cond:
                out.append((field, text))

        for name, allowed in (
            ("objective", POLICY_OBJECTIVES),
            ("ratio_level", RATIO_LEVELS),
            ("aggregation", POLICY_AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("is_correction", IS_CORRECTIONS),
            ("is_level", IS_LEVELS),
        ):
            value = getattr(self, name)
            need(value in allowed, name, f"{name} must be one of {allowed}, got {value!r}.")
        high = self.clip_low if self.clip_high is None else self.clip_high
        need(
            _number(self.clip_low) and self.clip_low >= 0 and _number(high) and high >= 0,
            "clip_low" if not (_number(self.clip_low) and self.clip_low >= 0) else "clip_high",
            f"clip_low and clip_high must be >= 0 (ratio kept in [1 - clip_low, 1 + clip_high]), "
            f"got {self.clip_low!r}, {self.clip_high!r}.",
        )
        if self.dual_clip is not None:
            need(self.objective == "ppo", "dual_clip", "dual_clip applies to objective='ppo' only; set it to null.")
            need(
                _number(self.dual_clip) and self.dual_clip > 1.0,
                "dual_clip",
                f"dual_clip must be > 1 (a bound on -A r for negative advantages), got {self.dual_clip!r}.",
            )
        if self.norm_constant is not None:
            need(
                self.aggregation == "seq_mean_token_sum_norm",
                "norm_constant",
                f"norm_constant is only used by aggregation='seq_mean_token_sum_norm', not {self.aggregation!r}; "
                "set it to null.",
            )
            need(
                _number(self.norm_constant) and self.norm_constant > 0,
                "norm_constant",
                f"norm_constant must be > 0 (it divides the loss), got {self.norm_constant!r}.",
            )
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            need(
                _number(value) and math.isfinite(value) and value >= 0,
                name,
                f"kl_coef and entropy_coef must be finite and >= 0, got {self.kl_coef!r}, {self.entropy_coef!r}.",
            )
        need(
            self.kl_clamp is None or (_number(self.kl_clamp) and self.kl_clamp > 0),
            "kl_clamp",
            f"kl_clamp must be null or > 0, got {self.kl_clamp!r}.",
        )
        need(
            _number(self.is_low) and _number(self.is_high) and 0.0 <= self.is_low < self.is_high,
            "is_low",
            f"need 0 <= is_low < is_high for the importance weights, got {self.is_low!r}, {self.is_high!r}.",
        )
        need(
            self.is_correction != "tis" or self.is_low == 0.0,
            "is_low",
            "is_low is a masking bound used by is_correction='mis'; truncated IS ('tis') only caps at "
            "is_high. Set is_low=0 or use 'mis'.",
        )
        need(
            self.max_seq_mult_prob_error is None
            or (_number(self.max_seq_mult_prob_error) and self.max_seq_mult_prob_error >= 1.0),
            "max_seq_mult_prob_error",
            f"max_seq_mult_prob_error bounds mean exp(|old - eng|) >= 1; got {self.max_seq_mult_prob_error!r}.",
        )
        return out


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
