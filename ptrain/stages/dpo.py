"""The DPO stage (and its relatives: IPO, hinge, robust, dpo_norm, SimPO, ORPO, RPO).

Driver only: preference batches -> jitted step (policy vs frozen reference) -> metrics,
held-out preference and exact-match evaluation, checkpoints -> export. The reference is
the stage's starting weights: kept frozen in the train state and run inside each step,
or (algo.dpo.precompute_reference) run once over the data before training, so the step
carries one model instead of two.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from ptrain.checkpoint import StageCheckpointer
from ptrain.config import RunConfig
from ptrain.data.pipeline import make_eval_prompts, write_generated
from ptrain.data.preference import make_preference_iterator, make_preference_pass
from ptrain.parallel import batch_sharding
from ptrain.stages.common import (
    ensure_base_model,
    jit_step,
    load_model,
    place_state,
    restore_or_start,
    router_bias_update,
    stage_mesh,
    tokenizer_for,
    train_evaluate_export,
)
from ptrain.stages.evaluation import exact_match_evaluator
from ptrain.stages.policy_pairs import policy_pairs_data
from ptrain.train.objectives import dpo_denominator, finalize_metrics, make_dpo_objective, pair_logprobs
from ptrain.train.optim import make_optimizer
from ptrain.train.step import make_train_step

REFERENCE_FREE = ("simpo", "orpo")


def reference_logprobs(
    placed, params, model_state, data_cfg, tokenizer, *, batch_size: int, seq_len: int, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """One in-order pass over a split: summed completion log-probs of (chosen, rejected) per pair."""
    fn = jax.jit(lambda p, s, b: pair_logprobs(placed.model_def, p, s, b)[:2])
    it = make_preference_pass(data_cfg, tokenizer, batch_size=batch_size, seq_len=seq_len, split=split)
    chosen = np.zeros(it.n_examples, np.float32)
    rejected = np.zeros(it.n_examples, np.float32)
    for batch in it:
        c, r = fn(params, model_state, jax.device_put(batch, batch_sharding(placed.mesh)))
        idx = batch["pair_index"]
        keep = idx >= 0
        chosen[idx[keep]] = np.asarray(c)[keep]
        rejected[idx[keep]] = np.asarray(r)[keep]
    return chosen, rejected


class WithReference:
    """Wraps a preference iterator: adds precomputed reference log-probs by pair index."""

    def __init__(self, it, chosen: np.ndarray, rejected: np.ndarray):
        self.it, self.chosen, self.rejected = it, chosen, rejected

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.it)
        idx = np.maximum(batch["pair_index"], 0)
        return dict(batch, ref_chosen_logps=self.chosen[idx], ref_rejected_logps=self.rejected[idx])

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state) -> None:
        self.it.set_state(state)


def preference_evaluator(run: RunConfig, placed, data_cfg, tokenizer, ref_eval: tuple[np.ndarray, np.ndarray]):
    """Held-out preference metrics: the policy's own preference accuracy (logp chosen >
    logp rejected), the implicit-reward accuracy and margin against the reference."""
    t, beta = run.train, run.algo.dpo.beta
    fn = jax.jit(lambda p, s, b: pair_logprobs(placed.model_def, p, s, b)[:2])

    def evaluate(state) -> dict:
        it = make_preference_iterator(
            data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, split="eval"
        )
        pref, reward_acc, margin, n = 0.0, 0.0, 0.0, 0
        for i, batch in enumerate(it):
            if i >= t.eval_batches:
                break
            c, r = (
                np.asarray(x)
                for x in fn(state.params, state.model_state, jax.device_put(batch, batch_sharding(placed.mesh)))
            )
            keep = batch["pair_index"] >= 0
            idx = batch["pair_index"][keep]
            c, r = c[keep], r[keep]
            m = beta * ((c - ref_eval[0][idx]) - (r - ref_eval[1][idx]))
            pref += float(np.sum(c > r))
            reward_acc += float(np.sum(m > 0))
            margin += float(np.sum(m))
            n += int(keep.sum())
        n = max(n, 1)
        return {"preference_accuracy": pref / n, "reward_accuracy": reward_acc / n, "margin": margin / n}

    return evaluate


def run_dpo_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one preference-optimisation stage; returns its summary after export."""
    t_start = time.time()
    if run.data.format != "preference":
        raise ValueError(
            f"stage '{run.stages[0].name}' is a DPO stage but data.format is '{run.data.format}'; "
            "set data: {format: preference} in the stage (rows need prompt, chosen and rejected)"
        )
    tokenizer = tokenizer_for(run, init_path)
    data_cfg = write_generated(run.data, os.path.join(run.run_dir, "data"))
    t, algo, mesh = run.train, run.algo.dpo, stage_mesh(run)
    model = load_model(run, init_path or ensure_base_model(run, tokenizer), mesh, tokenizer)
    tx, lr = make_optimizer(run.optim, t.steps)
    needs_ref = algo.kind not in REFERENCE_FREE
    in_step_ref = needs_ref and not algo.precompute_reference
    placed = place_state(run, model, tx, mesh, with_reference=in_step_ref)
    init_params, init_mstate = placed.state.params, placed.state.model_state
    if algo.policy_pairs:
        data_cfg = policy_pairs_data(run, stage_dir, placed, init_params, init_mstate, data_cfg, tokenizer)

    train_iter = make_preference_iterator(
        data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, seed=data_cfg.shuffle_seed
    )
    print(f"ptrain: {train_iter.n_examples} preference pairs; {train_iter.report.summary()}", flush=True)

    batches = train_iter
    if needs_ref and algo.precompute_reference:
        # The reference is the starting weights: computed before any checkpoint is restored.
        ref = reference_logprobs(
            placed,
            init_params,
            init_mstate,
            data_cfg,
            tokenizer,
            batch_size=t.global_batch_size,
            seq_len=t.seq_len,
            split="train",
        )
        batches = WithReference(train_iter, *ref)
    evaluators = []
    if data_cfg.eval_path is not None and t.eval_batches > 0:
        ref_eval = reference_logprobs(
            placed,
            init_params,
            init_mstate,
            data_cfg,
            tokenizer,
            batch_size=t.global_batch_size,
            seq_len=t.seq_len,
            split="eval",
        )
        evaluators.append(preference_evaluator(run, placed, data_cfg, tokenizer, ref_eval))
    if data_cfg.eval_path is not None and t.eval_generate > 0:
        prompts = make_eval_prompts(data_cfg, tokenizer, limit=t.eval_generate)
        if any(p.task for p in prompts):
            evaluators.append(exact_match_evaluator(run, prompts, tokenizer, placed))

    objective = make_dpo_objective(
        placed.model_def, algo, vocab_chunk=t.vocab_chunk, aux_loss_coef=run.model.router_aux_loss_coef
    )
    step_fn = jit_step(
        make_train_step(
            objective, dpo_denominator, tx, lr, grad_accum=t.grad_accum, post_update=router_bias_update(run, model)
        ),
        placed,
    )
    ckpt = StageCheckpointer(os.path.join(stage_dir, "checkpoints"), run.checkpoint)
    start, state, data_state = restore_or_start(ckpt, placed, run.checkpoint.resume)
    if data_state is not None:
        batches.set_state(data_state)

    return train_evaluate_export(
        run,
        stage_dir=stage_dir,
        kind=algo.kind,
        placed=placed,
        state=state,
        step_fn=step_fn,
        batches=batches,
        report=train_iter.report,
        evaluators=evaluators,
        checkpointer=ckpt,
        start_step=start,
        finalize=lambda m: finalize_metrics(m, t.grad_accum),
        tokens_in=lambda b: int(np.sum(b["chosen_segment_ids"] > 0) + np.sum(b["rejected_segment_ids"] > 0)),
        tokenizer=tokenizer,
        t_start=t_start,
    )
