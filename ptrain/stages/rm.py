"""The reward-model stage (kind rm): a Bradley-Terry reward model on preference pairs.

Driver only: the starting decoder with a fresh scalar score head (`ptrain.models.RewardModel`)
-> the DPO stage's preference batches (prompt, chosen, rejected) -> jitted step of the
Bradley-Terry loss (`ptrain.train.objectives.make_rm_objective`) -> metrics, held-out
pairwise accuracy, checkpoints -> export as a Hugging Face sequence classifier
(*ForSequenceClassification, num_labels 1), whose logits in transformers are our scores
(dots1 has no such class in transformers: its folder loads in ptrain only).
This is TRL's RewardTrainer / OpenRLHF's reward-model trainer, on the shared loop.
With algo.dpo.env_pairs the pairs are the starting policy's own samples graded by the
environments' verifiers, as a DPO stage samples them (`policy_env_pairs`).

The export is a reward model, not a policy: a stage after this one with init=previous
starts from the weights this one started from (`StageKind.exports_policy`). The decoder's
untied LM head plays no part in the score, so the RewardModel drops it: no gradients or
optimizer state for it, and none in the export (transformers' classifiers have none).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from ptrain.config import RunConfig
from ptrain.config.seeds import component_seed
from ptrain.data.preference import make_preference_iterator
from ptrain.parallel import batch_sharding
from ptrain.parallel.multihost import host_array, put_global_batch
from ptrain.stages.dpo import preference_cut
from ptrain.stages.loop import Algorithm, IteratorBatches, train_evaluate_export
from ptrain.stages.setup import (
    Stage,
    ensure_base_model,
    load_model,
    place_state,
    router_bias_update,
    stage_data,
    stage_mesh,
    tokenizer_for,
)
from ptrain.train.objectives import dpo_denominator, finalize_rm_metrics, make_rm_objective, pair_scores
from ptrain.train.state import ModelDef


def score_pad_id(tokenizer) -> int | None:
    """The pad id the exported model pools by: the tokenizer's pad token, else its
    end-of-sequence token (TRL's usual stand-in), else None (transformers then scores
    only unpadded batches of one row)."""
    for key in ("pad_token_id", "eos_token_id"):
        val = getattr(tokenizer, key, None)
        if isinstance(val, int):
            return val
    return None


def setup_rm_stage(run: RunConfig, stage_dir: str, init_path: str | None, tokenizer, *, t_start: float) -> Stage:
    """setup_stage for a reward model: the starting decoder on the mesh, wrapped with a
    score head drawn from model.seed (its LM head dropped), the optimizer and the placed state."""
    from ptrain.models import RewardModel
    from ptrain.train.optim import make_optimizer

    mesh = stage_mesh(run)
    decoder = load_model(run, init_path or ensure_base_model(run, tokenizer), mesh, tokenizer)
    pad = score_pad_id(tokenizer)
    if pad is None:
        print(
            "ptrain: the tokenizer has neither a pad nor an end-of-sequence token; the exported reward "
            "model has no pad_token_id, so transformers scores it one unpadded row at a time",
            flush=True,
        )
    # Each side of a pair is read whole: at most seq_len + 1 tokens (`full_sequences`).
    model = RewardModel(
        decoder,
        rngs=nnx.Rngs(component_seed(run, "model.seed")),
        pad_token_id=pad,
        trained_tokens=run.train.seq_len + 1,
    )
    tx, lr = make_optimizer(run.optim, run.train.steps)
    placed = place_state(run, model, tx, mesh)
    return Stage(run, stage_dir, "rm", tokenizer, placed, tx, lr, router_bias_update(run, model), t_start)


def jit_pair_scores(model_def: ModelDef):
    """pair_scores(params, model_state, batch) -> (chosen [B], rejected [B]), jitted once."""
    return jax.jit(lambda params, model_state, batch: pair_scores(model_def, params, model_state, batch))


def pairwise_evaluator(run: RunConfig, scores, mesh, data_cfg, tokenizer):
    """Held-out metrics over the first train.eval_batches batches of the eval split: pairwise
    accuracy (r(chosen) > r(rejected)), mean margin, the Bradley-Terry loss (with the
    stage's margin and centring), and the mean and spread of the scores."""
    t, cfg, cut = run.train, run.algo.rm, preference_cut(run)

    def evaluate(state) -> dict:
        it = make_preference_iterator(
            data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, split="eval"
        )
        chosen, rejected = [], []
        for i, batch in enumerate(it):
            if i >= t.eval_batches:
                break
            batch = cut(batch)
            c, r = scores(state.params, state.model_state, put_global_batch(batch, batch_sharding(mesh)))
            keep = batch["pair_index"] >= 0
            chosen.append(host_array(c)[keep])  # rows on other processes' devices are gathered
            rejected.append(host_array(r)[keep])
        c = np.concatenate(chosen).astype(np.float64)
        r = np.concatenate(rejected).astype(np.float64)
        if not c.size:
            return {"pairs": 0.0}
        d = c - r
        loss = np.logaddexp(0.0, -(d - cfg.margin)) + cfg.center_rewards_coef * (c + r) ** 2
        both = np.concatenate([c, r])
        return {
            "accuracy": float(np.mean(d > 0)),
            "margin": float(np.mean(d)),
            "loss": float(np.mean(loss)),
            "reward_mean": float(np.mean(both)),
            "reward_std": float(np.std(both)),
            "pairs": float(c.size),
        }

    return evaluate


def rm_algorithm(run: RunConfig, model_def: ModelDef) -> Algorithm:
    """The Bradley-Terry loss of algo.rm, averaged over real pairs (+ the MoE balance term)."""
    t = run.train
    return Algorithm(
        objective=make_rm_objective(model_def, run.algo.rm, aux_loss_coef=run.model.router_aux_loss_coef),
        denominator=dpo_denominator,
        finalize=lambda m: finalize_rm_metrics(m, t.grad_accum),
        tokens_in=lambda b: int(np.sum(b["chosen_segment_ids"] > 0) + np.sum(b["rejected_segment_ids"] > 0)),
    )


def policy_env_pairs(run: RunConfig, stage_dir: str, init_path: str | None, tokenizer):
    """The DPO stage's environment pairs (algo.dpo.env_pairs and its sampling keys): the
    starting policy's own samples graded by the environments' verifiers, sampled here before
    the score head exists (the policy is placed for sampling, then dropped) or read back on
    resume (without loading the policy). Returns (training data config, held-out data config
    or None)."""
    import optax

    from ptrain.stages.env_pairs import env_pairs_data

    def policy():
        mesh = stage_mesh(run)
        decoder = load_model(run, init_path or ensure_base_model(run, tokenizer), mesh, tokenizer)
        placed = place_state(run, decoder, optax.set_to_zero(), mesh)
        return placed, placed.state.params, placed.state.model_state

    return env_pairs_data(run, stage_dir, policy, run.data, tokenizer)


def run_rm_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one reward-model stage; returns its summary after export."""
    t_start = time.time()
    if run.data.format != "preference":
        raise ValueError(
            f"stage '{run.stage.name}' is a reward-model stage but data.format is '{run.data.format}'; "
            "set data: {format: preference} in the stage (rows need prompt, chosen and rejected)"
        )
    tokenizer = tokenizer_for(run, init_path)
    held = None
    if run.algo.dpo.env_pairs:
        data_cfg, held = policy_env_pairs(run, stage_dir, init_path, tokenizer)
    else:
        data_cfg = stage_data(run, tokenizer)
    t = run.train
    stage = setup_rm_stage(run, stage_dir, init_path, tokenizer, t_start=t_start)
    placed = stage.placed
    train_iter = make_preference_iterator(
        data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, seed=data_cfg.shuffle_seed
    )
    print(f"ptrain: {train_iter.n_examples} preference pairs; {train_iter.report.summary()}", flush=True)
    evaluators = []
    eval_cfg = held or data_cfg
    if eval_cfg.eval_path is not None and t.eval_batches > 0:
        scores = jit_pair_scores(placed.model_def)
        evaluators.append(pairwise_evaluator(run, scores, placed.mesh, eval_cfg, tokenizer))
    algorithm = rm_algorithm(run, placed.model_def)
    return train_evaluate_export(
        stage,
        algorithm,
        IteratorBatches(train_iter, transform=preference_cut(run)),
        report=train_iter.report,
        evaluators=evaluators,
    )
