"""The Python API: compose a run, run it or one of its stages, and read the results.

    import ptrain
    cfg = ptrain.compose("sft_dpo_arithmetic", ["train.steps=20"])   # typed, validated RunConfig
    result = ptrain.run(cfg, run_dir="runs/demo")                     # every stage, as the CLI does
    result.stages["dpo"].metrics["eval/reward_accuracy"]
    sft = ptrain.sft("sft_arithmetic", train={"steps": 4})            # one stage of that kind

`python -m ptrain` is a thin caller of the same functions. Mistakes in the config raise
`ptrain.ConfigError`, whose message names the key and what to pass; the other errors of a
run are the ones the CLI prints (`StageStopped`, `TrainingDiverged`, `CheckpointError`,
`FileNotFoundError` for a missing input). A run resumes and skips as the CLI does:
launching the same config on the same `run_dir` again skips finished stages and resumes
the unfinished one from its newest checkpoint.

For writing your own loop from primitives (forward, forward-backward, optimizer step,
sample) see `ptrain.TrainingClient` (ptrain/client.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ptrain.config import ConfigError, RunConfig, StageConfig, register_configs, to_run_config
from ptrain.config.recipes import check_recipe
from ptrain.config.run import check_list_overrides

if TYPE_CHECKING:  # the pipeline loads JAX; composing a config does not
    from ptrain.pipeline import RunResult, StageResult

__all__ = ["ConfigError", "compose", "dpo", "evaluate", "grpo", "run", "run_stage", "sft"]

Overrides = Sequence[str]


def compose(recipe: str | None = None, overrides: Overrides = ()) -> RunConfig:
    """The typed, validated RunConfig of `recipe` (a name under recipes/; None: the defaults)
    with Hydra overrides (`"train.steps=20"`, `"env=[countdown,math]"`), composed exactly as
    `python -m ptrain recipe=NAME ...` composes it. ConfigError names a bad key or value."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = _as_overrides(overrides)
    if recipe is not None:
        check_recipe(recipe)
    if any(o.lstrip("+~").split("=", 1)[0] == "recipe" for o in overrides):
        raise ConfigError("config key 'recipe': pass the recipe as compose's first argument, not as an override")
    check_list_overrides(overrides)
    register_configs()
    args = ([f"recipe={recipe}"] if recipe is not None else []) + overrides
    try:
        with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=args)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_one_line(e)) from None
    return to_run_config(cfg, overrides)


def run(
    recipe_or_config: str | RunConfig | None = None, overrides: Overrides = (), *, run_dir: str | None = None
) -> RunResult:
    """Run every stage of a recipe (by name) or of a RunConfig, in this process, as the CLI
    does: finished stages are skipped, an unfinished one resumes. `run_dir` replaces the
    config's (default runs/<name>)."""
    cfg = as_config(recipe_or_config, overrides, run_dir)
    if cfg.continuous.enabled:
        raise ConfigError(
            "config key 'continuous.enabled': this recipe is a continuous loop, which never ends on its own; run it "
            "with ptrain.continuous(recipe, inbox=DIR, ...) (or pass continuous.enabled=false to run its stages once)"
        )
    return _run_stages(cfg)


def sft(config: str | RunConfig | None = None, overrides: Overrides = (), *, stage: str | None = None,
        run_dir: str | None = None, **values: Any) -> StageResult:  # fmt: skip
    """Run one SFT stage (see `run_stage`)."""
    return run_stage("sft", config, overrides, stage=stage, run_dir=run_dir, **values)


def dpo(config: str | RunConfig | None = None, overrides: Overrides = (), *, stage: str | None = None,
        run_dir: str | None = None, **values: Any) -> StageResult:  # fmt: skip
    """Run one DPO (preference) stage (see `run_stage`)."""
    return run_stage("dpo", config, overrides, stage=stage, run_dir=run_dir, **values)


def grpo(config: str | RunConfig | None = None, overrides: Overrides = (), *, stage: str | None = None,
         run_dir: str | None = None, **values: Any) -> StageResult:  # fmt: skip
    """Run one GRPO stage (see `run_stage`)."""
    return run_stage("grpo", config, overrides, stage=stage, run_dir=run_dir, **values)


def evaluate(config: str | RunConfig | None = None, overrides: Overrides = (), *, stage: str | None = None,
             run_dir: str | None = None, **values: Any) -> StageResult:  # fmt: skip
    """Run one eval stage (see `run_stage`)."""
    return run_stage("eval", config, overrides, stage=stage, run_dir=run_dir, **values)


def run_stage(
    kind: str,
    config: str | RunConfig | None = None,
    overrides: Overrides = (),
    *,
    stage: str | None = None,
    run_dir: str | None = None,
    **values: Any,
) -> StageResult:
    """Run one stage of `kind` from a recipe name, a RunConfig or the defaults (None).

    Which stage: the one named `stage`; else the config's only stage of that kind; a config
    with none of that kind runs a single stage `{name: kind, kind: kind}` from its top-level
    nodes (so `ptrain.sft(None, train={"steps": 4})` is SFT on the embedded default). A
    stage that starts from the previous one's export needs that stage finished first (run
    it, or the whole recipe with `ptrain.run`).

    `values` are overrides as nested mappings of the top-level nodes,
    `train={"steps": 4}, optim={"lr": 1e-3}`, applied after `overrides`.
    """
    cfg = as_config(config, list(_as_overrides(overrides)) + dotted_overrides(values), run_dir)
    from ptrain.config.stages import STAGES

    if kind not in STAGES:
        raise ConfigError(f"stage kind '{kind}': pass one of {', '.join(STAGES)}")
    chosen = _pick_stage(cfg, kind, stage)
    if chosen is None:
        cfg = _revalidated(dataclasses.replace(cfg, stages=[StageConfig(name=kind, kind=kind)]))
        chosen = kind
    return _run_stages(cfg, only=chosen).stages[chosen]


# ------------------------------------------------------------------------------- helpers


def _run_stages(cfg: RunConfig, only: str | None = None) -> RunResult:
    from ptrain.pipeline import run_stages
    from ptrain.runtime import tune_xla_cpu

    # Only takes effect if no JAX backend has started in this process yet (XLA reads its
    # flags once); harmless otherwise.
    tune_xla_cpu(compute_dtype=cfg.model.dtype, moe=cfg.model.is_moe)
    return run_stages(cfg, only=only)


def as_config(config: str | RunConfig | None, overrides: Overrides, run_dir: str | None) -> RunConfig:
    """The RunConfig of a recipe name, a RunConfig or the defaults (None), with overrides and
    a run_dir applied (what every entry point of the API starts from)."""
    overrides = _as_overrides(overrides)
    if isinstance(config, RunConfig):
        cfg = _with_overrides(config, overrides) if overrides else config
    elif config is None or isinstance(config, str):
        cfg = compose(config, overrides)
    else:
        raise ConfigError(
            f"a run is a recipe name (str), a RunConfig (ptrain.compose) or None, got {type(config).__name__}"
        )
    if run_dir is not None:
        cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    return cfg


def _with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A RunConfig with dotted `key=value` overrides applied and validated again."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_list_overrides(overrides)
    from ptrain.config.run import GROUPS

    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~")) or o.split("=", 1)[0] in GROUPS
           or "/" in o.split("=", 1)[0]]  # fmt: skip
    if bad:
        raise ConfigError(
            f"overrides {bad} cannot apply to a composed RunConfig: pass key=value (config groups such as "
            "model=tiny_moe apply only when composing: ptrain.compose(recipe, overrides))"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    return to_run_config(merged)


def _revalidated(cfg: RunConfig) -> RunConfig:
    from omegaconf import OmegaConf

    return to_run_config(OmegaConf.structured(cfg))


def _pick_stage(cfg: RunConfig, kind: str, name: str | None) -> str | None:
    if name is not None:
        match = [s for s in cfg.stages if s.name == name]
        if not match:
            raise ConfigError(
                f"config key 'stages': no stage named '{name}'; the run has {[s.name for s in cfg.stages]}"
            )
        if match[0].kind != kind:
            raise ConfigError(f"config key 'stages': stage '{name}' is a {match[0].kind} stage, not {kind}")
        return name
    of_kind = [s.name for s in cfg.stages if s.kind == kind]
    if len(of_kind) > 1:
        raise ConfigError(f"config key 'stages': the run has several {kind} stages {of_kind}; pass stage=NAME")
    return of_kind[0] if of_kind else None


def _as_overrides(overrides: Overrides) -> list[str]:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the single string {overrides!r}")
    out = list(overrides)
    for o in out:
        if not isinstance(o, str):
            raise ConfigError(f"overrides must be 'key=value' strings, got {o!r} ({type(o).__name__})")
    return out


def dotted_overrides(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """{"train": {"steps": 4}} -> ["train.steps=4"] (values in Hydra's override grammar)."""
    import json

    out = []
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            out.extend(dotted_overrides(value, f"{prefix}{key}."))
        elif isinstance(value, str):
            out.append(f"{prefix}{key}={json.dumps(value)}")
        elif value is None:
            out.append(f"{prefix}{key}=null")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def _one_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's messages as one line that names the key."""
    from omegaconf.errors import OmegaConfBaseException

    cause = e
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        from ptrain.config.run import explain_omegaconf_error

        return explain_omegaconf_error(cause)
    text = str(e).split("Config search path")[0]  # Hydra appends its whole search path
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines).replace(": ", ": ", 1)
