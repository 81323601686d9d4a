"""The SFT stage: data -> jitted step -> metrics, evaluation, checkpoints -> export.

A thin driver: every piece it calls is a pure function or a small helper in
stages/common.py, data/, train/ and models/.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ptrain.checkpoint import StageCheckpointer
from ptrain.config import RunConfig
from ptrain.data.pipeline import make_eval_prompts, make_sft_iterator, write_generated
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
from ptrain.stages.evaluation import exact_match_evaluator, heldout_loss_evaluator
from ptrain.train.objectives import finalize_metrics, make_sft_objective, sft_denominator
from ptrain.train.optim import make_optimizer
from ptrain.train.step import make_train_step


def run_sft_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one SFT stage; returns its summary (final metrics) after export."""
    t_start = time.time()
    tokenizer = tokenizer_for(run, init_path)
    data_cfg = write_generated(run.data, os.path.join(run.run_dir, "data"))
    t, mesh = run.train, stage_mesh(run)
    train_iter = make_sft_iterator(
        data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, seed=data_cfg.shuffle_seed
    )
    print(f"ptrain: {train_iter.n_examples} training examples; {train_iter.report.summary()}", flush=True)

    model = load_model(run, init_path or ensure_base_model(run, tokenizer), mesh, tokenizer)
    tx, lr = make_optimizer(run.optim, t.steps)
    placed = place_state(run, model, tx, mesh)
    norm = run.algo.sft.norm_constant or float(t.global_batch_size * t.seq_len)
    objective = make_sft_objective(
        placed.model_def, run.algo.sft, aux_loss_coef=run.model.router_aux_loss_coef, vocab_chunk=t.vocab_chunk
    )
    step_fn = jit_step(
        make_train_step(
            objective,
            sft_denominator(run.algo.sft, norm),
            tx,
            lr,
            grad_accum=t.grad_accum,
            post_update=router_bias_update(run, model),
        ),
        placed,
    )

    ckpt = StageCheckpointer(os.path.join(stage_dir, "checkpoints"), run.checkpoint)
    start, state, data_state = restore_or_start(ckpt, placed, run.checkpoint.resume)
    if data_state is not None:
        train_iter.set_state(data_state)

    evaluators = []
    if data_cfg.eval_path is not None and t.eval_batches > 0:
        evaluators.append(heldout_loss_evaluator(run, data_cfg, tokenizer, placed))
    if data_cfg.eval_path is not None and t.eval_generate > 0:
        prompts = make_eval_prompts(data_cfg, tokenizer, limit=t.eval_generate)
        if any(p.task for p in prompts):
            evaluators.append(exact_match_evaluator(run, prompts, tokenizer, placed))

    return train_evaluate_export(
        run,
        stage_dir=stage_dir,
        kind="sft",
        placed=placed,
        state=state,
        step_fn=step_fn,
        batches=train_iter,
        report=train_iter.report,
        evaluators=evaluators,
        checkpointer=ckpt,
        start_step=start,
        finalize=lambda m: finalize_metrics(m, t.grad_accum),
        tokens_in=lambda b: int(np.sum(b["segment_ids"] > 0)),
        tokenizer=tokenizer,
        t_start=t_start,
    )
