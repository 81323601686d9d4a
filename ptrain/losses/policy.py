"""Clipped policy-gradient loss: one function for GRPO, Dr. GRPO, DAPO, GSPO and CISPO.

Notation (per token t of response i; m = response mask; A = advantage):
  logp = log pi_theta(y_t)     (current policy, carries the gradient)
  old  = log pi_old(y_t)       (policy that produced the rollout, as the trainer computes it)
  eng  = log pi_engine(y_t)    (the rollout engine's own log-probs; differs by numerics / staleness)
  ref  = log pi_ref(y_t)       (frozen reference, for the KL penalty)

Ratio (`ratio_level`):
  token     r_t = exp(logp_t - old_t)                                 PPO / GRPO, Shao et al. 2402.03300
  sequence  r_t = sg(s_i) exp(logp_t - sg(logp_t)),
            s_i = exp(sum_t m (logp - old) / sum_t m)                 GSPO (token form), Zheng et al. 2507.18071
            (value s_i, gradient s_i grad log pi_t; with seq_mean_token_mean and weights constant within
            a sequence it is exactly the gradient of GSPO's sequence objective. Under other aggregations
            the gradient is that of the GSPO-token surrogate, as in the paper's GSPO-token variant.)

Per-token policy term (`objective`):
  ppo    max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))         Schulman et al. 1707.06347;
         clip_high > clip_low is DAPO's clip-higher (2503.14476)
         dual_clip c: for A < 0 additionally min(., -A c)            Ye et al. 1912.09729 (DAPO recipe: c = 10)
  cispo  -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp            CISPO, MiniMax-M1 2506.13585
         (clip_low >= 1 removes the lower bound, as MiniMax-M1 does)

Engine-versus-trainer correction (`is_correction`; w = exp(old - eng), stop-gradient), per token,
per sequence (exp of the sum) or geometric (exp of the mean over the sequence) by `is_level`:
  is    w as it is (untruncated; Nemotron 3 Nano's released setting, with the sequence drop below)
  tis   w <- min(w, is_high)                                         truncated IS, Yao et al. 2025
                                                                     ("Your efficient RL framework secretly
                                                                     brings you off-policy RL training")
  mis   w <- w 1[is_low <= w <= is_high]                             masked IS (IcePop / NeMo RL)
  The policy term is multiplied by w. `max_seq_mult_prob_error` drops whole sequences whose
  mean multiplicative probability error mean_t exp(|old - eng|) exceeds it (NeMo RL's
  `seq_logprob_error_threshold`, Nemotron uses 2); dropped sequences leave every count of
  this call (token_count, seq_count, the aggregation's own), not a `denominator` passed in.

KL to the reference (`kl_estimator`, x = ref - logp, samples from pi_theta), added per token
with weight `kl_coef` (GRPO puts it in the loss, not the reward):
  k1 = -x      k2 = x^2 / 2      k3 = exp(x) - 1 - x                  Schulman, "Approximating KL divergence"
Entropy bonus: -entropy_coef H_t.

Aggregation of the per-token loss l = policy term + kl_coef k - entropy_coef H (N = denominator):
  token_mean               sum_{i,t} m l / sum m                     DAPO token-level loss
  seq_mean_token_mean      (1/N_seq) sum_i (sum_t m l / sum_t m)     original GRPO
  seq_mean_token_sum       (1/N_seq) sum_i sum_t m l
  seq_mean_token_sum_norm  (1/N_seq) sum_i sum_t m l / C             Dr. GRPO 2503.20783 (C = norm_constant,
                                                                     default the padded length L; verl's
                                                                     mode of this name drops 1/N_seq:
                                                                     pass denominator=1 to match it)
For gradient accumulation pass `denominator=` the global token count (token_mean) or the
global sequence count (seq_mean_*), then add the micro-batch losses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ptrain.config.choices import KL_ESTIMATORS
from ptrain.config.policy_loss import PolicyLossConfig
from ptrain.losses.reduce import masked_max, masked_mean, safe_divide, sequence_sums

_LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: beyond it a ratio is meaningless and only risks inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyAux:
    """Metrics of one policy-loss call, float32 scalars (token means over the kept tokens).

    Attributes:
      pg_loss: aggregated policy term (after IS weights), without KL and entropy.
      kl_loss: aggregated KL estimate to the reference, unscaled (0 without ref_logp).
      entropy: token mean of the entropy (0 without entropy).
      clip_frac_low: fraction of tokens clipped at 1 - clip_low (ppo: with A < 0; cispo: any A).
      clip_frac_high: fraction clipped at 1 + clip_high (ppo: with A > 0; cispo: any A).
      clip_frac_dual: fraction where the dual clip is active (A < 0 and r > c).
      approx_kl: token mean of k3 estimating KL(pi_old || pi_theta), x = logp - old (how far
        the policy moved since the rollout).
      ratio_mean, ratio_max: of the policy ratio r.
      is_ratio_mean, is_ratio_max: of the engine-to-trainer weight w before truncation/masking
        (1 without engine log-probs).
      mismatch_kl: token mean of k3 estimating KL(pi_engine || pi_old), x = old - eng.
      mult_prob_error: token mean of exp(|old - eng|) (1 means identical).
      frac_is_masked: fraction of tokens whose weight MIS set to 0.
      frac_seq_dropped: fraction of sequences dropped by max_seq_mult_prob_error.
      token_count: number of kept tokens (after drops).
      seq_count: number of kept sequences with at least one token.
    """

    pg_loss: jax.Array
    kl_loss: jax.Array
    entropy: jax.Array
    clip_frac_low: jax.Array
    clip_frac_high: jax.Array
    clip_frac_dual: jax.Array
    approx_kl: jax.Array
    ratio_mean: jax.Array
    ratio_max: jax.Array
    is_ratio_mean: jax.Array
    is_ratio_max: jax.Array
    mismatch_kl: jax.Array
    mult_prob_error: jax.Array
    frac_is_masked: jax.Array
    frac_seq_dropped: jax.Array
    token_count: jax.Array
    seq_count: jax.Array


def kl_penalty(logp_BxL: jax.Array, ref_logp_BxL: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (module docstring)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}.")
    x = jnp.clip(ref_logp_BxL - logp_BxL, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * jnp.square(x)
    return jnp.expm1(x) - x


def _check_policy_args(logp, mask, advantages, named, cfg: PolicyLossConfig, denominator) -> None:
    """The shapes of the inputs, the config's own checks (PolicyLossConfig.problems), and the
    inputs each option needs."""
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, L] per-token log-probs, got shape {tuple(logp.shape)}.")
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected logp's {tuple(logp.shape)}.")
    for name, x in named.items():
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected logp's {tuple(logp.shape)}.")
    if advantages.shape not in ((logp.shape[0],), tuple(logp.shape)):
        raise ValueError(
            f"advantages must be per sequence [B] = [{logp.shape[0]}] or per token {tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}."
        )
    problems = cfg.problems()
    if problems:
        raise ValueError(problems[0][1])
    if isinstance(denominator, (int, float)) and not denominator > 0:
        raise ValueError(f"denominator must be > 0 (it divides the loss), got {denominator!r}.")
    if cfg.kl_coef > 0 and named["ref_logp"] is None:
        raise ValueError("kl_coef > 0 needs ref_logp (reference-model log-probs of the sampled tokens).")
    if cfg.entropy_coef > 0 and named["entropy"] is None:
        raise ValueError("entropy_coef > 0 needs entropy (per-token entropy, e.g. from vocab_stats(...).entropy).")
    if (cfg.is_correction is not None or cfg.max_seq_mult_prob_error is not None) and named["engine_logp"] is None:
        raise ValueError(
            "is_correction / max_seq_mult_prob_error compare the engine to the trainer: pass engine_logp "
            "(the rollout engine's per-token log-probs)."
        )


class _Sequences:
    """The sequences of a batch: its rows, or with segment ids (packed rows) each (row, segment)
    pair. Per-sequence sums and their spreading back onto the tokens."""

    def __init__(self, segment_ids_BxL: jax.Array | None):
        self.segment_ids = segment_ids_BxL

    def sums(self, x_BxL, mask_BxL):
        """(sums of the masked values, token counts): [B] for rows, [B * (L + 1)] for segments."""
        return sequence_sums(x_BxL, mask_BxL, self.segment_ids)

    def spread(self, per_seq):
        """A per-sequence value on every token of its sequence, [B, L] (or [B, 1] for rows)."""
        if self.segment_ids is None:
            return per_seq[:, None]
        b, l = self.segment_ids.shape
        ids = jnp.arange(b, dtype=jnp.int32)[:, None] * (l + 1) + jnp.clip(self.segment_ids, 0, l)
        return per_seq[ids]

    def per_token(self, x_BxL, mask_BxL, how: str):
        """sum or mean over each sequence's masked tokens, on each of its tokens."""
        s, n = self.sums(x_BxL, mask_BxL)
        return self.spread(s if how == "sum" else safe_divide(s, n))


def _engine_correction(
    old, eng, mask, seqs: _Sequences, *, is_correction, is_level, is_low, is_high, max_seq_mult_prob_error
):
    """IS weights `[B, L]` (stop-gradient), the mask after sequence drops, and mismatch metrics."""
    delta = old - eng
    if is_level == "token":
        log_w = delta
    else:
        log_w = seqs.per_token(delta, mask, "sum" if is_level == "sequence" else "mean") * jnp.ones_like(delta)
    w_raw = jnp.exp(jnp.clip(log_w, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    if is_correction == "is":
        w = w_raw
        is_masked = jnp.zeros_like(w)
    elif is_correction == "tis":
        w = jnp.minimum(w_raw, is_high)
        is_masked = jnp.zeros_like(w)
    elif is_correction == "mis":
        keep = (w_raw >= is_low) & (w_raw <= is_high)
        w = jnp.where(keep, w_raw, 0.0)
        is_masked = 1.0 - keep.astype(jnp.float32)
    else:
        w = jnp.ones_like(w_raw)
        is_masked = jnp.zeros_like(w)

    mult_err = jnp.exp(jnp.minimum(jnp.abs(delta), _LOG_RATIO_LIMIT))
    err_sum, count = seqs.sums(mult_err, mask)
    has = count > 0
    if max_seq_mult_prob_error is not None:
        dropped = (safe_divide(err_sum, count) > max_seq_mult_prob_error) & has
    else:
        dropped = jnp.zeros_like(has)
    metrics = dict(
        is_ratio_mean=masked_mean(w_raw, mask),
        is_ratio_max=masked_max(w_raw, mask),
        mismatch_kl=masked_mean(kl_penalty(eng, old, "k3"), mask),
        mult_prob_error=masked_mean(mult_err, mask),
        frac_is_masked=masked_mean(is_masked, mask),
        frac_seq_dropped=safe_divide(jnp.sum(dropped.astype(jnp.float32)), jnp.sum(has.astype(jnp.float32))),
    )
    kept_mask = mask * (1.0 - seqs.spread(dropped.astype(jnp.float32)))
    return jax.lax.stop_gradient(w), kept_mask, metrics


def _aggregate(l_BxL, mask, seqs: _Sequences, aggregation: str, denominator, norm_constant):
    if aggregation == "token_mean":
        den = jnp.sum(mask) if denominator is None else denominator
        return safe_divide(jnp.sum(l_BxL * mask), den)
    row_sum, row_count = seqs.sums(l_BxL, mask)
    den = jnp.sum((row_count > 0).astype(jnp.float32)) if denominator is None else denominator
    if aggregation == "seq_mean_token_mean":
        return safe_divide(jnp.sum(safe_divide(row_sum, row_count)), den)
    total = safe_divide(jnp.sum(row_sum), den)
    if aggregation == "seq_mean_token_sum_norm":
        return total / (l_BxL.shape[1] if norm_constant is None else norm_constant)
    return total


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    cfg: PolicyLossConfig | None = None,
    denominator: float | jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    engine_logp: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, PolicyAux]:
    """Clipped policy-gradient loss with named options (formulas and papers in the module docstring).

    Args:
      logp: `[B, L]` log pi_theta of the sampled tokens (differentiable).
      old_logp: `[B, L]` log pi_old of the same tokens, or None for a strictly on-policy single
        update (then old = stop_gradient(logp) and r = 1 with gradient grad log pi).
      advantages: `[B]` per sequence or `[B, L]` per token.
      mask: `[B, L]` 1.0 on response tokens that count.
      cfg: the options as one group (`ptrain.config.PolicyLossConfig`, or an `algo.grpo`
        config, which extends it): objective, clip_low / clip_high (ratio bounds 1 - clip_low,
        1 + clip_high; clip_high None = clip_low), dual_clip, ratio_level, aggregation,
        norm_constant, kl_coef / kl_estimator / kl_clamp, entropy_coef, is_correction /
        is_level / is_low / is_high, max_seq_mult_prob_error. None: the defaults.
      **options: fields of PolicyLossConfig that replace cfg's (`clip_low=0.28`).
      denominator: overrides the batch's own token count (token_mean) or sequence count (other
        modes) for exact aggregation across micro-batches.
      ref_logp: `[B, L]` reference log-probs (needed when kl_coef > 0).
      entropy: per-token entropy `[B, L]` (differentiable; needed when entropy_coef > 0).
      engine_logp: `[B, L]` rollout-engine log-probs of the sampled tokens; enables mismatch
        metrics, `is_correction` and `max_seq_mult_prob_error`.
      segment_ids: `[B, L]` int, for packed rows (several sequences to a row, numbered 1, 2, ...
        within it; 0 on padding): every per-sequence quantity (the sequence-level ratio and IS
        weight, the sequence drop, the seq_mean aggregations, seq_count) is then per (row,
        segment). None: each row is one sequence. Pass per-token advantages with it.

    Returns:
      (scalar float32 loss, PolicyAux).
    """
    cfg = cfg if cfg is not None else PolicyLossConfig()
    if options:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(PolicyLossConfig)})
        if unknown:
            raise ValueError(
                f"unknown policy-loss option(s) {unknown}; the options are the fields of PolicyLossConfig: "
                f"{[f.name for f in dataclasses.fields(PolicyLossConfig)]}"
            )
        cfg = dataclasses.replace(cfg, **options)
    advantages = jnp.asarray(advantages)
    named = dict(old_logp=old_logp, ref_logp=ref_logp, entropy=entropy, engine_logp=engine_logp)
    _check_policy_args(logp, mask, advantages, named, cfg, denominator)
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(logp.shape):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected logp's {tuple(logp.shape)}.")
    seqs = _Sequences(None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32))
    objective, ratio_level, aggregation = cfg.objective, cfg.ratio_level, cfg.aggregation
    clip_low = cfg.clip_low
    clip_high = clip_low if cfg.clip_high is None else cfg.clip_high
    dual_clip, norm_constant = cfg.dual_clip, cfg.norm_constant
    kl_coef, kl_estimator, kl_clamp, entropy_coef = cfg.kl_coef, cfg.kl_estimator, cfg.kl_clamp, cfg.entropy_coef
    is_correction, is_level, is_low, is_high = cfg.is_correction, cfg.is_level, cfg.is_low, cfg.is_high
    max_seq_mult_prob_error = cfg.max_seq_mult_prob_error
    f32 = jnp.float32
    mask = mask.astype(f32)
    # Padding may hold anything (-inf log-probs, NaN from an engine): zero it before any arithmetic, so
    # that neither the loss nor its gradient can see it (NaN * 0 would still be NaN).
    valid = mask > 0
    clean = lambda x: None if x is None else jnp.where(valid, x.astype(f32), 0.0)  # noqa: E731
    logp, old_logp, ref_logp, entropy, engine_logp = map(clean, (logp, old_logp, ref_logp, entropy, engine_logp))
    old = jax.lax.stop_gradient(logp if old_logp is None else old_logp)
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    adv = jnp.where(valid, adv, 0.0)

    if engine_logp is not None:
        w, mask, mismatch = _engine_correction(
            old,
            jax.lax.stop_gradient(engine_logp),
            mask,
            seqs,
            is_correction=is_correction,
            is_level=is_level,
            is_low=is_low,
            is_high=is_high,
            max_seq_mult_prob_error=max_seq_mult_prob_error,
        )
    else:
        w = jnp.ones_like(logp)
        one, zero = jnp.ones((), f32), jnp.zeros((), f32)
        mismatch = dict(
            is_ratio_mean=one,
            is_ratio_max=one,
            mismatch_kl=zero,
            mult_prob_error=one,
            frac_is_masked=zero,
            frac_seq_dropped=zero,
        )

    if ratio_level == "token":
        log_r = logp - old
    else:
        seq_log_ratio = seqs.per_token(jax.lax.stop_gradient(logp) - old, mask, "mean")
        log_r = logp - jax.lax.stop_gradient(logp) + seq_log_ratio
    ratio = jnp.exp(jnp.clip(log_r, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    clipped = jnp.clip(ratio, lo, hi)
    r_value = jax.lax.stop_gradient(ratio)

    if objective == "ppo":
        pg = jnp.maximum(-adv * ratio, -adv * clipped)
        low_hit = (r_value < lo) & (adv < 0)
        high_hit = (r_value > hi) & (adv > 0)
        if dual_clip is not None:
            dual_hit = (adv < 0) & (r_value > dual_clip)
            pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * dual_clip), pg)
        else:
            dual_hit = jnp.zeros_like(low_hit)
    else:
        pg = -jax.lax.stop_gradient(clipped) * adv * logp
        low_hit, high_hit = r_value < lo, r_value > hi
        dual_hit = jnp.zeros_like(low_hit)
    pg = w * pg

    per_token = pg
    if ref_logp is not None:
        kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kl_estimator)
        if kl_clamp is not None:
            kl = jnp.clip(kl, -kl_clamp, kl_clamp)
        per_token = per_token + kl_coef * kl
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy

    agg = lambda x: _aggregate(x, mask, seqs, aggregation, denominator, norm_constant)  # noqa: E731
    loss = agg(per_token)
    sg = jax.lax.stop_gradient
    frac = lambda b: masked_mean(b.astype(f32), mask)  # noqa: E731
    zero = jnp.zeros((), f32)
    aux = PolicyAux(
        pg_loss=agg(sg(pg)),
        kl_loss=agg(sg(kl)) if ref_logp is not None else zero,
        entropy=masked_mean(sg(entropy), mask) if entropy is not None else zero,
        clip_frac_low=frac(low_hit),
        clip_frac_high=frac(high_hit),
        clip_frac_dual=frac(dual_hit),
        approx_kl=masked_mean(kl_penalty(old, sg(logp), "k3"), mask),
        ratio_mean=masked_mean(r_value, mask),
        ratio_max=masked_max(r_value, mask),
        token_count=jnp.sum(mask),
        seq_count=jnp.sum((seqs.sums(mask, mask)[1] > 0).astype(f32)),
        **mismatch,
    )
    return loss, jax.tree.map(sg, aux)
