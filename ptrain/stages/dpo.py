"""The DPO stage (and its relatives: IPO, hinge, robust, dpo_norm, SimPO, ORPO, RPO).

Driver only: preference batches -> jitted step (policy vs frozen reference) -> metrics,
held-out preference and exact-match evaluation, checkpoints -> export. The reference is
the stage's starting weights: kept frozen in the train state and run inside each step,
or (algo.dpo.precompute_reference) run once over the data before training, so the step
carries one model instead of two.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from ptrain.config import RunConfig
from ptrain.config.choices import REFERENCE_FREE_KINDS
from ptrain.data.buckets import to_bucket
from ptrain.data.preference import make_preference_iterator, make_preference_pass
from ptrain.data.prompts import make_eval_prompts
from ptrain.parallel import batch_sharding
from ptrain.parallel.multihost import host_array, put_global_batch
from ptrain.stages.env_pairs import env_pairs_data
from ptrain.stages.heldout import ExactMatchEvaluator
from ptrain.stages.loop import Algorithm, IteratorBatches, train_evaluate_export
from ptrain.stages.policy_pairs import policy_pairs_data
from ptrain.stages.setup import setup_stage, stage_data, tokenizer_for
from ptrain.train.objectives import dpo_denominator, finalize_metrics, make_dpo_objective, pair_logprobs
from ptrain.train.state import ModelDef

# pair_logps(params, model_state, batch) -> (chosen [B], rejected [B]) summed completion log-probs, jitted
PairLogps = Callable[..., tuple[jax.Array, jax.Array]]


def jit_pair_logps(model_def: ModelDef) -> PairLogps:
    """Summed completion log-probs of both sides of a preference batch, jitted once for the stage
    (the reference passes over train and eval data and the held-out evaluation share it)."""
    return jax.jit(lambda params, model_state, batch: pair_logprobs(model_def, params, model_state, batch)[:2])


def preference_cut(run: RunConfig) -> Callable[[dict], dict]:
    """A preference batch cut to the bucket of its longest side (algo.dpo.bucket_lengths), or
    left at train.seq_len."""
    if not run.algo.dpo.bucket_lengths:
        return lambda batch: batch
    return lambda batch: to_bucket(batch, run.train.seq_len, run.mesh.context)


def reference_logprobs(
    pair_logps: PairLogps, mesh, params, model_state, data_cfg, tokenizer, *, batch_size: int, seq_len: int, split: str,
    cut: Callable[[dict], dict] = lambda batch: batch,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One in-order pass over a split: summed completion log-probs of (chosen, rejected) per pair
    (each batch passed through `cut`, `preference_cut`)."""
    it = make_preference_pass(data_cfg, tokenizer, batch_size=batch_size, seq_len=seq_len, split=split)
    chosen = np.zeros(it.n_examples, np.float32)
    rejected = np.zeros(it.n_examples, np.float32)
    for batch in it:
        batch = cut(batch)
        c, r = pair_logps(params, model_state, put_global_batch(batch, batch_sharding(mesh)))
        idx = batch["pair_index"]
        keep = idx >= 0
        chosen[idx[keep]] = host_array(c)[keep]  # rows on other processes' devices are gathered
        rejected[idx[keep]] = host_array(r)[keep]
    return chosen, rejected


def add_reference(chosen: np.ndarray, rejected: np.ndarray) -> Callable[[dict], dict]:
    """Batch transform: the precomputed reference log-probs of its pairs, looked up by pair index."""

    def add(batch: dict) -> dict:
        idx = np.maximum(batch["pair_index"], 0)
        return dict(batch, ref_chosen_logps=chosen[idx], ref_rejected_logps=rejected[idx])

    return add


def preference_evaluator(
    run: RunConfig, pair_logps: PairLogps, mesh, data_cfg, tokenizer, ref_eval: tuple[np.ndarray, np.ndarray]
):
    """Held-out preference metrics: the policy's own preference accuracy (logp chosen >
    logp rejected), the implicit-reward accuracy and margin against the reference."""
    t, beta, cut = run.train, run.algo.dpo.beta, preference_cut(run)

    def evaluate(state) -> dict:
        it = make_preference_iterator(
            data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, split="eval"
        )
        pref, reward_acc, margin, n = 0.0, 0.0, 0.0, 0
        for i, batch in enumerate(it):
            if i >= t.eval_batches:
                break
            batch = cut(batch)
            c, r = (
                host_array(x)
                for x in pair_logps(
                    state.merged_params(), state.model_state, put_global_batch(batch, batch_sharding(mesh))
                )
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


def dpo_algorithm(run: RunConfig, model_def: ModelDef) -> Algorithm:
    """The preference loss of algo.dpo.kind, averaged over real pairs (+ the MoE balance term)."""
    t = run.train
    return Algorithm(
        objective=make_dpo_objective(
            model_def, run.algo.dpo, vocab_chunk=t.vocab_chunk, aux_loss_coef=run.model.router_aux_loss_coef
        ),
        denominator=dpo_denominator,
        finalize=lambda m: finalize_metrics(m, t.grad_accum),
        tokens_in=lambda b: int(np.sum(b["chosen_segment_ids"] > 0) + np.sum(b["rejected_segment_ids"] > 0)),
    )


def run_dpo_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one preference-optimisation stage; returns its summary after export."""
    t_start = time.time()
    if run.data.format != "preference":
        raise ValueError(
            f"stage '{run.stage.name}' is a DPO stage but data.format is '{run.data.format}'; "
            "set data: {format: preference} in the stage (rows need prompt, chosen and rejected)"
        )
    tokenizer = tokenizer_for(run, init_path)
    # Environment pairs need no rows of data (source=envs writes chat demonstrations).
    data_cfg = run.data if run.algo.dpo.env_pairs else stage_data(run, tokenizer)
    t, algo = run.train, run.algo.dpo
    needs_ref = algo.kind not in REFERENCE_FREE_KINDS
    in_step_ref = needs_ref and not algo.precompute_reference
    stage = setup_stage(
        run, stage_dir, init_path, tokenizer, kind=algo.kind, t_start=t_start, with_reference=in_step_ref
    )
    placed = stage.placed
    # The reference is the starting weights: everything below that reads it runs before
    # train_evaluate_export restores a checkpoint.
    init_state = placed.state
    init_params, init_mstate = init_state.params, init_state.model_state  # the adapters alone under LoRA
    pref_eval_cfg = data_cfg  # whose eval split the held-out preference metrics read
    if algo.policy_pairs:
        data_cfg, held = policy_pairs_data(run, stage_dir, placed, init_params, init_mstate, data_cfg, tokenizer)
        pref_eval_cfg = held or data_cfg
    elif algo.env_pairs:
        data_cfg, held = env_pairs_data(run, stage_dir, lambda: (placed, init_params, init_mstate), data_cfg,
                                        tokenizer)  # fmt: skip
        pref_eval_cfg = held or data_cfg

    train_iter = make_preference_iterator(
        data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, seed=data_cfg.shuffle_seed
    )
    print(f"ptrain: {train_iter.n_examples} preference pairs; {train_iter.report.summary()}", flush=True)

    pair_logps = jit_pair_logps(placed.model_def)
    cut = preference_cut(run)
    passes = dict(batch_size=t.global_batch_size, seq_len=t.seq_len, cut=cut)
    batches = IteratorBatches(train_iter, transform=cut)
    if needs_ref and algo.precompute_reference:
        ref = reference_logprobs(
            pair_logps,
            placed.mesh,
            init_state.merged_params(),
            init_mstate,
            data_cfg,
            tokenizer,
            split="train",
            **passes,
        )
        with_ref = add_reference(*ref)
        batches = IteratorBatches(train_iter, transform=lambda batch: cut(with_ref(batch)))
    evaluators = []
    if pref_eval_cfg.eval_path is not None and t.eval_batches > 0:
        ref_eval = reference_logprobs(
            pair_logps,
            placed.mesh,
            init_state.merged_params(),
            init_mstate,
            pref_eval_cfg,
            tokenizer,
            split="eval",
            **passes,
        )
        evaluators.append(preference_evaluator(run, pair_logps, placed.mesh, pref_eval_cfg, tokenizer, ref_eval))
    if data_cfg.eval_path is not None and t.eval_generate > 0:
        prompts = make_eval_prompts(data_cfg, tokenizer, limit=t.eval_generate)
        if any(p.task for p in prompts):
            evaluators.append(ExactMatchEvaluator(run, prompts, tokenizer, placed))

    return train_evaluate_export(
        stage, dpo_algorithm(run, placed.model_def), batches, report=train_iter.report, evaluators=evaluators
    )
