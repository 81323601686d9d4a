"""Objectives of the train steps: model forward + loss, as pure functions of params and a batch.

Each objective follows `ptrain.train.step.Objective`: it returns this micro-batch's share
of the full-batch loss (its own mean times its weight over the global denominator) and
metrics that add up over micro-batches.

The families: SFT (cross-entropy over a Decoder's logits), DPO (preference losses over a
Decoder's sequence log-probs) and reward models (the Bradley-Terry loss over a
RewardModel's scalar scores).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ptrain.config.algo import DPOAlgoConfig, RMAlgoConfig, SFTAlgoConfig
from ptrain.config.choices import REFERENCE_FREE_KINDS, SFT_AGGREGATIONS
from ptrain.losses import preference_loss, sequence_logprobs, vocab_stats, vocab_stats_from_hidden
from ptrain.losses.reduce import sequence_sums
from ptrain.losses.sft import sft_loss_from_stats
from ptrain.train.state import ModelDef, TrainState


def sft_denominator(cfg: SFTAlgoConfig, norm_constant: float):
    """Global-batch denominators of the SFT objective: {"loss": that of the chosen
    aggregation, "tokens": the loss tokens, which weigh the MoE load-balancing term}."""
    if cfg.aggregation not in SFT_AGGREGATIONS:
        raise ValueError(
            f"algo.sft.aggregation: unknown '{cfg.aggregation}'; pass one of {', '.join(SFT_AGGREGATIONS)}"
        )

    def denominator(batch: dict) -> dict[str, jax.Array]:
        mask = batch["loss_mask"].astype(jnp.float32)
        tokens = jnp.sum(mask)
        if cfg.aggregation == "token_mean":
            loss = tokens
        elif cfg.aggregation == "sequence_mean":
            _, counts = sequence_sums(mask, mask, batch["segment_ids"])
            loss = jnp.sum((counts > 0).astype(jnp.float32))
        else:
            loss = jnp.asarray(norm_constant, jnp.float32)
        return {"loss": loss, "tokens": tokens}

    return denominator


def target_stats(model_def: ModelDef, params, model_state, batch: dict, vocab_chunk: int = 0):
    """Per-token vocabulary statistics of the targets (log-prob, entropy, ...) and router aux.

    vocab_chunk > 0 takes the hidden-state path: the head is applied one vocabulary chunk
    at a time inside the loss, so [B, L, V] logits are never materialised.
    """
    model = model_def.bind(params, model_state)
    if vocab_chunk:
        h, aux = model(
            batch["input_ids"], batch["positions"], batch["segment_ids"], return_aux=True, return_hidden=True
        )
        head = model.head_weight().astype(h.dtype)
        return vocab_stats_from_hidden(h, head, batch["target_ids"], chunk_size=vocab_chunk), aux
    logits, aux = model(batch["input_ids"], batch["positions"], batch["segment_ids"], return_aux=True)
    return vocab_stats(logits, batch["target_ids"]), aux


def make_sft_objective(model_def: ModelDef, cfg: SFTAlgoConfig, *, aux_loss_coef: float = 0.0, vocab_chunk: int = 0):
    """SFT cross-entropy (+ MoE load-balancing loss) as an accumulation-exact objective."""

    def objective(params, state: TrainState, batch: dict, denoms: dict[str, jax.Array]):
        denom, tokens = denoms["loss"], denoms["tokens"]  # from sft_denominator
        stats, model_aux = target_stats(
            model_def, state.model_params(params, batch), state.model_state, batch, vocab_chunk
        )
        kwargs = dict(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, segment_ids_BxL=batch["segment_ids"])
        if cfg.aggregation == "sum":
            loss, aux = sft_loss_from_stats(stats, batch["loss_mask"], aggregation="sum", norm_constant=denom, **kwargs)
        else:
            loss, aux = sft_loss_from_stats(stats, batch["loss_mask"], aggregation=cfg.aggregation, **kwargs)
            weight = aux.token_count if cfg.aggregation == "token_mean" else aux.seq_count
            loss = loss * weight / denom
        metrics = {"nll_sum": aux.nll_sum, "loss_tokens": aux.token_count, "correct_sum": aux.correct_count}
        if model_aux.expert_load.size:
            # Summed over micro-batches like everything else; finalize_metrics averages them.
            metrics["moe_lb_loss"] = model_aux.lb_loss
            metrics["expert_load"] = model_aux.expert_load
            # Each micro-batch's term weighs by its share of the batch's loss tokens, so the
            # step adds aux_loss_coef x (token-weighted mean lb_loss) whatever the aggregation.
            loss = loss + aux_loss_coef * model_aux.lb_loss * (aux.token_count / tokens)
        return loss, metrics

    return objective


def finalize_metrics(m: dict, grad_accum: int) -> dict:
    """Host side, after the step: summed micro-batch metrics -> per-token / per-step means."""
    out = {k: v for k, v in m.items() if k not in ("nll_sum", "correct_sum", "moe_lb_loss", "expert_load")}
    tokens = max(float(m.get("loss_tokens", 0.0)), 1.0)
    if "nll_sum" in m:
        out["nll"] = float(m["nll_sum"]) / tokens
    if "correct_sum" in m:
        out["token_accuracy"] = float(m["correct_sum"]) / tokens
    if "moe_lb_loss" in m:
        out["moe_lb_loss"] = float(m["moe_lb_loss"]) / grad_accum
        load = jnp.asarray(m["expert_load"]) / grad_accum  # [n_moe_layers, E]
        out["expert_load_max"] = float(jnp.max(load)) * load.shape[-1]  # 1.0 = perfectly balanced
        out["expert_load_min"] = float(jnp.min(load)) * load.shape[-1]
    return out


# ---------------------------------------------------------------------------------- DPO family

SIDES = ("chosen", "rejected")


def both_sides(batch: dict) -> dict:
    """Stack the chosen and rejected halves of a preference batch into one [2B, L] batch."""
    return {
        k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]], axis=0)
        for k in ("input_ids", "target_ids", "loss_mask", "segment_ids", "positions")
    }


def pair_logprobs(
    model_def: ModelDef, params, model_state, batch: dict, vocab_chunk: int = 0, return_aux: bool = False
):
    """Per-sequence summed completion log-probs and token counts of both sides, each [B]
    (and, with return_aux, the forward's ModelAux: the MoE router terms).

    One forward pass over chosen and rejected together (2B rows), so the two sides share
    one compiled program and one set of weight reads.
    """
    seqs = both_sides(batch)
    stats, model_aux = target_stats(model_def, params, model_state, seqs, vocab_chunk)
    logp, counts = sequence_logprobs(stats.logp, seqs["loss_mask"])
    b = batch["chosen_input_ids"].shape[0]
    out = (logp[:b], logp[b:], counts[:b], counts[b:])
    return out + (model_aux,) if return_aux else out


def dpo_denominator(batch: dict) -> jax.Array:
    """Number of real pairs (eval batches pad with pair_index -1)."""
    return jnp.sum((batch["pair_index"] >= 0).astype(jnp.float32))


def make_dpo_objective(model_def: ModelDef, cfg: DPOAlgoConfig, *, vocab_chunk: int = 0, aux_loss_coef: float = 0.0):
    """Preference loss of the policy against the frozen reference, averaged over real pairs
    (+ the MoE load-balancing loss of the policy's forward, weighted by aux_loss_coef).

    Reference log-probs come from the batch (`ref_chosen_logps` / `ref_rejected_logps`,
    precomputed in one pass) when present, else from the reference (`state.reference_params()`) in
    the same step.
    Metrics are means over the global batch (already divided by the pair count).
    """
    reference_free = cfg.kind in REFERENCE_FREE_KINDS

    def objective(params, state: TrainState, batch: dict, denom: jax.Array):
        pc, pr, nc, nr, model_aux = pair_logprobs(
            model_def, state.model_params(params, batch), state.model_state, batch, vocab_chunk, return_aux=True
        )
        if reference_free:
            rc = rr = None
        elif "ref_chosen_logps" in batch:
            rc, rr = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            rc, rr, _, _ = pair_logprobs(
                model_def, jax.lax.stop_gradient(state.reference_params()), state.model_state, batch, vocab_chunk
            )
        loss_b, aux = preference_loss(
            pc,
            pr,
            rc,
            rr,
            kind=cfg.kind,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            gamma=cfg.gamma,
            nll_weight=cfg.nll_weight,
            dpop_lambda=cfg.dpop_lambda,
            chosen_token_counts=nc,
            rejected_token_counts=nr,
        )
        valid = (batch["pair_index"] >= 0).astype(jnp.float32)
        mean = lambda x: jnp.sum(x * valid) / denom
        metrics = {
            "rewards_chosen": mean(aux.chosen_rewards),
            "rewards_rejected": mean(aux.rejected_rewards),
            "margin": mean(aux.margin),
            "reward_accuracy": mean(aux.accuracy),
            "logps_chosen": mean(pc),
            "logps_rejected": mean(pr),
            "preference_accuracy": mean((pc > pr).astype(jnp.float32)),
            "loss_tokens": jnp.sum((nc + nr) * valid),
        }
        loss = mean(loss_b)
        if model_aux.expert_load.size:
            # As in SFT: summed over micro-batches (finalize_metrics averages them), and each
            # micro-batch's balance term weighs by its share of the batch's pairs.
            metrics["moe_lb_loss"] = model_aux.lb_loss
            metrics["expert_load"] = model_aux.expert_load
            loss = loss + aux_loss_coef * model_aux.lb_loss * (jnp.sum(valid) / denom)
        return loss, metrics

    return objective


# ---------------------------------------------------------------------------------- reward models


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BradleyTerryAux:
    """Per-pair values, float32 `[B]` each (average them to log).

    Attributes:
      margin: r(chosen) - r(rejected).
      accuracy: 1.0 where r(chosen) > r(rejected) (a tie counts as wrong).
    """

    margin: jax.Array
    accuracy: jax.Array


def bradley_terry_loss(
    chosen_B: jax.Array, rejected_B: jax.Array, *, margin: float = 0.0, center_rewards_coef: float = 0.0
) -> tuple[jax.Array, BradleyTerryAux]:
    """Per-pair Bradley-Terry loss of scalar rewards, float32 `[B]`:

        -log sigmoid(r_c - r_r - margin) + center_rewards_coef * (r_c + r_r)^2

    The negative log-likelihood of "chosen beats rejected" under the Bradley-Terry model
    (Bradley & Terry 1952), the reward-model loss of InstructGPT (Ouyang et al. 2022, arXiv
    2203.02155); `margin` is Llama 2's margin term with one margin for every pair (Touvron
    et al. 2023, arXiv 2307.09288); the centring penalty is Eisenstein et al. 2023 (arXiv
    2312.09244), TRL's center_rewards_coefficient.

    chosen_B, rejected_B: scores of the two sides, [B]. Returns (loss [B], BradleyTerryAux).
    """
    r_c, r_r = jnp.asarray(chosen_B, jnp.float32), jnp.asarray(rejected_B, jnp.float32)
    if r_c.ndim != 1 or r_c.shape != r_r.shape:
        raise ValueError(f"chosen and rejected scores must both be [B], got {r_c.shape} and {r_r.shape}")
    diff = r_c - r_r
    loss = -jax.nn.log_sigmoid(diff - margin)
    if center_rewards_coef:
        loss = loss + center_rewards_coef * jnp.square(r_c + r_r)
    return loss, BradleyTerryAux(margin=diff, accuracy=(diff > 0).astype(jnp.float32))


def full_sequences(batch: dict) -> dict:
    """Both sides of a preference batch as whole sequences, stacked into [2B, L + 1] rows
    (chosen first): input_ids and segment_ids.

    A preference batch is in next-token form (input_ids = tokens[:-1], target_ids =
    tokens[1:]); a reward model reads every token, the last one included (the token
    transformers scores), so each row is its first input token followed by its targets.
    """
    out = {}
    for key, rest in (("input_ids", "target_ids"), ("segment_ids", "segment_ids")):
        out[key] = jnp.concatenate(
            [jnp.concatenate([batch[f"{s}_{key}"][:, :1], batch[f"{s}_{rest}"]], axis=1) for s in SIDES], axis=0
        )
    return out


def pair_scores(model_def: ModelDef, params, model_state, batch: dict, return_aux: bool = False):
    """Scores float32 [B] of the chosen and rejected sides of a preference batch under a
    RewardModel (one forward pass over both sides; with return_aux, also its ModelAux)."""
    seqs = full_sequences(batch)
    model = model_def.bind(params, model_state)
    scores, model_aux = model(seqs["input_ids"], segment_ids=seqs["segment_ids"], return_aux=True)
    b = batch["chosen_input_ids"].shape[0]
    out = (scores[:b], scores[b:])
    return out + (model_aux,) if return_aux else out


def make_rm_objective(model_def: ModelDef, cfg: RMAlgoConfig, *, aux_loss_coef: float = 0.0):
    """The Bradley-Terry loss of a RewardModel's scores, averaged over real pairs (+ the MoE
    load-balancing loss of its forward, weighted by aux_loss_coef). The denominator is
    `dpo_denominator` (real pairs). Metrics are means over the global batch; `reward_sq`
    becomes reward_std in `finalize_rm_metrics`."""

    def objective(params, state: TrainState, batch: dict, denom: jax.Array):
        r_c, r_r, model_aux = pair_scores(model_def, params, state.model_state, batch, return_aux=True)
        loss_b, aux = bradley_terry_loss(r_c, r_r, margin=cfg.margin, center_rewards_coef=cfg.center_rewards_coef)
        valid = (batch["pair_index"] >= 0).astype(jnp.float32)
        mean = lambda x: jnp.sum(x * valid) / denom
        metrics = {
            "accuracy": mean(aux.accuracy),
            "margin": mean(aux.margin),
            "rewards_chosen": mean(r_c),
            "rewards_rejected": mean(r_r),
            "reward_mean": mean((r_c + r_r) / 2),
            "reward_sq": mean((jnp.square(r_c) + jnp.square(r_r)) / 2),
        }
        loss = mean(loss_b)
        if model_aux.expert_load.size:
            # As in DPO: summed over micro-batches, each weighing by its share of the pairs.
            metrics["moe_lb_loss"] = model_aux.lb_loss
            metrics["expert_load"] = model_aux.expert_load
            loss = loss + aux_loss_coef * model_aux.lb_loss * (jnp.sum(valid) / denom)
        return loss, metrics

    return objective


def finalize_rm_metrics(m: dict, grad_accum: int) -> dict:
    """Host side: the reward model's summed metrics -> logged ones (reward_std over both sides
    of every pair from the means of r and r^2; the MoE terms as finalize_metrics)."""
    out = finalize_metrics({k: v for k, v in m.items() if k != "reward_sq"}, grad_accum)
    if "reward_sq" in m:
        mean = float(m["reward_mean"])
        out["reward_std"] = math.sqrt(max(float(m["reward_sq"]) - mean * mean, 0.0))
    return out
