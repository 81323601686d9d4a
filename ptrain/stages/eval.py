"""The eval stage (`kind: eval`): run a model on environments and report, per environment,
reward, pass@k, lengths, tool use and token counts.

    python -m ptrain recipe=eval model=hf model.hf_path=DIR env=countdown
    stages: [{name: sft, kind: sft}, {name: eval, kind: eval}]      # ends any recipe

It trains nothing: its metrics go to metrics.jsonl (step 0) and DONE.json, every episode to
audit.jsonl, each held-out task's accuracy to scores.json ({decoding: {env: {task id:
accuracy}}}, what a paired comparison of two models reads), and a later stage starts from
the weights this one evaluated (the pipeline looks through eval stages for "previous").

With `algo.eval.lm_eval.tasks` set, the stage also runs those lm-evaluation-harness tasks
against its engine, served in process on a loopback port with ptrain.serve's routes
(`ptrain.serve.lm_harness`); their metrics join the stage's as `eval/lm_eval/<task>/<metric>`,
and lm-eval's results go to lm_eval.json.

As several JAX processes (sampling from a fleet), process 0 evaluates and the others wait.
"""

from __future__ import annotations

import os
import time

from ptrain.config import ConfigError, RunConfig
from ptrain.parallel.multihost import barrier, is_primary, on_primary
from ptrain.stages.loop import StageStopped
from ptrain.stages.setup import ensure_base_model, load_model, stage_mesh, tokenizer_for


def run_eval_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Evaluate the model at init_path (None: the embedded one) on the stage's environments."""
    import dataclasses

    from ptrain.checkpoint import mark_done
    from ptrain.config.seeds import component_seed
    from ptrain.envs.audit import AuditLog
    from ptrain.envs.registry import close_envs, make_env
    from ptrain.metrics import MetricsLogger
    from ptrain.rollout.engines import make_engine
    from ptrain.rollout.protocol import EngineUnavailable
    from ptrain.train.state import split_model

    t_start = time.time()
    stage = run.stage
    configs = [run.envs[n] for n in (stage.envs or sorted(run.envs))]
    # An environment without held-out tasks would be skipped, and the stage would end
    # "done" with no metrics at all.
    empty = [e.env_name for e in configs if e.n_eval == 0]
    if empty:
        raise ConfigError(
            f"config key 'envs.{empty[0]}.n_eval': eval stage '{stage.name}' samples held-out tasks, and "
            f"{empty} have none (n_eval=0); pass envs.{empty[0]}.n_eval=N, or leave them out of the stage's envs list"
        )
    if run.rollout.kind == "local" and run.algo.eval.samples > run.rollout.max_running_requests:
        # The engine refuses a request whose n samples do not fit its slots at once.
        raise ConfigError(
            f"config key 'algo.eval.samples': eval stage '{stage.name}' samples {run.algo.eval.samples} at once per "
            f"task, but the local engine decodes at most rollout.max_running_requests="
            f"{run.rollout.max_running_requests}; raise that or lower samples"
        )
    if run.algo.eval.lm_eval.tasks and run.rollout.kind != "local":
        raise ConfigError(
            f"config key 'algo.eval.lm_eval.tasks': eval stage '{stage.name}' serves its local engine to lm-eval, "
            f"and rollout.kind is '{run.rollout.kind}'; pass rollout=local, or point lm_eval's local-completions "
            "model at the fleet's router yourself"
        )
    tokenizer = tokenizer_for(run, init_path)
    mesh = stage_mesh(run)
    model_dir = init_path or ensure_base_model(run, tokenizer)
    model = load_model(run, model_dir, mesh, tokenizer)
    envs = {e.env_name: make_env(e, tokenizer=tokenizer, sandbox=run.sandbox) for e in configs}
    # The whole context the model was built for (an evaluation has no train.seq_len to fit).
    run = dataclasses.replace(
        run,
        rollout=dataclasses.replace(run.rollout, context_length=run.rollout.context_length or model.cfg.max_seq_len),
    )
    model_def, params, model_state = split_model(model)
    engine = make_engine(run, model_def, params, model_state, mesh=mesh, tokenizer=tokenizer,
                         seed=component_seed(run, "train.seed"), stage_dir=stage_dir)  # fmt: skip
    # As several JAX processes (from a fleet): every process exports its share of the weights,
    # process 0 samples, scores and writes, and the others get its metrics.
    primary = is_primary()
    sinks = run.logging if primary else dataclasses.replace(run.logging, console=False, jsonl=False, tensorboard=False)
    logger = MetricsLogger(sinks, stage_dir, total_steps=1, start_step=0, name=f"eval {stage.name}")
    audit = AuditLog(os.path.join(stage_dir, "audit.jsonl")) if primary else None
    try:
        # A fleet gets these weights now (the local engine has them already); every process
        # writes its share, and process 0 alone pushes, so only it can see the push fail.
        refused = None
        if run.rollout.kind != "local":
            try:
                engine.update_weights(params, model_state or None, weight_version="eval", mode="abort")
            except EngineUnavailable as e:
                refused = e

        def evaluate() -> dict:
            if refused is not None:
                raise refused
            return _evaluate(run, envs, engine, tokenizer, model_dir, stage_dir, audit)

        metrics = on_primary(evaluate, f"eval stage '{stage.name}'", keep=(EngineUnavailable,))
        logger.log(0, metrics, prefix="eval")
    except EngineUnavailable as e:
        # Nothing to checkpoint: the stage is not marked done, so a re-launch evaluates afresh.
        raise StageStopped(
            f"{e} -- eval stage '{stage.name}' stopped unfinished; once the engine can sample again, re-launch "
            "the same command"
        ) from None
    finally:
        engine.close()
        close_envs(envs)
        if audit is not None:
            audit.close()
        logger.close()
    summary = {f"eval/{k}": v for k, v in metrics.items()}
    summary.update(stage=stage.name, model=init_path or "embedded", wall_time_s=round(time.time() - t_start, 1))
    if primary:
        mark_done(stage_dir, summary)
    barrier("ptrain:eval-done")  # the others read DONE.json next (pipeline.stage_result)
    return summary


def _evaluate(run: RunConfig, envs: dict, engine, tokenizer, model_dir: str, stage_dir: str, audit) -> dict:
    """The stage's metrics: the environments' held-out tasks, the judge's calibration, and
    lm-eval's tasks, as algo.eval asks; scores per task to scores.json."""
    from ptrain.checkpoint import write_json_atomic
    from ptrain.config.seeds import component_seed
    from ptrain.stages.env_metrics import evaluate_envs

    cfg = run.algo.eval
    seed = component_seed(run, "train.seed")
    by_task: dict = {}
    metrics = evaluate_envs(envs, engine, cfg, seed=seed, audit=audit, strict=True, by_task=by_task)
    if cfg.judge_calibration:
        metrics.update(judge_agreement(envs, engine, cfg.judge_calibration, seed=seed))
    if cfg.lm_eval.tasks:
        from ptrain.serve.lm_harness import run_lm_eval  # lm-eval is optional: loaded only when asked

        results_path = os.path.join(stage_dir, "lm_eval.json")
        metrics.update(run_lm_eval(engine, tokenizer, cfg.lm_eval, model_path=model_dir, results_path=results_path))
    write_json_atomic(os.path.join(stage_dir, "scores.json"), by_task)
    return metrics


def judge_agreement(envs: dict, engine, path: str, *, seed: int) -> dict[str, float]:
    """judge_calibration/agreement and its counts: the stage's judge environment on a calibration JSONL
    (algo.eval.judge_calibration). ConfigError when the stage has no judge environment or a
    row lacks a field."""
    import asyncio
    import json

    from ptrain.envs.judge import JudgeEnv

    judges = [e for e in envs.values() if isinstance(e, JudgeEnv)]
    if not judges:
        raise ConfigError(
            f"config key 'algo.eval.judge_calibration': the stage has no judge environment to calibrate; add one "
            f"(env=judge) to its envs, or leave judge_calibration null (envs: {sorted(envs)})"
        )
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"config key 'algo.eval.judge_calibration': {path}:{n} is not JSON ({e})") from None
            missing = [k for k in ("messages", "response_1", "response_2", "better") if k not in row]
            if missing or row.get("better") not in (1, 2):
                raise ConfigError(
                    f"config key 'algo.eval.judge_calibration': {path}:{n} needs messages, response_1, response_2 and "
                    f"better (1 or 2); missing {missing}, better={row.get('better')!r}"
                )
            rows.append(row)
    out = asyncio.run(judges[0].calibrate(rows, engine, seed=seed))
    return {f"judge_calibration/{k}": v for k, v in out.items()}
