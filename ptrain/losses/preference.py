"""Preference losses over per-sequence log-probs: DPO and its relatives.

Inputs are per-example summed log-probs of the chosen (w) and rejected (l) completions
under the policy (pi) and the frozen reference (ref), plus token counts |y| for the
length-normalised kinds. With the log-ratios
  rho_w = log pi(y_w|x) - log ref(y_w|x),   rho_l = log pi(y_l|x) - log ref(y_l|x),
  h = rho_w - rho_l,   sigma = logistic function,
the kinds are (per example, to minimise):

  sigmoid   -log sigma(beta h)                                    DPO, Rafailov et al. 2305.18290
            with label_smoothing eps: -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
                                                                  (conservative DPO, Mitchell 2023)
  robust    [-(1-eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
                                                                  rDPO, Chowdhury et al. 2403.00409
  ipo       (h - 1/(2 beta))^2                                    IPO, Azar et al. 2310.12036
  hinge     max(0, 1 - beta h)                                    SLiC-HF, Zhao et al. 2305.10425
  dpo_norm  sigmoid loss with rho = (log pi - log ref) / |y|      length-normalised DPO, Tulu 3 2411.15124
  simpo     -log sigma(beta (log pi(y_w)/|y_w| - log pi(y_l)/|y_l|) - gamma)
                                                                  SimPO, Meng et al. 2405.14734 (no reference)
  orpo      -log pi(y_w)/|y_w| - beta log sigma(logodds_w - logodds_l),
            logodds = a - log(1 - exp(a)), a = log pi(y)/|y|      ORPO, Hong et al. 2403.07691 (beta = lambda;
                                                                  no reference)
  rpo       sigmoid loss + nll_weight (-log pi(y_w)/|y_w|)        RPO, Pang et al. 2404.19733
  dpop      -log sigma(beta (h - lambda max(0, -rho_w)))          DPO-Positive, Pal et al. 2402.13228
            (penalises a chosen log-prob that falls below the reference's: for pairs that
            differ in a few tokens, where plain DPO lowers both sides)

label_smoothing also applies (conservative form) to dpo_norm and simpo.

Implicit rewards in aux: beta rho_w and beta rho_l (length-normalised rho for dpo_norm;
beta log pi(y)/|y| for the reference-free simpo and orpo), their margin, and accuracy
1[reward_w > reward_l].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ptrain.config.choices import LENGTH_NORMALISED_KINDS as _NEEDS_COUNTS
from ptrain.config.choices import PREFERENCE_KINDS
from ptrain.config.choices import REFERENCE_FREE_KINDS as _REFERENCE_FREE
from ptrain.config.choices import SMOOTHABLE_KINDS as _SMOOTHABLE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreferenceAux:
    """Per-example metrics, float32 `[B]` each (average them to log).

    Attributes:
      chosen_rewards: implicit reward of the chosen completion.
      rejected_rewards: implicit reward of the rejected completion.
      margin: chosen_rewards - rejected_rewards.
      accuracy: 1.0 where chosen_rewards > rejected_rewards.
      chosen_nll: mean per-token NLL of the chosen completion, -log pi(y_w)/|y_w| (0 when no
        token counts were given).
    """

    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    margin: jax.Array
    accuracy: jax.Array
    chosen_nll: jax.Array


def _as_f32_vector(x, name: str, batch: int | None):
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 1 or (batch is not None and x.shape[0] != batch):
        want = "[B]" if batch is None else f"[{batch}]"
        raise ValueError(
            f"{name} must be a per-example vector {want} (sum of token log-probs per sequence), "
            f"got shape {tuple(x.shape)}."
        )
    return x


def _check_preference_args(kind, beta, label_smoothing, ref_given, counts_given):
    if kind not in PREFERENCE_KINDS:
        raise ValueError(f"kind must be one of {PREFERENCE_KINDS}, got {kind!r}.")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}.")
    if kind not in _REFERENCE_FREE and not ref_given:
        raise ValueError(
            f"kind={kind!r} compares against the reference model: pass ref_chosen_logps and "
            f"ref_rejected_logps (only {_REFERENCE_FREE} are reference-free)."
        )
    if kind in _NEEDS_COUNTS and not counts_given:
        raise ValueError(
            f"kind={kind!r} normalises by completion length: pass chosen_token_counts and "
            "rejected_token_counts (number of completion tokens per example)."
        )
    if label_smoothing:
        if kind not in _SMOOTHABLE:
            raise ValueError(f"label_smoothing applies to kinds {_SMOOTHABLE}, not {kind!r}; set it to 0.")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(
                f"label_smoothing (probability that a preference label is flipped) must be in [0, 0.5), "
                f"got {label_smoothing!r}."
            )


def _log_odds(avg_logp):
    """log(p / (1 - p)) for p = exp(avg_logp) <= 1; a is capped just below 0 so that p = 1 stays finite."""
    a = jnp.minimum(avg_logp, -1e-6)
    return a - jnp.log(-jnp.expm1(a))


def _sigmoid_family(x, kind: str, eps: float):
    """Loss of a preference logit x (already scaled by beta) for the logistic kinds."""
    if kind == "robust":
        return ((1.0 - eps) * -jax.nn.log_sigmoid(x) + eps * jax.nn.log_sigmoid(-x)) / (1.0 - 2.0 * eps)
    loss = -jax.nn.log_sigmoid(x)
    if eps:
        loss = (1.0 - eps) * loss - eps * jax.nn.log_sigmoid(-x)
    return loss


def preference_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array | None = None,
    ref_rejected_logps: jax.Array | None = None,
    *,
    kind: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    nll_weight: float = 1.0,
    dpop_lambda: float = 50.0,
    chosen_token_counts: jax.Array | None = None,
    rejected_token_counts: jax.Array | None = None,
) -> tuple[jax.Array, PreferenceAux]:
    """Per-example preference loss of one of `PREFERENCE_KINDS` (formulas in the module docstring).

    Args:
      policy_chosen_logps: `[B]` sum over completion tokens of log pi(y_w,t | ...).
      policy_rejected_logps: `[B]` same for the rejected completion.
      ref_chosen_logps, ref_rejected_logps: `[B]` same under the frozen reference (treated as
        constants); None for the reference-free kinds simpo and orpo.
      kind: loss family.
      beta: inverse temperature of the implicit reward (DPO beta; tau of IPO; lambda of ORPO).
      label_smoothing: eps, the assumed label-flip probability (sigmoid / dpo_norm / simpo:
        conservative DPO; robust: rDPO).
      gamma: SimPO target reward margin (used by simpo only).
      nll_weight: alpha, weight of the chosen NLL term (used by rpo only).
      dpop_lambda: lambda, weight of DPO-Positive's penalty (used by dpop only; 50 in the paper).
      chosen_token_counts, rejected_token_counts: `[B]` completion lengths |y| (needed by
        dpo_norm, simpo, orpo, rpo; also fill aux.chosen_nll when given).

    Returns:
      (loss_B float32, PreferenceAux). Take `loss_B.mean()` for the batch loss.
    """
    ref_given = ref_chosen_logps is not None and ref_rejected_logps is not None
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("pass both ref_chosen_logps and ref_rejected_logps, or neither.")
    counts_given = chosen_token_counts is not None and rejected_token_counts is not None
    if (chosen_token_counts is None) != (rejected_token_counts is None):
        raise ValueError("pass both chosen_token_counts and rejected_token_counts, or neither.")
    _check_preference_args(kind, beta, label_smoothing, ref_given, counts_given)
    if dpop_lambda < 0:
        raise ValueError(f"dpop_lambda must be >= 0, got {dpop_lambda}.")

    pc = _as_f32_vector(policy_chosen_logps, "policy_chosen_logps", None)
    batch = pc.shape[0]
    pr = _as_f32_vector(policy_rejected_logps, "policy_rejected_logps", batch)
    if ref_given:
        rc = jax.lax.stop_gradient(_as_f32_vector(ref_chosen_logps, "ref_chosen_logps", batch))
        rr = jax.lax.stop_gradient(_as_f32_vector(ref_rejected_logps, "ref_rejected_logps", batch))
    if counts_given:
        # A zero-length completion would divide by zero; the data pipeline drops such pairs, and
        # clamping to 1 keeps a stray one finite instead of poisoning the whole batch with NaN.
        nc = jnp.maximum(_as_f32_vector(chosen_token_counts, "chosen_token_counts", batch), 1.0)
        nr = jnp.maximum(_as_f32_vector(rejected_token_counts, "rejected_token_counts", batch), 1.0)
        chosen_nll = -pc / nc
    else:
        chosen_nll = jnp.zeros_like(pc)

    if kind == "dpo_norm":
        rho_w, rho_l = (pc - rc) / nc, (pr - rr) / nr
    elif kind in _REFERENCE_FREE:
        rho_w, rho_l = pc / nc, pr / nr
    else:
        rho_w, rho_l = pc - rc, pr - rr
    chosen_rewards, rejected_rewards = beta * rho_w, beta * rho_l
    h = rho_w - rho_l

    if kind in ("sigmoid", "robust", "dpo_norm", "rpo"):
        loss = _sigmoid_family(beta * h, kind, label_smoothing)
        if kind == "rpo":
            loss = loss + nll_weight * chosen_nll
    elif kind == "simpo":
        loss = _sigmoid_family(beta * h - gamma, kind, label_smoothing)
    elif kind == "ipo":
        loss = jnp.square(h - 1.0 / (2.0 * beta))
    elif kind == "hinge":
        loss = jax.nn.relu(1.0 - beta * h)
    elif kind == "dpop":
        loss = -jax.nn.log_sigmoid(beta * (h - dpop_lambda * jax.nn.relu(-rho_w)))
    else:  # orpo
        loss = chosen_nll - beta * jax.nn.log_sigmoid(_log_odds(rho_w) - _log_odds(rho_l))

    aux = PreferenceAux(
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margin=chosen_rewards - rejected_rewards,
        accuracy=(chosen_rewards > rejected_rewards).astype(jnp.float32),
        chosen_nll=chosen_nll,
    )
    return loss, jax.tree.map(jax.lax.stop_gradient, aux)
