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

import logging
import os

from omegaconf import OmegaConf

from ptrain.checkpoint import is_done, read_done
from ptrain.config import ConfigError, RunConfig, stage_config
from ptrain.stages import STAGES, stage_driver

log = logging.getLogger(__name__)


def stage_dir(run: RunConfig, name: str) -> str:
    return os.path.join(run.run_dir, "stages", name)


def initial_weights(run: RunConfig, index: int) -> str | None:
    """The HF folder a stage starts from; None means the embedded model built from config.
    "previous" looks through stages that export nothing (eval) to the weights they read."""
    stage = run.stages[index]
    if stage.init == "base" or (stage.init == "previous" and index == 0):
        return run.model.hf_path
    if stage.init == "previous":
        prev = run.stages[index - 1]
        if not STAGES[prev.kind].exports:
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
            check_mesh_fits(stage_config(run, stage), jax.device_count())
        except ConfigError as e:
            raise ConfigError(f"stage '{stage.name}': {e}") from None


def run_pipeline(run: RunConfig) -> dict:
    """Run every stage; return the last stage's summary (final metrics), for sweeps."""
    os.makedirs(run.run_dir, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(run), os.path.join(run.run_dir, "config.yaml"))
    from ptrain.parallel import maybe_initialize_distributed

    maybe_initialize_distributed()
    _check_every_stage_fits(run)
    summary: dict = {}
    for i, stage in enumerate(run.stages):
        sdir = stage_dir(run, stage.name)
        if is_done(sdir):
            summary = read_done(sdir)
            print(f"ptrain: stage '{stage.name}' already finished ({sdir}); skipping", flush=True)
            continue
        cfg = stage_config(run, stage)
        init = initial_weights(run, i)
        if init is not None and not os.path.isfile(os.path.join(init, "config.json")):
            raise FileNotFoundError(
                f"stage '{stage.name}' starts from '{init}', which holds no config.json; "
                f"run the previous stage first, or set stages[{i}].init to a Hugging Face folder"
            )
        os.makedirs(sdir, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(sdir, "config.yaml"))
        print(
            f"ptrain: stage {i + 1}/{len(run.stages)} '{stage.name}' ({stage.kind}) from "
            f"{init or 'the embedded model'} -> {sdir}",
            flush=True,
        )
        summary = stage_driver(stage.kind)(cfg, sdir, init)
    return summary
