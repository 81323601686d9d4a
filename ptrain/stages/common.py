"""Pieces every stage driver shares: the starting model, the sharded train state, the loop.

These are plain functions and two small records, not a Trainer. A driver builds

  - a `Stage` (`setup_stage`): tokenizer, model placed on the mesh, optimizer;
  - an `Algorithm`: its pure objective and denominator (ptrain.train.step), how its summed
    metrics read on the host, how many tokens a batch holds;
  - its `Batches`: next batch, get/set state for checkpoints, and a hook after every step
    (where an RL stage pushes the new weights to its rollout engine);

and hands them to `train_evaluate_export`, which restores the newest checkpoint, builds and
jits the step once, runs the loop with evaluations and checkpoints, and exports.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain.checkpoint import StageCheckpointer, abstract_like
from ptrain.config import RunConfig
from ptrain.config.seeds import component_seed
from ptrain.metrics import MetricsLogger, to_host
from ptrain.parallel import batch_sharding, make_mesh, replicated, shardings_for
from ptrain.parallel.sharding import DEFAULT_RULES, shardings_following_params
from ptrain.train.state import ModelDef, TrainState, logical_axes, split_model
from ptrain.train.step import Denominator, Objective, PostUpdate, make_train_step


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and what to try."""


class StageStopped(RuntimeError):
    """The stage saved a resumable checkpoint and stopped (its rollout engine could not sample);
    the message says why and that re-launching resumes."""

    @classmethod
    def at(cls, stage_name: str, step: int, error: BaseException) -> StageStopped:
        if step == 0:  # a fresh stage that stopped before its first step has nothing saved
            return cls(
                f"{error} -- stage '{stage_name}' stopped before its first step (no checkpoint was needed); "
                "once the engine can sample again, re-launch the same command to start it"
            )
        return cls(
            f"{error} -- stage '{stage_name}' has its checkpoint at step {step} and stopped; once the engine "
            "can sample again, re-launch the same command to resume"
        )


def resolved(run: RunConfig) -> dict:
    """The stage's resolved config as plain JSON data (stored in every checkpoint)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(run), resolve=True)


def rules_of(run: RunConfig):
    return [tuple(r) for r in run.mesh.rules] if run.mesh.rules else list(DEFAULT_RULES)


def tokenizer_for(run: RunConfig, init_path: str | None):
    """The stage's tokenizer: data.tokenizer_path, else the starting model's (init_path, a
    model folder), else, for the embedded model (no init_path), the embedded one."""
    from ptrain.config import ConfigError
    from ptrain.data.tokenizer import get_tokenizer, load_tokenizer

    if run.data.tokenizer_path is None and init_path:
        if not os.path.isfile(os.path.join(init_path, "tokenizer.json")):
            # The embedded tokenizer's ids are not this model's: every prompt and answer would
            # be garbage, and every score 0.
            raise ConfigError(
                f"config key 'data.tokenizer_path': the model folder '{init_path}' has no tokenizer.json; pass "
                "data.tokenizer_path=DIR, a folder with the model's tokenizer.json"
            )
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
    model = Decoder(cfg, rngs=nnx.Rngs(component_seed(run, "model.seed")))
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
        rng=jax.device_put(jax.random.key_data(jax.random.key(component_seed(run, "train.seed"))), rep),
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


@dataclass(frozen=True)
class Algorithm:
    """What a stage kind brings to the shared loop."""

    objective: Objective
    """Pure objective(params, state, micro_batch, denominator) -> (loss share, summed metrics)."""
    denominator: Denominator
    """Pure denominator(global batch), computed once per step for exact accumulation."""
    finalize: Callable[[dict], dict]
    """Host side: the step's fetched metrics (summed over micro-batches) -> the logged ones."""
    tokens_in: Callable[[dict], int]
    """Tokens a host batch holds (for tokens/s)."""


class Batches(Protocol):
    """The training batches of a stage as the loop reads them."""

    def __next__(self) -> dict:
        """The next global batch (numpy arrays)."""
        ...

    def get_state(self) -> Any:
        """Position to save with a checkpoint (pytree or dict of plain values)."""
        ...

    def set_state(self, state: Any) -> None:
        """Continue from a position get_state returned (on resume)."""
        ...

    def begin(self, step: int, state: TrainState) -> None:
        """Called once before the stage's first evaluation and step, with the state it starts
        from (fresh, or restored at `step`). An RL stage brings its rollout engine to these
        weights here."""
        ...

    def after_step(self, step: int, state: TrainState, metrics: dict) -> None:
        """Called once step `step` is dispatched, with the new state and the step's metrics
        (device arrays, not yet fetched: reading one waits for the step). An RL stage pushes
        the new weights to its rollout engine here."""
        ...


class IteratorBatches:
    """Batches from a data iterator with get_state/set_state (a grain_ops.DataIterator),
    each optionally passed through `transform` (e.g. to add precomputed reference values);
    nothing happens after a step."""

    def __init__(self, iterator, transform: Callable[[dict], dict] | None = None):
        self.iterator, self.transform = iterator, transform

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        return self.transform(batch) if self.transform is not None else batch

    def get_state(self) -> Any:
        return self.iterator.get_state()

    def set_state(self, state: Any) -> None:
        self.iterator.set_state(state)

    def begin(self, step: int, state: TrainState) -> None:
        pass

    def after_step(self, step: int, state: TrainState, metrics: dict) -> None:
        pass


@dataclass
class Stage:
    """One stage as its driver set it up: what the loop, the evaluators and the export read."""

    run: RunConfig
    """The stage's own config (stage_config: top-level nodes with its overrides)."""
    dir: str
    """<run_dir>/stages/<name>: checkpoints/, export/, metrics.jsonl, DONE.json."""
    kind: str
    """Shown in the progress bar and saved in checkpoints: sft, or the preference loss (sigmoid, ...)."""
    tokenizer: Any
    placed: Placed
    """The starting model split for pure steps, its train state on the mesh."""
    tx: Any
    """The optax optimizer."""
    lr: Callable[[Any], Any]
    """The learning-rate schedule (for the step's lr metric)."""
    post_update: PostUpdate | None
    """Model-state update after each optimizer step (the MoE router bias), or None."""
    t_start: float
    """time.time() when the driver started (for the summary's wall time)."""

    @property
    def name(self) -> str:
        return self.run.stage.name


def setup_stage(
    run: RunConfig,
    stage_dir: str,
    init_path: str | None,
    tokenizer,
    *,
    kind: str,
    t_start: float,
    with_reference: bool = False,
    frozen: tuple[str, ...] = (),
) -> Stage:
    """The mesh, the starting model on it (the embedded one when init_path is None), the
    optimizer (parameters named in `frozen` never change) and the placed train state (with
    a frozen reference copy when asked)."""
    from ptrain.train.optim import make_optimizer

    mesh = stage_mesh(run)
    model = load_model(run, init_path or ensure_base_model(run, tokenizer), mesh, tokenizer)
    _check_frozen_names(model, frozen, kind)
    tx, lr = make_optimizer(run.optim, run.train.steps, frozen=frozen)
    placed = place_state(run, model, tx, mesh, with_reference=with_reference)
    return Stage(run, stage_dir, kind, tokenizer, placed, tx, lr, router_bias_update(run, model), t_start)


FREEZE_OPTIONS = {"router": "algo.grpo.freeze_router"}
"""The option that freezes each parameter name, for the error when the model has none."""


def _check_frozen_names(model, frozen: tuple[str, ...], kind: str) -> None:
    """A frozen name that matches no parameter would silently train everything."""
    from ptrain.config import ConfigError

    paths = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    names = {getattr(k, "key", getattr(k, "name", None)) for path, _ in paths for k in path}
    for name in frozen:
        if name not in names:
            option = FREEZE_OPTIONS.get(name, f"freezing '{name}'")
            raise ConfigError(
                f"{option}: the {kind} stage's model has no '{name}' parameters ({model.cfg.family}, "
                f"{'MoE' if model.cfg.is_moe else 'dense'}), so nothing would stay fixed; set {option}=false"
            )


def build_step(stage: Stage, algorithm: Algorithm):
    """The stage's jitted step(state, batch) -> (state, metrics), built once."""
    step = make_train_step(
        algorithm.objective,
        algorithm.denominator,
        stage.tx,
        stage.lr,
        grad_accum=stage.run.train.grad_accum,
        post_update=stage.post_update,
    )
    return jit_step(step, stage.placed)


def train_loop(
    stage: Stage,
    algorithm: Algorithm,
    batches: Batches,
    state: TrainState,
    *,
    start_step: int,
    checkpointer: StageCheckpointer,
    logger: MetricsLogger,
    evaluate: Callable[[TrainState, int], dict] | None = None,
) -> tuple[TrainState, dict]:
    """The thin driver loop: batch -> jitted step -> metrics (one step behind) -> checkpoints/evals.

    Metrics of step t are fetched after step t+1 has been dispatched, so the host never
    waits on the device just to log; the NaN check therefore also runs one step behind.
    """
    run = stage.run
    total = run.train.steps
    step_fn = build_step(stage, algorithm)
    sharding = batch_sharding(stage.placed.mesh)
    meta = {"stage": stage.name, "kind": stage.kind, "config": resolved(run)}
    pending = None  # (step, device metrics, tokens, step wall time)
    last: dict = {}
    t_prev = time.time()

    def drain(p):
        nonlocal last
        step, dev_metrics, tokens, dt = p
        host = algorithm.finalize(to_host(dev_metrics))
        host.update(step_time_s=dt, tokens_per_s=tokens / max(dt, 1e-9), tokens=tokens)
        if run.train.nan_check:
            check_finite(step, host)
        if step % run.logging.log_every == 0 or step == total:
            logger.log(step, host)
        last = host

    from ptrain.rollout.protocol import EngineUnavailable

    saved = start_step

    def stop(at: int, error: EngineUnavailable):
        """Save a resumable checkpoint at step `at` (unless it exists) and end the stage."""
        if pending is not None:
            drain(pending)
        if at > saved:
            checkpointer.save(at, state, batches.get_state(), dict(meta, step=at, metrics=last))
        checkpointer.wait()
        raise StageStopped.at(stage.name, at, error) from error

    for step in range(start_step + 1, total + 1):
        try:
            batch = next(batches)
        except EngineUnavailable as e:  # the batches are back where they were before this step
            stop(step - 1, e)
        tokens = algorithm.tokens_in(batch)
        state, metrics = step_fn(state, jax.device_put(batch, sharding))
        try:
            batches.after_step(step, state, metrics)
        except EngineUnavailable as e:  # the step trained; its weights just did not reach the engine
            if pending is not None:
                drain(pending)
            pending = (step, metrics, tokens, time.time() - t_prev)
            stop(step, e)
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
            try:
                eval_metrics = evaluate(state, step)
            except EngineUnavailable as e:  # the step trained and is saved; its evaluation is redone
                stop(step, e)
            logger.log(step, eval_metrics, prefix="eval")
            last.update({f"eval/{k}": v for k, v in eval_metrics.items()})
            t_prev = time.time()  # evaluation time is not training time
        if checkpointer.should_save(step, total):
            if pending is not None:
                drain(pending)  # the step's metrics reach the JSONL before its checkpoint exists
                pending = None
            checkpointer.save(step, state, batches.get_state(), dict(meta, step=step, metrics=last))
            saved = step
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
    stage: Stage,
    algorithm: Algorithm,
    batches: Batches,
    *,
    report,
    evaluators: list[Callable[[TrainState], dict]] = (),
) -> dict:
    """The part every stage driver ends with: resume from the newest readable checkpoint
    (state and batches), log the data report and the step-0 evaluation, run the loop,
    export the final weights, write DONE.json.

    `report` is the bad-row report of the stage's training data. Returns the stage summary
    (final train and eval metrics, export path, wall time).
    """
    from ptrain.checkpoint import mark_done

    run = stage.run
    checkpointer = StageCheckpointer(os.path.join(stage.dir, "checkpoints"), run.checkpoint)
    start_step, state, data_state = restore_or_start(checkpointer, stage.placed, run.checkpoint.resume)
    if data_state is not None:
        batches.set_state(data_state)

    def evaluate(state: TrainState, step: int) -> dict:
        out: dict = {}
        for ev in evaluators:
            out.update(ev(state))
        return out

    logger = MetricsLogger(
        run.logging, stage.dir, total_steps=run.train.steps, start_step=start_step, name=f"{stage.kind} {stage.name}"
    )
    from ptrain.rollout.protocol import EngineUnavailable

    try:
        try:
            # First the rollout engine to these weights (an RL stage), so that even the
            # step-0 evaluation samples from them.
            batches.begin(start_step, state)
            if start_step == 0:
                logger.log(0, report.as_metrics(prefix=""), prefix="data")
                if evaluators:
                    logger.log(0, evaluate(state, 0), prefix="eval")
        except EngineUnavailable as e:  # nothing has happened yet: the last checkpoint stands
            raise StageStopped.at(stage.name, start_step, e) from e
        state, last = train_loop(
            stage,
            algorithm,
            batches,
            state,
            start_step=start_step,
            checkpointer=checkpointer,
            logger=logger,
            evaluate=evaluate if evaluators else None,
        )
    finally:
        checkpointer.close()
        logger.close()
        for ev in evaluators:  # evaluators that own an engine free it (sweeps run jobs in one process)
            if hasattr(ev, "close"):
                ev.close()
    export = export_stage(stage.placed, state, stage.dir, stage.tokenizer)
    summary = {k: v for k, v in last.items() if isinstance(v, float)}
    summary.update(
        stage=stage.name,
        steps=run.train.steps,
        export=export,
        bad_rows=report.bad,
        wall_time_s=round(time.time() - stage.t_start, 1),
    )
    mark_done(stage.dir, summary)
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
