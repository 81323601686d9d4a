"""The SFT stage: data -> jitted step -> metrics, evaluation, checkpoints -> export.

A thin driver: every piece it calls is a pure function or a small helper in
stages/setup.py, stages/loop.py, data/, train/ and models/.
"""

from __future__ import annotations

import time

import numpy as np

from ptrain.config import RunConfig
from ptrain.data.prompts import make_eval_prompts
from ptrain.data.sft import make_sft_iterator
from ptrain.stages.heldout import ExactMatchEvaluator, heldout_loss_evaluator
from ptrain.stages.loop import Algorithm, IteratorBatches, train_evaluate_export
from ptrain.stages.setup import setup_stage, stage_data, tokenizer_for
from ptrain.train.objectives import finalize_metrics, make_sft_objective, sft_denominator
from ptrain.train.state import ModelDef


def sft_algorithm(run: RunConfig, model_def: ModelDef) -> Algorithm:
    """Cross-entropy on the loss-masked targets, aggregated as algo.sft says (+ the MoE balance term)."""
    t = run.train
    norm = run.algo.sft.norm_constant or float(t.global_batch_size * t.seq_len)
    return Algorithm(
        objective=make_sft_objective(
            model_def, run.algo.sft, aux_loss_coef=run.model.router_aux_loss_coef, vocab_chunk=t.vocab_chunk
        ),
        denominator=sft_denominator(run.algo.sft, norm),
        finalize=lambda m: finalize_metrics(m, t.grad_accum),
        tokens_in=lambda b: int(np.sum(b["segment_ids"] > 0)),
    )


def run_sft_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one SFT stage; returns its summary (final metrics) after export."""
    t_start = time.time()
    tokenizer = tokenizer_for(run, init_path)
    data_cfg = stage_data(run, tokenizer)
    t = run.train
    train_iter = make_sft_iterator(
        data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, seed=data_cfg.shuffle_seed
    )
    print(f"ptrain: {train_iter.n_examples} training examples; {train_iter.report.summary()}", flush=True)
    stage = setup_stage(run, stage_dir, init_path, tokenizer, kind="sft", t_start=t_start)

    evaluators = []
    if data_cfg.eval_path is not None and t.eval_batches > 0:
        evaluators.append(heldout_loss_evaluator(run, data_cfg, tokenizer, stage.placed))
    if data_cfg.eval_path is not None and t.eval_generate > 0:
        prompts = make_eval_prompts(data_cfg, tokenizer, limit=t.eval_generate)
        if any(p.task for p in prompts):
            evaluators.append(ExactMatchEvaluator(run, prompts, tokenizer, stage.placed))

    return train_evaluate_export(
        stage,
        sft_algorithm(run, stage.placed.model_def),
        IteratorBatches(train_iter),
        report=train_iter.report,
        evaluators=evaluators,
    )
