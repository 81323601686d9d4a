"""The policy-gradient objective of the GRPO family, as a pure function of params and a batch.

The batch is `ptrain.stages.grpo.batch.policy_batch`'s: one trajectory per row (or, with
`algo.grpo.pack_rows`, per segment of a row), the engine's log-probs of the sampled tokens, its
advantage. The objective recomputes the policy's log-probs of those tokens under
softmax(logits / temperature) (the distribution the engine sampled from, before top-k / top-p
truncation) and hands them to `ptrain.losses.policy_loss` with the options of `algo.grpo`.

Three log-probs of each sampled token meet here (AReaL's decoupled PPO, arXiv 2505.24298):
  logp    the policy being updated (gradient),
  old     the proximal policy: the trainer's own log-probs before this batch's first update
          (`old_logp` in the batch, computed by `policy_logprobs`; omitted for a single
          on-policy update, where old = stop_gradient(logp)), which the PPO ratio is
          clipped around,
  engine  the behaviour policy: what the engine reported when it sampled (possibly with
          older weights in asynchronous mode, and always with other numerics), which only
          enters as the importance weight exp(old - engine) (tis / mis in `policy_loss`).
So staleness and engine numerics never bias the clip; they are corrected, or masked, by
the importance weight.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ptrain.losses import vocab_stats_from_hidden
from ptrain.losses.policy import policy_loss
from ptrain.losses.reduce import sequence_sums
from ptrain.train.state import ModelDef, TrainState

# PolicyAux fields that are means over the micro-batch's tokens (kept ones: after the sequence
# drop; all: before it) or its sequences; the step sums micro-batches. Those over all tokens or
# sequences are weighted by the micro-batch's share of the batch's (denominators counted before
# the drop); those over kept tokens, whose batch total is known only after every micro-batch,
# are summed (mean x kept tokens) and divided by the kept tokens (loss_tokens) on the host.
# (pg_loss and kl_loss are aggregated over the global denominator already: they add up.)
_ADDITIVE_METRICS = ("pg_loss", "kl_loss")
_KEPT_TOKEN_METRICS = ("entropy", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean")
_ALL_TOKEN_METRICS = ("is_ratio_mean", "mismatch_kl", "mult_prob_error", "frac_is_masked")
_SEQUENCE_METRICS = ("frac_seq_dropped",)
_MAX_METRICS = ("ratio_max", "is_ratio_max")


def policy_denominator(aggregation: str, packed: bool = False):
    """Global-batch denominators: {"loss": tokens (token_mean) or sequences (seq_mean_*),
    "tokens": loss tokens, "seqs": sequences with at least one loss token}. packed: a sequence
    is a segment of a row (`policy_batch(pack=True)`), not the row."""

    def denominator(batch: dict) -> dict[str, jax.Array]:
        mask = batch["loss_mask"].astype(jnp.float32)
        tokens = jnp.sum(mask)
        _, counts = sequence_sums(mask, mask, batch["segment_ids"] if packed else None)
        seqs = jnp.sum((counts > 0).astype(jnp.float32))
        return {"loss": tokens if aggregation == "token_mean" else seqs, "tokens": tokens, "seqs": seqs}

    return denominator


def _forward_stats(model_def: ModelDef, params, model_state, batch: dict, *, temperature: float, vocab_chunk: int):
    model = model_def.bind(params, model_state)
    h, aux = model(batch["input_ids"], batch["positions"], batch["segment_ids"], return_aux=True, return_hidden=True)
    head = model.head_weight().astype(h.dtype)
    chunk = vocab_chunk or None
    stats = vocab_stats_from_hidden(h, head, batch["target_ids"], chunk_size=chunk, temperature=temperature)
    return stats, aux


def policy_logprobs(model_def: ModelDef, params, model_state, batch: dict, *, temperature: float, vocab_chunk: int):
    """log softmax(logits / temperature)[target] of every position, float32 [B, L] (no gradient
    needed: the proximal policy's and the reference's log-probs)."""
    stats, _ = _forward_stats(model_def, params, model_state, batch, temperature=temperature, vocab_chunk=vocab_chunk)
    return jax.lax.stop_gradient(stats.logp)


def make_policy_objective(model_def: ModelDef, cfg: Any, *, vocab_chunk: int = 0, aux_loss_coef: float = 0.0):
    """GRPO / Dr. GRPO / DAPO / GSPO / CISPO objective (`cfg` is an `algo.grpo` config, which
    the policy loss takes whole: its loss options are PolicyLossConfig's).

    With `cfg.kl_coef > 0` the reference's log-probs come from `state.reference_params()` (a second
    forward pass without gradient). Metrics add up over micro-batches (see step.py); the
    stage's finalisation divides nothing further: token means arrive already weighted.
    """
    temperature = float(cfg.temperature) if cfg.temperature > 0 else 1.0

    def objective(params, state: TrainState, batch: dict, denoms: dict[str, jax.Array]):
        stats, model_aux = _forward_stats(
            model_def,
            state.model_params(params, batch),
            state.model_state,
            batch,
            temperature=temperature,
            vocab_chunk=vocab_chunk,
        )
        ref = None
        if cfg.kl_coef > 0:
            ref = policy_logprobs(
                model_def,
                state.reference_params(),
                state.model_state,
                batch,
                temperature=temperature,
                vocab_chunk=vocab_chunk,
            )
        loss, aux = policy_loss(
            stats.logp,
            batch.get("old_logp"),
            batch["advantages"],
            batch["loss_mask"],
            denominator=denoms["loss"],
            ref_logp=ref,
            entropy=stats.entropy if cfg.entropy_coef > 0 else None,
            engine_logp=batch["engine_logp"],
            segment_ids=batch["segment_ids"] if cfg.pack_rows else None,
            cfg=cfg,
        )
        mask = batch["loss_mask"].astype(jnp.float32)
        _, seq_tokens = sequence_sums(mask, mask, batch["segment_ids"] if cfg.pack_rows else None)
        share = jnp.sum(mask) / denoms["tokens"]
        metrics = {k: getattr(aux, k) * aux.token_count for k in _KEPT_TOKEN_METRICS}
        metrics.update({k: getattr(aux, k) * share for k in _ALL_TOKEN_METRICS})
        seq_share = jnp.sum((seq_tokens > 0).astype(jnp.float32)) / denoms["seqs"]
        metrics.update({k: getattr(aux, k) * seq_share for k in _SEQUENCE_METRICS})
        metrics.update({k: getattr(aux, k) for k in _ADDITIVE_METRICS})
        # The entropy of every sampled token, whatever entropy_coef says (PolicyAux has it only
        # when the bonus is on): a falling entropy is the first sign of collapse.
        metrics["policy_entropy"] = jnp.sum(stats.entropy * mask) / denoms["tokens"]
        metrics["trainer_logp"] = jnp.sum(stats.logp * mask) / denoms["tokens"]
        metrics["loss_tokens"] = aux.token_count
        metrics["loss_seqs"] = aux.seq_count
        for k in _MAX_METRICS:
            metrics[k] = getattr(aux, k)
        if model_aux.expert_load.size:
            metrics["moe_lb_loss"] = model_aux.lb_loss
            metrics["expert_load"] = model_aux.expert_load
            loss = loss + aux_loss_coef * model_aux.lb_loss * share
        return loss, metrics

    return objective


def finalize_policy_metrics(m: dict, grad_accum: int) -> dict:
    """Host side: summed micro-batch metrics -> step values (max metrics over micro-batches
    arrive summed as well; divided by grad_accum they are a mean of the micro-batch maxima)."""
    out = {}
    for k, v in m.items():
        if k == "expert_load":
            load = jnp.asarray(v) / grad_accum
            out["expert_load_max"] = float(jnp.max(load)) * load.shape[-1]
            out["expert_load_min"] = float(jnp.min(load)) * load.shape[-1]
        elif k in _MAX_METRICS or k == "moe_lb_loss":
            out[k] = float(v) / grad_accum
        elif k in _KEPT_TOKEN_METRICS:
            out[k] = float(v) / max(float(m["loss_tokens"]), 1.0)
        else:
            out[k] = float(v) if jnp.ndim(v) == 0 else v
    return out
