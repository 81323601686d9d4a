"""Objectives of the train steps: model forward + loss, as pure functions of params and a batch.

Each objective follows `ptrain.train.step.Objective`: it returns this micro-batch's share
of the full-batch loss (its own mean times its weight over the global denominator) and
metrics that add up over micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptrain.config.algo import DPOAlgoConfig, SFTAlgoConfig
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
        stats, model_aux = target_stats(model_def, params, state.model_state, batch, vocab_chunk)
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
    precomputed in one pass) when present, else from `state.ref_params` in the same step.
    Metrics are means over the global batch (already divided by the pair count).
    """
    reference_free = cfg.kind in REFERENCE_FREE_KINDS

    def objective(params, state: TrainState, batch: dict, denom: jax.Array):
        pc, pr, nc, nr, model_aux = pair_logprobs(
            model_def, params, state.model_state, batch, vocab_chunk, return_aux=True
        )
        if reference_free:
            rc = rr = None
        elif "ref_chosen_logps" in batch:
            rc, rr = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            rc, rr, _, _ = pair_logprobs(
                model_def, jax.lax.stop_gradient(state.ref_params), state.model_state, batch, vocab_chunk
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
