"""Run a recipe's stages in order; hand each stage's export to the next; skip finished ones.

<run_dir>/
  config.yaml             the resolved RunConfig of the launch
  data/                   generated datasets (embedded default), shared by the stages
  base_model/             the embedded tiny model in Hugging Face layout (when no hf_path)
  stages/<name>/          one folder per stage: checkpoints/, export/, metrics.jsonl, DONE.json

Re-launching the same command (same run_dir) skips stages with DONE.json and resumes the
unfinished one from its newest readable checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from ptrain.checkpoint import is_done, read_done
from ptrain.config import ConfigError, RunConfig, StageConfig, stage_config
from ptrain.config.stages import STAGES
from ptrain.stages import stage_driver

log = logging.getLogger(__name__)


def stage_dir(run: RunConfig, name: str) -> str:
    return os.path.join(run.run_dir, "stages", name)


def initial_weights(run: RunConfig, index: int) -> str | None:
    """The HF folder a stage starts from; None means the embedded model built from config.
    "previous" looks through stages that export no policy (eval: nothing; rm: a reward
    model) to the weights they read."""
    stage = run.stages[index]
    if stage.init == "base" or (stage.init == "previous" and index == 0):
        return run.model.hf_path
    if stage.init == "previous":
        prev = run.stages[index - 1]
        if not (STAGES[prev.kind].exports and STAGES[prev.kind].exports_policy):
            return initial_weights(run, index - 1)
        return os.path.join(stage_dir(run, prev.name), "export")
    return stage.init


def _check_every_stage_fits(run: RunConfig) -> None:
    """Each stage's batch against the mesh, on the devices there are, before the first stage
    trains: a later stage's mistake must not surface only after the earlier ones ran."""
    import jax

    from ptrain.config.run import check_mesh_fits

    for stage in run.stages:
        try:
            cfg = stage_config(run, stage)
            check_mesh_fits(cfg, jax.device_count())
        except ConfigError as e:
            raise ConfigError(f"stage '{stage.name}': {e}") from None


@dataclass
class StageResult:
    """One stage of a run, after it ran or was found finished."""

    name: str
    kind: str
    done: bool
    """DONE.json is there: the stage finished (now, or in an earlier launch)."""
    export: str | None
    """The stage's Hugging Face folder (export/), or None (eval stages write none)."""
    metrics: dict[str, float]
    """The stage's final metrics: the last value of every numeric key of metrics.jsonl
    (`train/loss`, `eval/reward`, ...); DONE.json's values when the JSONL sink was off."""
    metrics_path: str
    """<run_dir>/stages/<name>/metrics.jsonl."""
    summary: dict = field(default_factory=dict)
    """DONE.json as the driver wrote it (export path, wall time, bad rows, ...)."""


@dataclass
class RunResult:
    """A run's folder and its stages in recipe order."""

    run_dir: str
    stages: dict[str, StageResult]

    @property
    def last(self) -> StageResult:
        """The last stage that ran or was found finished."""
        return list(self.stages.values())[-1]


def final_metrics(metrics_path: str) -> dict[str, float]:
    """The last value of every numeric key in a metrics.jsonl (a torn last line is skipped)."""
    out: dict[str, float] = {}
    if not os.path.isfile(metrics_path):
        return out
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = float(v)
    return out


def stage_result(run: RunConfig, stage: StageConfig) -> StageResult:
    """What a stage's folder holds now."""
    sdir = stage_dir(run, stage.name)
    done = is_done(sdir, STAGES[stage.kind].exports)
    summary = read_done(sdir) if done else {}
    path = os.path.join(sdir, "metrics.jsonl")
    metrics = final_metrics(path) or {
        k: float(v) for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    export = os.path.join(sdir, "export")
    has_export = STAGES[stage.kind].exports and os.path.isfile(os.path.join(export, "config.json"))
    return StageResult(stage.name, stage.kind, done, export if has_export else None, metrics, path, summary)


def run_stages(run: RunConfig, only: str | None = None) -> RunResult:
    """Run every stage (or only the one named `only`) in order, skipping finished ones."""
    from ptrain.parallel.multihost import initialize, is_primary

    initialize(run.distributed)  # before anything touches a device (one process: nothing)
    _check_every_stage_fits(run)
    os.makedirs(run.run_dir, exist_ok=True)
    if is_primary():  # process 0 writes the run's files; the others read them after a barrier
        OmegaConf.save(OmegaConf.structured(run), os.path.join(run.run_dir, "config.yaml"))
    results: dict[str, StageResult] = {}
    for i, stage in enumerate(run.stages):
        if only is not None and stage.name != only:
            continue
        sdir = stage_dir(run, stage.name)
        if is_done(sdir, STAGES[stage.kind].exports):
            result = stage_result(run, stage)  # reads DONE.json: a damaged marker is an error here
            print(f"ptrain: stage '{stage.name}' already finished ({sdir}); skipping", flush=True)
            results[stage.name] = result
            continue
        cfg = stage_config(run, stage)
        init = initial_weights(run, i)
        if init is not None and not os.path.isfile(os.path.join(init, "config.json")):
            raise FileNotFoundError(
                f"stage '{stage.name}' starts from '{init}', which holds no config.json; "
                f"run the previous stage first, or set stages[{i}].init to a Hugging Face folder"
            )
        os.makedirs(sdir, exist_ok=True)
        if is_primary():
            OmegaConf.save(OmegaConf.structured(cfg), os.path.join(sdir, "config.yaml"))
        print(
            f"ptrain: stage {i + 1}/{len(run.stages)} '{stage.name}' ({stage.kind}) from "
            f"{init or 'the embedded model'} -> {sdir}",
            flush=True,
        )
        stage_driver(stage.kind)(cfg, sdir, init)
        results[stage.name] = stage_result(run, stage)
    if only is not None and not results:
        raise ConfigError(
            f"config key 'stages': the run has no stage named '{only}'; it has {[s.name for s in run.stages]}"
        )
    return RunResult(run.run_dir, results)


def run_pipeline(run: RunConfig) -> dict:
    """Run every stage; return the last stage's summary (final metrics), for sweeps."""
    return run_stages(run).last.summary
