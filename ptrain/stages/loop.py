"""The loop every training stage runs, and its seam.

A driver builds a `Stage` (ptrain.stages.setup), an `Algorithm` (its pure objective and
denominator, how its summed metrics read on the host, how many tokens a batch holds) and
its `Batches` (next batch, get/set state for checkpoints, and a hook after every step, where
an RL stage pushes the new weights to its rollout engine), and hands them to
`train_evaluate_export`: resume from the newest checkpoint, build and jit the step once,
run the loop with evaluations and checkpoints, export, write DONE.json.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from ptrain.checkpoint import StageCheckpointer, abstract_like
from ptrain.metrics import MetricsLogger, to_host
from ptrain.parallel import batch_sharding
from ptrain.parallel.multihost import barrier, check_same_everywhere, host_array, is_primary, put_global_batch
from ptrain.stages.setup import Placed, Stage, jit_step, resolved
from ptrain.train.state import TrainState
from ptrain.train.step import Denominator, Objective, make_train_step


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


def restore_or_start(ckpt: StageCheckpointer, placed: Placed, resume: bool):
    """(start step, state, data-iterator state or None) from the newest readable checkpoint."""
    if not resume:
        return 0, placed.state, None
    # A checkpoint holds no frozen LoRA base (TrainState.checkpointed): it is the starting model.
    abstract = abstract_like(placed.state.checkpointed(), placed.state_shardings.checkpointed())
    got = ckpt.restore_latest(abstract)
    if got is None:
        return 0, placed.state, None
    step, state, data_state, _ = got
    state = state.replace(base_params=placed.state.base_params)
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
        # A metric array sharded over several processes' devices (MoE expert load, say) is
        # gathered; every process drains the same steps, so the collectives line up.
        host = algorithm.finalize(to_host(jax.tree.map(host_array, dev_metrics)))
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
            checkpointer.save(at, state.checkpointed(), batches.get_state(), dict(meta, step=at, metrics=last))
        checkpointer.wait()
        raise StageStopped.at(stage.name, at, error) from error

    for step in range(start_step + 1, total + 1):
        try:
            batch = next(batches)
        except EngineUnavailable as e:  # the batches are back where they were before this step
            stop(step - 1, e)
        tokens = algorithm.tokens_in(batch)
        # Every process holds the same global batch (same data, seed and iterator state) and
        # copies only the rows of its own devices.
        state, metrics = step_fn(state, put_global_batch(batch, sharding))
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
            checkpointer.save(step, state.checkpointed(), batches.get_state(), dict(meta, step=step, metrics=last))
            saved = step
    if pending is not None:
        drain(pending)
    checkpointer.wait()
    return state, last


def export_stage(placed: Placed, state: TrainState, stage_dir: str, tokenizer) -> str:
    """Write the stage's final weights as a Hugging Face folder (atomically). Under LoRA that
    folder holds the adapters merged into the base, and `adapter/` beside it the adapters
    alone as a PEFT folder (which the next stage, transformers + PEFT or a server loads).

    With several processes every one calls it: the weights are gathered to every host (a
    collective), process 0 writes, and all return once the folders are there."""
    from ptrain.models import save_hf

    merged, params, model_state = state.merged_params(), state.params, state.model_state
    if jax.process_count() > 1:  # shards on other hosts cannot be read from here
        merged, params, model_state = jax.tree.map(host_array, (merged, params, model_state))
    model = placed.model_def.bind(merged, model_state)
    out = os.path.join(stage_dir, "export")
    if is_primary():
        _write_atomically(out, lambda tmp: save_hf(model, tmp, tokenizer=tokenizer))
        if state.lora is not None and "experts" not in state.lora.targets:
            from ptrain.models.peft_io import save_peft

            _write_atomically(
                os.path.join(stage_dir, "adapter"), lambda tmp: save_peft(params, state.lora, model.cfg, tmp)
            )
    barrier("ptrain:export")
    return out


def _write_atomically(out: str, write: Callable[[str], None]) -> None:
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


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
    if jax.process_count() > 1:  # every process builds the global batch from its own copy of the pipeline
        check_same_everywhere(
            batches.get_state(), f"stage '{stage.name}': the training data (iterator state and examples)"
        )

    def evaluate(state: TrainState, step: int) -> dict:
        out: dict = {}
        for ev in evaluators:
            out.update(ev(state))
        return out

    # Process 0 keeps the metrics (JSONL, TensorBoard, console); the others compute the same
    # values in lockstep and log nothing.
    sinks = run.logging
    if not is_primary():
        sinks = dataclasses.replace(sinks, console=False, jsonl=False, tensorboard=False)
    logger = MetricsLogger(
        sinks, stage.dir, total_steps=run.train.steps, start_step=start_step, name=f"{stage.kind} {stage.name}"
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
    if is_primary():
        mark_done(stage.dir, summary)
    barrier("ptrain:done")  # the others read DONE.json next (pipeline.stage_result)
    return summary
