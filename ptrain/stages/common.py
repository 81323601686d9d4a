"""Pieces every stage driver shares: the starting model, the sharded train state, the loop.

These are plain functions, not a Trainer: a stage file wires them together in a few
lines and owns what is particular to its algorithm (data, objective, evaluation).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain.checkpoint import StageCheckpointer, abstract_like
from ptrain.config import RunConfig
from ptrain.metrics import MetricsLogger, to_host
from ptrain.parallel import batch_sharding, make_mesh, replicated, shardings_for
from ptrain.parallel.sharding import DEFAULT_RULES, shardings_following_params
from ptrain.train.state import ModelDef, TrainState, logical_axes, split_model


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and what to try."""


def resolved(run: RunConfig) -> dict:
    """The stage's resolved config as plain JSON data (stored in every checkpoint)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(run), resolve=True)


def rules_of(run: RunConfig):
    return [tuple(r) for r in run.mesh.rules] if run.mesh.rules else list(DEFAULT_RULES)


def tokenizer_for(run: RunConfig, init_path: str | None):
    """The stage's tokenizer: data.tokenizer_path, else the starting model's, else the embedded one."""
    from ptrain.data.tokenizer import get_tokenizer, load_tokenizer

    if run.data.tokenizer_path is None and init_path and os.path.isfile(os.path.join(init_path, "tokenizer.json")):
        return load_tokenizer(init_path)
    return get_tokenizer(
        run.data.tokenizer_path, os.path.join(run.run_dir, "tokenizer"), vocab_size=run.data.tokenizer_vocab_size
    )


def ensure_base_model(run: RunConfig, tokenizer) -> str:
    """The embedded tiny model as a Hugging Face folder in <run_dir>/base_model (built once).

    Built from the model config with the tokenizer's vocabulary, saved with the tokenizer
    so the folder loads in transformers and SGLang like any published checkpoint.
    """
    import dataclasses

    from ptrain.models import Decoder, save_hf

    path = os.path.join(run.run_dir, "base_model")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = run.model
    if cfg.vocab_size == 0:
        cfg = dataclasses.replace(cfg, vocab_size=len(tokenizer))
    if cfg.vocab_size < len(tokenizer):
        raise ValueError(
            f"config key 'model.vocab_size': {cfg.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens; pass 0 to take the tokenizer's size"
        )
    model = Decoder(cfg, rngs=nnx.Rngs(cfg.seed))
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tmp, tokenizer=tokenizer)
    os.replace(tmp, path)
    return path


def load_model(run: RunConfig, path: str, mesh, tokenizer=None):
    """Load a Hugging Face folder straight onto the mesh, with the run's compute options.
    With `tokenizer`, its ids must fit the model's embedding (else out-of-range ids would
    read garbage rows and the loss turn NaN, which looks like divergence)."""
    from ptrain.models import load_hf

    m = run.model
    model = load_hf(
        path,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        mesh=mesh,
        rules=tuple(rules_of(run)),
        remat=m.remat,
        scan_layers=m.scan_layers,
        moe_implementation=m.moe_implementation,
        router_aux_loss_coef=m.router_aux_loss_coef,
        router_bias_update_rate=m.router_bias_update_rate,
    )
    vocab = model.cfg.vocab_size
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"the model in {path} has a vocabulary of {vocab} but the tokenizer has {len(tokenizer)} "
            "tokens; use the tokenizer saved with that model (data.tokenizer_path, or a folder with "
            "tokenizer.json beside config.json) or a model whose embedding covers it"
        )
    return model


@dataclass
class Placed:
    """A model split for pure steps, with its train state placed on the mesh."""

    model_def: ModelDef
    state: TrainState
    state_shardings: Any
    mesh: Any


def place_state(run: RunConfig, model, tx, mesh, *, with_reference: bool = False) -> Placed:
    """Split the model, build TrainState with shardings from the logical axis names.

    Optimizer-state shardings follow the params they mirror (from eval_shape of
    tx.init); scalars are explicitly replicated so nothing lands on one device only.
    """
    model_def, params, model_state = split_model(model)
    param_axes, state_axes = logical_axes(model)
    rules = rules_of(run)
    param_sh = shardings_for(params, param_axes, mesh, rules)
    mstate_sh = shardings_for(model_state, state_axes, mesh, rules)
    params = jax.device_put(params, param_sh)
    model_state = jax.device_put(model_state, mstate_sh)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = shardings_following_params(abstract_opt, params, param_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    rep = replicated(mesh)
    ref = jax.tree.map(jnp.copy, params) if with_reference else None
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep),
        params=params,
        opt_state=opt_state,
        rng=jax.device_put(jax.random.key_data(jax.random.key(run.train.seed)), rep),
        model_state=model_state,
        ref_params=ref,
    )
    shardings = TrainState(
        step=rep,
        params=param_sh,
        opt_state=opt_sh,
        rng=rep,
        model_state=mstate_sh,
        ref_params=param_sh if with_reference else None,
    )
    return Placed(model_def, state, shardings, mesh)


def jit_step(step_fn, placed: Placed):
    """jit once, here in the driver: state in/out shardings, batch split over data x fsdp, state donated."""
    return jax.jit(
        step_fn,
        in_shardings=(placed.state_shardings, batch_sharding(placed.mesh)),
        out_shardings=(placed.state_shardings, None),
        donate_argnums=(0,),
    )


def restore_or_start(ckpt: StageCheckpointer, placed: Placed, resume: bool):
    """(start step, state, data-iterator state or None) from the newest readable checkpoint."""
    if not resume:
        return 0, placed.state, None
    abstract = abstract_like(placed.state, placed.state_shardings)
    got = ckpt.restore_latest(abstract)
    if got is None:
        return 0, placed.state, None
    step, state, data_state, _ = got
    print(f"ptrain: resumed from checkpoint step {step} in {ckpt.directory}", flush=True)
    return step, state, data_state


def check_finite(step: int, metrics: dict) -> None:
    loss = metrics.get("loss")
    if loss is not None and not math.isfinite(loss):
        raise TrainingDiverged(
            f"loss is {loss} at step {step} (grad_norm {metrics.get('grad_norm')}); lower optim.lr, "
            "raise optim.warmup_steps or set optim.grad_clip, then re-launch (it resumes from the last checkpoint)"
        )


def train_loop(
    run: RunConfig,
    *,
    state: TrainState,
    step_fn: Callable,
    batches: Iterator[dict],
    data_state: Callable[[], Any],
    mesh,
    checkpointer: StageCheckpointer,
    logger: MetricsLogger,
    start_step: int,
    finalize: Callable[[dict], dict],
    tokens_in: Callable[[dict], int],
    evaluate: Callable[[TrainState, int], dict] | None = None,
    meta: dict | None = None,
) -> tuple[TrainState, dict]:
    """The thin driver loop: batch -> jitted step -> metrics (one step behind) -> checkpoints/evals.

    Metrics of step t are fetched after step t+1 has been dispatched, so the host never
    waits on the device just to log; the NaN check therefore also runs one step behind.
    """
    total = run.train.steps
    sharding = batch_sharding(mesh)
    pending = None  # (step, device metrics, tokens, step wall time)
    last: dict = {}
    t_prev = time.time()

    def drain(p):
        nonlocal last
        step, dev_metrics, tokens, dt = p
        host = finalize(to_host(dev_metrics))
        host.update(step_time_s=dt, tokens_per_s=tokens / max(dt, 1e-9), tokens=tokens)
        if run.train.nan_check:
            check_finite(step, host)
        if step % run.logging.log_every == 0 or step == total:
            logger.log(step, host)
        last = host

    for step in range(start_step + 1, total + 1):
        batch = next(batches)
        tokens = tokens_in(batch)
        state, metrics = step_fn(state, jax.device_put(batch, sharding))
        # Step time = time between consecutive returns of the step call: with asynchronous
        # dispatch the loop is paced by the device (drain blocks on the previous step), with
        # synchronous dispatch (CPU) it is the compute itself. Either way no extra sync.
        now = time.time()
        dt, t_prev = now - t_prev, now
        if pending is not None:
            drain(pending)
        pending = (step, metrics, tokens, dt)
        # Evaluate before saving: a run killed between the two then redoes this step's
        # evaluation on resume, instead of resuming past it with the evaluation lost.
        if evaluate is not None and (step == total or (run.train.eval_every and step % run.train.eval_every == 0)):
            drain(pending)
            pending = None
            eval_metrics = evaluate(state, step)
            logger.log(step, eval_metrics, prefix="eval")
            last.update({f"eval/{k}": v for k, v in eval_metrics.items()})
            t_prev = time.time()  # evaluation time is not training time
        if checkpointer.should_save(step, total):
            if pending is not None:
                drain(pending)  # the step's metrics reach the JSONL before its checkpoint exists
                pending = None
            checkpointer.save(step, state, data_state(), dict(meta or {}, step=step, metrics=last))
    if pending is not None:
        drain(pending)
    checkpointer.wait()
    return state, last


def export_stage(placed: Placed, state: TrainState, stage_dir: str, tokenizer) -> str:
    """Write the stage's final weights as a Hugging Face folder (atomically)."""
    from ptrain.models import save_hf

    model = placed.model_def.bind(state.params, state.model_state)
    out = os.path.join(stage_dir, "export")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tmp, tokenizer=tokenizer)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def stage_mesh(run: RunConfig):
    from ptrain.config.run import check_mesh_fits

    check_mesh_fits(run, jax.device_count())
    return make_mesh(run.mesh)


def train_evaluate_export(
    run: RunConfig,
    *,
    stage_dir: str,
    kind: str,
    placed: Placed,
    state: TrainState,
    step_fn: Callable,
    batches,
    report,
    evaluators: list[Callable[[TrainState], dict]],
    checkpointer: StageCheckpointer,
    start_step: int,
    finalize: Callable[[dict], dict],
    tokens_in: Callable[[dict], int],
    tokenizer,
    t_start: float,
) -> dict:
    """The part every stage driver ends with: log the data report and the step-0
    evaluation, run the loop, export the final weights, write DONE.json.

    `batches` is the stage's batch iterator (with get_state), `report` its bad-row report.
    Returns the stage summary (final train and eval metrics, export path, wall time).
    """
    from ptrain.checkpoint import mark_done

    name = run.stages[0].name

    def evaluate(state: TrainState, step: int) -> dict:
        out: dict = {}
        for ev in evaluators:
            out.update(ev(state))
        return out

    logger = MetricsLogger(
        run.logging, stage_dir, total_steps=run.train.steps, start_step=start_step, name=f"{kind} {name}"
    )
    try:
        if start_step == 0:
            logger.log(0, report.as_metrics(prefix=""), prefix="data")
            if evaluators:
                logger.log(0, evaluate(state, 0), prefix="eval")
        state, last = train_loop(
            run,
            state=state,
            step_fn=step_fn,
            batches=batches,
            data_state=batches.get_state,
            mesh=placed.mesh,
            checkpointer=checkpointer,
            logger=logger,
            start_step=start_step,
            finalize=finalize,
            tokens_in=tokens_in,
            evaluate=evaluate if evaluators else None,
            meta={"stage": name, "kind": kind, "config": resolved(run)},
        )
    finally:
        checkpointer.close()
        logger.close()
    export = export_stage(placed, state, stage_dir, tokenizer)
    summary = {k: v for k, v in last.items() if isinstance(v, float)}
    summary.update(
        stage=name,
        steps=run.train.steps,
        export=export,
        bad_rows=report.bad,
        wall_time_s=round(time.time() - t_start, 1),
    )
    mark_done(stage_dir, summary)
    return summary


def router_bias_update(run: RunConfig, model):
    """The aux-loss-free router-bias update (DeepSeek-V3) as a post-update hook, or None.

    The train state keeps non-trainable variables as a pure dict; the model's own update
    works on an nnx.State, so the dict is poured into a copy of the model's state template.
    """
    if not run.model.n_experts or run.model.router_bias_update_rate <= 0:
        return None
    from flax import nnx

    from ptrain.models import update_router_bias

    rate, accum = run.model.router_bias_update_rate, run.train.grad_accum
    template = nnx.split(model, nnx.Param, ...)[2]

    def update(model_state, metrics):
        state = jax.tree.map(lambda x: x, template)  # fresh Variables; the template stays untouched
        nnx.replace_by_pure_dict(state, model_state)
        state = update_router_bias(state, metrics["expert_load"] / accum, rate)
        return nnx.to_pure_dict(state)

    return update
