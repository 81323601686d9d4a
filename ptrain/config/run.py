"""The root RunConfig, its registration with Hydra, and validation before any compute."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ptrain.config import choices as C
from ptrain.config.algo import AlgoConfig, validate_rm
from ptrain.config.choices import one_of
from ptrain.config.continuous import ContinuousConfig
from ptrain.config.cost import CostConfig
from ptrain.config.data import DataConfig, validate_data_config
from ptrain.config.distributed import DistributedConfig
from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_configs
from ptrain.config.grpo import validate_eval, validate_grpo
from ptrain.config.mesh import MeshConfig
from ptrain.config.model import ModelConfig
from ptrain.config.optim import OptimConfig
from ptrain.config.outputs import CheckpointConfig, LoggingConfig
from ptrain.config.rollout import RolloutConfig
from ptrain.config.sandbox import SandboxConfig
from ptrain.config.seeds import DEFAULT_SEED, resolve_seeds
from ptrain.config.stages import STAGES, StageConfig
from ptrain.config.train import TrainConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to pass."""


@dataclass
class RunConfig:
    name: str = "default"
    """Run name; the default run directory is runs/<name> (recipes set it)."""
    run_dir: str = "runs/default"
    """Where stages write checkpoints, exports, metrics and the resolved config. Re-launching
    with the same run_dir skips finished stages and resumes the unfinished one."""
    seed: int = DEFAULT_SEED
    """The run's seed (>= 0): every component seed left null (model.seed, data.shuffle_seed,
    data.generated.seed, train.seed) is derived from it, each its own stream
    (ptrain/config/seeds.py). `-m seed=1,2,3` sweeps it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    envs: dict[str, EnvConfig] = field(default_factory=dict)
    """Environments of the stages that sample (grpo, eval), by name: `env=countdown` adds
    one (Hydra group env/), `env=[countdown,math]` several; `envs.countdown.weight=2` sets
    its share of the mix. A stage may pick some by name (stages[i].envs)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine of stages that sample (grpo, eval): local or an SGLang fleet."""
    cost: CostConfig = field(default_factory=CostConfig)
    """Prices behind the cost accounting of sampling stages and of continuous rounds (the
    defaults are public list prices: ptrain/config/cost.py)."""
    continuous: ContinuousConfig = field(default_factory=ContinuousConfig)
    """Continuous post-training (ptrain.config.continuous): with `continuous.enabled` the
    recipe's stages up to its GRPO stage make the first champion, and each round trains a
    challenger from the champion over every environment the inbox has brought."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Isolation and limits of model-written code that environments run (code tests, the
    tool_use python and bash tools, terminal tasks): `sandbox.backend=bwrap`,
    `sandbox.memory_mb=2048`, `sandbox.bwrap_path=/usr/bin/bwrap` (ptrain.config.sandbox)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """The JAX processes of the run (ptrain.config.distributed): all null is one process,
    unless PTRAIN_* variables (tools/launch_local.py) or a launcher (a Slurm srun step,
    mpirun) say otherwise; `distributed.num_processes=2 distributed.process_id=0
    distributed.coordinator_address=host:port` sets them by hand. docs/scaling.md."""
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    """Ordered stages of the recipe; each starts from the previous one's export."""
    objective: str | None = None
    """The number a hyperparameter search optimises: one of the last stage's final metrics
    (a key of its metrics.jsonl, e.g. eval/sampled/accuracy). With Hydra's optuna sweeper
    (`python -m ptrain -m hydra/sweeper=optuna hydra.sweeper.direction=maximize ...`) each
    job returns it as its trial's value; a recipe names the metric its paper reports. Other
    sweeps and single runs ignore it."""
    recipe: Any | None = None
    """Set by the `recipe` group (its files hold only overrides); unused at run time."""
    scale: str = "tiny"
    """Which size of the recipe to run: tiny (the recipe as written, the CPU-scale default),
    or a name in `scales` (smoke: every stage a few steps, which CI runs; published: the
    paper's settings). `python -m ptrain recipe=NAME scale=smoke`."""
    scales: dict[str, Any] = field(default_factory=dict)
    """The recipe's other sizes: {scale name: overrides of the config's nodes}, merged over
    the composed recipe when `scale` names one; command-line overrides still win. A resolved
    config holds only its own scale's entry, emptied once applied."""

    @property
    def stage(self) -> StageConfig:
        """The one stage a stage's own config runs (`stage_config` gives each stage a
        RunConfig whose `stages` lists that stage alone)."""
        if len(self.stages) != 1:
            raise ValueError(
                f"RunConfig.stage is the stage of a stage's own config (stage_config); this one lists "
                f"{len(self.stages)} stages: {[s.name for s in self.stages]}"
            )
        return self.stages[0]


GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "algo": AlgoConfig,
    "optim": OptimConfig,
    "mesh": MeshConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "rollout": RolloutConfig,
    "env": EnvConfig,
}


def register_configs() -> None:
    """Register the schemas: `base_config` for the root, `<group>/schema` for each group."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for group, node in GROUPS.items():
        cs.store(group=group, name="schema", node=node)


def to_run_config(cfg: DictConfig | dict, overrides: Sequence[str] = ()) -> RunConfig:
    """Turn a composed config into a typed RunConfig and validate it.

    The recipe's `scales[scale]` is merged in first (unless scale is tiny, the recipe as
    written), then the command line's key=value `overrides` again, so that they win over
    the scale as they win over the recipe. Unknown keys and wrong types raise ConfigError
    naming the key; impossible values too. Null component seeds are derived from the
    top-level `seed` here, once, so the returned config (and the config.yaml a run saves)
    holds concrete values.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
        before = merged
        merged = apply_scale(merged, overrides)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            # Every value the launch must give, at once (a published scale leaves several); a
            # key only the scale has is new to Hydra's command line, which wants it with "+".
            absent = object()
            plus = ["+" if OmegaConf.select(before, k, default=absent) is absent else "" for k in missing]
            raise ConfigError(
                f"config key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)}: no value "
                f"given (??? in the config); pass {' '.join(p + k + '=...' for p, k in zip(plus, missing))}"
            )
        run: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(explain_omegaconf_error(e)) from None
    _check(run.seed >= 0, "seed", f"must be >= 0, got {run.seed}")
    try:
        run.distributed.resolve()
    except ValueError as e:  # its messages name the key (or PTRAIN_* variable) and the fix
        raise ConfigError(str(e)) from None
    try:
        run.sandbox.validate()
    except ValueError as e:  # its messages open with sandbox.<field>=<value> and say the fix
        raise ConfigError(f"config key '{str(e).split('=')[0].split(' ')[0]}': {e}") from None
    resolve_seeds(run)
    validate(run)
    return run


BASE_SCALE = "tiny"
"""The scale a recipe file is written at; the others are its `scales` entries."""


def apply_scale(merged: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """The composed config with `scales[scale]` merged in and the key=value overrides
    applied again on top (group choices such as model=hf were applied by the composition)."""
    scale, scales = merged.scale, merged.scales
    if scale == BASE_SCALE and BASE_SCALE not in scales:
        # The other scales stay unread: one may hold values only its launch can give ("???").
        merged.scales = {}
        return merged
    if scale not in scales:
        have = ", ".join([BASE_SCALE, *[k for k in scales if k != BASE_SCALE]])
        raise ConfigError(
            f"config key 'scale': recipe '{merged.name}' has no scale '{scale}'; it has {have} "
            "(its `scales` table; tiny is the recipe as written)"
        )
    # A scale may add map entries (an environment of its own); the typed nodes still refuse
    # unknown keys, since their schema does, not the struct flag.
    with open_dict(merged):
        kinds = {name: env.kind for name, env in merged.envs.items()}
        merged = OmegaConf.merge(merged, scales[scale])
        # An environment the scale gives another kind takes the scale's options alone: the
        # old kind's options mean nothing to the new one.
        for name, env in scales[scale].get("envs", {}).items():
            if name in kinds and env.get("kind", kinds[name]) != kinds[name]:
                merged.envs[name].options = env.get("options", {})
        # A merge keeps a set value under "???"; the scale means it: the launch must give it.
        for key in OmegaConf.missing_keys(scales[scale]):
            OmegaConf.update(merged, key.removeprefix(f"scales.{scale}."), "???", merge=False)
    OmegaConf.set_struct(merged, True)
    for key, value in plain_overrides(overrides):
        OmegaConf.update(merged, key, value, merge=False)
    # Applied: the entry becomes empty, so validating this config again (the API does, after
    # overrides) changes nothing that the scale or the command line set.
    merged.scales = {scale: {}}
    return merged


def plain_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """(dotted key, value) of each command-line override that sets a value, leaving out
    group choices (model=hf, env=[...]), deletions and Hydra's own keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        key = o.key_or_group
        if o.is_delete() or key.startswith("hydra") or key in ("recipe", "env") or key in GROUPS:
            continue
        out.append((key, o.value()))
    return out


def stage_config(run: RunConfig, stage: StageConfig) -> RunConfig:
    """The RunConfig one stage sees: the top-level nodes with the stage's overrides merged in."""
    base = OmegaConf.structured(run)
    overrides = {k: getattr(stage, k) for k in ("train", "optim", "data", "algo") if getattr(stage, k)}
    if stage.lora:
        overrides["model"] = {"lora": stage.lora}
    try:
        merged = OmegaConf.merge(base, overrides)
        out: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"in stage '{stage.name}': " + explain_omegaconf_error(e, prefix=f"stages.{stage.name}.")
        ) from None
    out.stages = [stage]
    resolve_seeds(out)  # a stage that sets a component seed back to null gets the derived one
    if stage.kind == "grpo":
        _grpo_stage_batch(out, f"stage '{stage.name}': ")
    _validate_values(out, where=f"stage '{stage.name}': ")
    _check(
        not (stage.kind == "rm" and out.algo.dpo.policy_pairs),
        "algo.dpo.policy_pairs",
        "a reward-model stage takes pairs from its data or from the environments (algo.dpo.env_pairs, graded by "
        "their verifiers); policy pairs are graded against the data's answers by a DPO stage only, so set it to 0",
        f"stage '{stage.name}': ",
    )
    try:
        run.distributed.resolve()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check(
        not (stage.kind == "rm" and out.model.lora.enabled),
        "model.lora.rank",
        "a reward model trains its new score head, which an adapter does not cover; train the rm stage without "
        "LoRA (model.lora.rank=0)",
        f"stage '{stage.name}': ",
    )
    need = STAGES[stage.kind].data_format if stage.kind in STAGES else None
    if need is not None and out.data.format != need:
        raise ConfigError(
            f"stage '{stage.name}': config key 'data.format': a {stage.kind} stage reads data.format={need}, "
            f"got format '{out.data.format}'; set data: {{format: {need}}} in the stage"
        )
    return out


def _grpo_stage_batch(run: RunConfig, where: str) -> None:
    """A grpo stage's optimizer step takes prompts_per_step x group_size / mini_batches rows:
    that is its train.global_batch_size, whatever the node says, and a rollout batch lasts
    epochs x mini_batches optimizer steps, which train.steps and checkpoint.every_steps
    must count in whole rollout batches (a checkpoint then never splits one)."""
    g = run.algo.grpo
    run.train.global_batch_size = g.prompts_per_step * g.group_size // max(g.mini_batches, 1)
    per = g.epochs * g.mini_batches
    _check(
        run.train.steps % per == 0,
        "train.steps",
        f"counts optimizer steps; a rollout batch takes epochs x mini_batches = {per}: pass a multiple of {per}",
        where,
    )
    _check(
        run.checkpoint.every_steps % per == 0,
        "checkpoint.every_steps",
        f"must be a multiple of epochs x mini_batches = {per} (whole rollout batches)",
        where,
    )
    _check(
        run.train.global_batch_size % run.train.grad_accum == 0,
        "train.grad_accum",
        f"must divide the {run.train.global_batch_size} rows of an optimizer step "
        "(prompts_per_step x group_size / mini_batches)",
        where,
    )
    _check(
        g.max_new_tokens < run.train.seq_len,
        "algo.grpo.max_new_tokens",
        f"{g.max_new_tokens} leaves no room for the prompt in train.seq_len={run.train.seq_len}; raise seq_len",
        where,
    )
    _check(
        run.rollout.kind != "local" or g.group_size <= run.rollout.max_running_requests,
        "algo.grpo.group_size",
        f"{g.group_size} samples of a prompt run at once, but the local engine decodes at most "
        f"rollout.max_running_requests={run.rollout.max_running_requests}; raise that or lower group_size",
        where,
    )
    _check(
        run.rollout.kind != "local" or not run.train.eval_generate
        or run.algo.eval.samples <= run.rollout.max_running_requests,
        "algo.eval.samples",
        f"the stage's evaluations sample {run.algo.eval.samples} at once per task, but the local engine decodes at "
        f"most rollout.max_running_requests={run.rollout.max_running_requests}; raise that or lower samples",
        where,
    )  # fmt: skip
    ctx = run.rollout.context_length
    _check(
        ctx is None or g.max_new_tokens < ctx,
        "rollout.context_length",
        f"{ctx} tokens (prompt + output) leave no room for a prompt before algo.grpo.max_new_tokens="
        f"{g.max_new_tokens}; raise it, or pass null (train.seq_len + 1)",
        where,
    )


def shadowed_overrides(run: RunConfig, overrides: list[str]) -> list[str]:
    """Notes for command-line overrides (`train.steps=2`) that a stage's own setting of the
    same key replaces for that stage, with the override that would reach it."""
    notes = []
    for text in overrides:
        key = text.split("=", 1)[0].lstrip("+~")
        group, _, rest = key.partition(".")
        if group not in ("train", "optim", "data", "algo") or not rest:
            continue
        for i, stage in enumerate(run.stages):
            node: Any = getattr(stage, group)
            for part in rest.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                notes.append(
                    f"stage '{stage.name}' sets {key}={node} itself, which takes precedence over "
                    f"'{text}'; pass stages.{i}.{key}=... to change it there"
                )
    return notes


def check_list_overrides(args: list[str]) -> None:
    """ConfigError for a command-line override that gives a list-typed field one value, or
    several without brackets: `rollout.urls=http://10.0.0.1:30000` or `rollout.urls=http://a:1,
    http://b:2`. Hydra refuses both before any of our code runs ("str is not a ListConfig" /
    "Ambiguous value"), without showing the form to pass; this names the key and shows it.
    Runs on the raw command line, before Hydra composes; anything it cannot judge (not an
    override, a key outside the typed config, a syntax error) is left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in args:
        if text.startswith("-") or "=" not in text:
            continue  # a Hydra flag (-m, --cfg job, ...) or its argument
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue  # Hydra reports its own grammar errors
        if override.is_delete() or not _is_list_field(override.key_or_group):
            continue
        shown, raw = text.split("=", 1)
        value = override.value()
        if override.value_type == ValueType.ELEMENT:
            if value is None or isinstance(value, list | tuple) or "${" in str(value):
                continue  # null (OmegaConf names the type), a list, or an interpolation that may make one
            raise ConfigError(
                f"config key '{override.key_or_group}': must be a list, got the single value {raw!r}; pass "
                f'"{shown}=[{raw}]" (in quotes, so the shell leaves the brackets alone)'
            )
        if override.value_type in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP):
            items = list(value.list)
            if any(isinstance(v, list | tuple) for v in items):
                continue  # a sweep over lists: -m rollout.urls=[a],[b]
            listed = ",".join(str(v) for v in items)
            raise ConfigError(
                f"config key '{override.key_or_group}': must be a list, got {raw!r}, which Hydra reads as a sweep "
                f'over single values; pass "{shown}=[{listed}]" for one list (in quotes, so the shell leaves the '
                f'brackets alone), or with -m "{shown}=' + ",".join(f"[{v}]" for v in items) + '" to sweep over lists'
            )


def _is_list_field(key: str) -> bool:
    """Whether the dotted key names a list-typed field of RunConfig (through dataclass
    fields, dict values and list items)."""
    node: Any = RunConfig
    for part in key.split("."):
        node = _without_none(node)
        origin = typing.get_origin(node)
        if dataclasses.is_dataclass(node):
            hints = typing.get_type_hints(node)
            if part not in hints:
                return False
            node = hints[part]
        elif origin is dict:
            node = typing.get_args(node)[1]
        elif origin is list and part.isdigit():
            node = typing.get_args(node)[0]
        else:
            return False
    return typing.get_origin(_without_none(node)) is list


def _without_none(tp: Any) -> Any:
    """X for the annotation `X | None`; any other annotation as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def explain_omegaconf_error(e: OmegaConfBaseException, prefix: str = "") -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    node_type = getattr(e, "object_type", None)
    hint = ""
    if "not in" in msg and node_type is not None and dataclasses.is_dataclass(node_type):
        names = ", ".join(f.name for f in dataclasses.fields(node_type))
        hint = f" Valid keys here: {names}."
    elif "Value" in msg and ("could not be converted" in msg or "is not a" in msg):
        hint = " Pass a value of the declared type (see `python -m ptrain --cfg job` for the defaults)."
    return f"config key '{prefix}{key}': {msg}.{hint}"


def _check(cond: bool, key: str, msg: str, where: str = "") -> None:
    if not cond:
        raise ConfigError(f"{where}config key '{key}': {msg}")


def validate(run: RunConfig) -> None:
    """Reject impossible values before any compute; each message names the key and a fix."""
    names = [s.name for s in run.stages]
    _check(len(run.stages) > 0, "stages", "a recipe needs at least one stage, e.g. stages=[{name: sft, kind: sft}]")
    _check(len(set(names)) == len(names), "stages", f"stage names must be unique, got {names}")
    _check(
        run.objective is None or bool(run.objective.strip()),
        "objective",
        "must be a final metric of the last stage (e.g. objective=eval/sampled/accuracy) or null",
    )
    for i, s in enumerate(run.stages):
        _check(
            s.kind in C.STAGE_KINDS,
            f"stages[{i}].kind",
            f"unknown stage kind '{s.kind}'; pass one of {', '.join(C.STAGE_KINDS)}",
        )
        _check(
            bool(s.name) and "/" not in s.name and s.name not in (".", ".."),
            f"stages[{i}].name",
            f"'{s.name}' must be a non-empty folder name without '/' (and not '.' or '..')",
        )
        _check(
            s.reward_model is None or (s.kind == "grpo" and bool(str(s.reward_model).strip())),
            f"stages[{i}].reward_model",
            f"scores the episodes of a grpo stage, and stage '{s.name}' is of kind {s.kind}; leave it null here"
            if s.kind != "grpo"
            else "must be a reward-model folder (e.g. ${run_dir}/stages/rm/export) or null",
        )
        if s.init not in C.STAGE_INITS:
            _check(
                os.path.isfile(os.path.join(s.init, "config.json")),
                f"stages[{i}].init",
                f"'{s.init}' is neither 'previous', 'base' nor a Hugging Face folder with a config.json",
            )
    for key, env in run.envs.items():
        if env.name is None:
            env.name = key
        _check(
            env.name == key, f"envs.{key}.name", f"must be null or the key it sits under ('{key}'), got '{env.name}'"
        )
    try:
        validate_env_configs(list(run.envs.values()))
    except EnvConfigError as e:
        raise ConfigError(str(e)) from None
    for i, s in enumerate(run.stages):
        unknown = [n for n in s.envs if n not in run.envs]
        _check(
            not unknown, f"stages[{i}].envs", f"{unknown} are not environments of the run; it has {sorted(run.envs)}"
        )
        repeated = sorted({n for n in s.envs if list(s.envs).count(n) > 1})
        _check(
            not repeated,
            f"stages[{i}].envs",
            f"names {repeated} more than once; list each environment once, and give it a larger share of the "
            f"mix with envs.<name>.weight",
        )
        if STAGES[s.kind].samples:
            # An eval stage may run lm-evaluation-harness tasks alone.
            lm_eval_only = s.kind == "eval" and bool(stage_config(run, s).algo.eval.lm_eval.tasks)
            _check(
                bool(s.envs or run.envs) or lm_eval_only,
                "envs",
                f"stage '{s.name}' ({s.kind}) samples environments, but the run has none: pass env=countdown "
                "(or env=[countdown,math]; conf/env/ lists the kinds)"
                + (", or lm-eval tasks with algo.eval.lm_eval.tasks=[...]" if s.kind == "eval" else ""),
            )
    for s in run.stages:
        stage_config(run, s)  # validates every stage's merged values
    for key, msg in run.continuous.problems()[:1]:
        raise ConfigError(f"config key '{key}': {msg}")
    if run.continuous.enabled:
        grpo = [i for i, s in enumerate(run.stages) if s.kind == "grpo"]
        _check(
            bool(grpo) and grpo[0] == len(run.stages) - 1,
            "stages",
            "continuous post-training trains each round with the recipe's GRPO stage, which must be its last "
            f"stage (the stages before it make the first champion); got {[f'{s.name}:{s.kind}' for s in run.stages]}",
        )


def _validate_values(run: RunConfig, where: str = "") -> None:
    t, o, m, mesh = run.train, run.optim, run.model, run.mesh
    c = lambda cond, key, msg: _check(cond, key, msg, where)
    c(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
    c(t.grad_accum >= 1, "train.grad_accum", f"must be >= 1, got {t.grad_accum}")
    c(t.global_batch_size > 0, "train.global_batch_size", f"must be > 0, got {t.global_batch_size}")
    c(
        t.global_batch_size % t.grad_accum == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} is not divisible by train.grad_accum={t.grad_accum}",
    )
    c(t.seq_len > 1, "train.seq_len", f"must be > 1, got {t.seq_len}")
    c(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
    c(run.logging.log_every >= 1, "logging.log_every", f"must be >= 1 (1: every step), got {run.logging.log_every}")
    c(t.vocab_chunk >= 0, "train.vocab_chunk", f"must be >= 0 (0: full logits), got {t.vocab_chunk}")
    c(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    c(o.name in C.OPTIMIZERS, "optim.name", f"unknown optimizer '{o.name}'; pass {one_of(C.OPTIMIZERS)}")
    c(o.schedule in C.SCHEDULES, "optim.schedule", f"unknown schedule '{o.schedule}'; pass {one_of(C.SCHEDULES)}")
    c(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    c(0 <= o.warmup_ratio < 1, "optim.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio}")
    c(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    c(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    c(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables), got {o.grad_clip}")
    c(
        m.n_heads % m.n_kv_heads == 0 if m.n_kv_heads > 0 else False,
        "model.n_kv_heads",
        f"must be > 0 and divide model.n_heads={m.n_heads}, got {m.n_kv_heads}",
    )
    c(m.dtype in C.COMPUTE_DTYPES, "model.dtype", f"pass {one_of(C.COMPUTE_DTYPES)}, got '{m.dtype}'")
    c(m.param_dtype in C.PARAM_DTYPES, "model.param_dtype", f"pass {one_of(C.PARAM_DTYPES)}, got '{m.param_dtype}'")
    c(m.remat in C.REMAT_MODES, "model.remat", f"pass {one_of(C.REMAT_MODES)}, got '{m.remat}'")
    c(
        m.context_attention in C.CONTEXT_ATTENTION,
        "model.context_attention",
        f"pass {one_of(C.CONTEXT_ATTENTION)}, got '{m.context_attention}'",
    )
    for name, problem in m.lora.lora_problems(tie_embeddings=m.tie_embeddings, is_moe=m.n_experts > 0):
        c(False, f"model.lora.{name}", problem)
    c(m.router in C.ROUTERS, "model.router", f"pass {one_of(C.ROUTERS)}, got '{m.router}'")
    if m.hf_path is not None:
        c(
            os.path.isfile(os.path.join(m.hf_path, "config.json")),
            "model.hf_path",
            f"no config.json in '{m.hf_path}'; pass a local Hugging Face model folder (nothing is downloaded)",
        )
    for axis in ("fsdp", "context", "tensor", "expert"):
        c(getattr(mesh, axis) >= 1, f"mesh.{axis}", f"must be >= 1, got {getattr(mesh, axis)}")
    c(mesh.data == -1 or mesh.data >= 1, "mesh.data", f"must be -1 (fill) or >= 1, got {mesh.data}")
    for i, rule in enumerate(mesh.rules or ()):
        c(isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str), f"mesh.rules[{i}]",
          f"must be a pair [logical_axis, mesh_axis or [mesh_axes] or null], got {rule!r}")  # fmt: skip
        logical, target = rule
        axes = [] if target is None else list(target) if isinstance(target, (list, tuple)) else [target]
        bad = [a for a in axes if a not in C.MESH_AXES]
        c(not bad, f"mesh.rules[{i}]", f"names {bad}, which are not mesh axes; pass {one_of(C.MESH_AXES)} (or null)")
        c(logical != "batch" or tuple(axes) == C.BATCH_AXES, f"mesh.rules[{i}]",
          f"every batch is split over {list(C.BATCH_AXES)} (the data-parallel size data x fsdp x expert the batch "
          f"must divide by), got {axes}; drop the batch rule, and pick the split with the mesh.* sizes")  # fmt: skip
    c(run.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {run.checkpoint.keep}")
    c(run.checkpoint.every_steps >= 0, "checkpoint.every_steps", f"must be >= 0, got {run.checkpoint.every_steps}")
    a = run.algo
    c(
        a.sft.aggregation in C.SFT_AGGREGATIONS,
        "algo.sft.aggregation",
        f"pass {one_of(C.SFT_AGGREGATIONS)}, got '{a.sft.aggregation}'",
    )
    c(0 <= a.sft.label_smoothing < 1, "algo.sft.label_smoothing", f"must be in [0, 1), got {a.sft.label_smoothing}")
    c(
        a.sft.norm_constant is None or a.sft.norm_constant >= 1,
        "algo.sft.norm_constant",
        f"must be null (train.global_batch_size * train.seq_len) or a token count >= 1, got {a.sft.norm_constant}",
    )
    c(
        a.dpo.kind in C.PREFERENCE_KINDS,
        "algo.dpo.kind",
        f"unknown preference loss '{a.dpo.kind}'; pass {one_of(C.PREFERENCE_KINDS)}",
    )
    c(
        0 <= a.dpo.label_smoothing < 0.5,
        "algo.dpo.label_smoothing",
        f"must be in [0, 0.5) (a label-flip probability), got {a.dpo.label_smoothing}",
    )
    c(
        a.dpo.label_smoothing == 0 or a.dpo.kind in C.SMOOTHABLE_KINDS,
        "algo.dpo.label_smoothing",
        f"applies to kinds {one_of(C.SMOOTHABLE_KINDS)}, not '{a.dpo.kind}'; set it to 0",
    )
    c(a.dpo.dpop_lambda >= 0, "algo.dpo.dpop_lambda", f"must be >= 0, got {a.dpo.dpop_lambda}")
    c(a.dpo.beta > 0, "algo.dpo.beta", f"must be > 0, got {a.dpo.beta}")
    c(
        a.dpo.policy_pairs >= 0,
        "algo.dpo.policy_pairs",
        f"must be >= 0 (0: the data's own pairs), got {a.dpo.policy_pairs}",
    )
    c(a.dpo.env_pairs >= 0, "algo.dpo.env_pairs", f"must be >= 0 (0: pairs from data), got {a.dpo.env_pairs}")
    c(not (a.dpo.env_pairs and a.dpo.policy_pairs), "algo.dpo.env_pairs",
      "pairs come from the environments (env_pairs) or from the data's prompts (policy_pairs), not both; "
      "set one of them to 0")  # fmt: skip
    c(not a.dpo.env_pairs or bool(run.envs), "algo.dpo.env_pairs",
      "env_pairs samples the run's environments and it has none; add env=<kind>, or set it to 0")  # fmt: skip
    c(a.dpo.policy_samples >= 1, "algo.dpo.policy_samples", f"must be >= 1, got {a.dpo.policy_samples}")
    c(a.dpo.policy_temperature >= 0, "algo.dpo.policy_temperature", f"must be >= 0, got {a.dpo.policy_temperature}")
    c(
        a.dpo.policy_temperature > 0 or a.dpo.policy_samples == 1,
        "algo.dpo.policy_samples",
        f"greedy decoding (policy_temperature=0) gives one completion per prompt; set policy_samples=1, "
        f"got {a.dpo.policy_samples}",
    )
    c(a.dpo.policy_eval_pairs >= 0, "algo.dpo.policy_eval_pairs", f"must be >= 0, got {a.dpo.policy_eval_pairs}")
    c(
        a.dpo.policy_max_new_tokens >= 1,
        "algo.dpo.policy_max_new_tokens",
        f"must be >= 1, got {a.dpo.policy_max_new_tokens}",
    )
    validate_rm(a.rm, c)
    validate_grpo(a.grpo, c)
    validate_eval(a.eval, c)
    ro = run.rollout
    c(ro.kind in C.ROLLOUT_KINDS, "rollout.kind", f"pass {one_of(C.ROLLOUT_KINDS)}, got '{ro.kind}'")
    c(ro.max_running_requests >= 1, "rollout.max_running_requests", f"must be >= 1, got {ro.max_running_requests}")
    c(ro.context_length is None or ro.context_length >= 2, "rollout.context_length", "must be null or >= 2")
    c(ro.decode_steps >= 1, "rollout.decode_steps", f"must be >= 1, got {ro.decode_steps}")
    c(ro.weight_dtype in C.WEIGHT_DTYPES, "rollout.weight_dtype", f"pass {one_of(C.WEIGHT_DTYPES)}")
    c(ro.keep_weight_versions >= 1, "rollout.keep_weight_versions", f"must be >= 1, got {ro.keep_weight_versions}")
    for key in ("request_timeout_s", "connect_timeout_s", "unhealthy_timeout_s", "health_interval_s",
                "health_timeout_s", "probe_backoff_s", "weight_push_timeout_s"):  # fmt: skip
        c(getattr(ro, key) > 0, f"rollout.{key}", f"must be > 0, got {getattr(ro, key)}")
    for key in ("max_retries", "weight_push_retries", "retry_backoff_s"):
        c(getattr(ro, key) >= 0, f"rollout.{key}", f"must be >= 0, got {getattr(ro, key)}")
    for key in ("per_worker_concurrency", "export_writers"):
        c(getattr(ro, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(ro, key)}")
    c(ro.probe_backoff_max_s >= ro.probe_backoff_s, "rollout.probe_backoff_max_s",
      f"must be >= probe_backoff_s={ro.probe_backoff_s}, got {ro.probe_backoff_max_s}")  # fmt: skip
    c(ro.weight_push_mode in C.WEIGHT_PUSH_MODES, "rollout.weight_push_mode",
      f"pass {one_of(C.WEIGHT_PUSH_MODES)}, got '{ro.weight_push_mode}'")  # fmt: skip
    for i, url in enumerate(ro.urls):
        c(_is_http_url(url), f"rollout.urls[{i}]", f"must be http://host:port (or https://), got '{url}'")
    c(ro.router_url is None or _is_http_url(ro.router_url), "rollout.router_url",
      f"must be null or http://host:port (or https://), got '{ro.router_url}'")  # fmt: skip
    c(len(set(ro.urls)) == len(ro.urls), "rollout.urls", f"lists a worker twice: {list(ro.urls)}")
    c(ro.kind != "sglang" or ro.urls or ro.router_url, "rollout.urls",
      "rollout=sglang needs the fleet: pass rollout.router_url=http://host:port (an sglang-router) or "
      "rollout.urls=[http://host:port,...] (the workers); tools/launch_fleet.py starts one")  # fmt: skip
    for f in dataclasses.fields(run.cost):
        c(getattr(run.cost, f.name) >= 0, f"cost.{f.name}", f"a price must be >= 0, got {getattr(run.cost, f.name)}")
    try:
        validate_data_config(run.data)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{where}{e}") from None
    if run.data.source == "envs":
        unknown = [n for n in run.data.envs.envs if n not in run.envs]
        c(not unknown, "data.envs.envs", f"names {unknown}, which are not environments of the run "
          f"(envs: {sorted(run.envs)}); pass names from envs:, or [] for all of them")  # fmt: skip
        c(bool(run.envs), "data.source", "source=envs writes rows from the run's environments and it has none; "
          "add env=<kind> (or an envs: entry), or pick another data.source")  # fmt: skip


def _is_http_url(url: Any) -> bool:
    """An http(s)://host[:port] URL with nothing after an optional trailing slash."""
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return False
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/") and not parts.query


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> tuple[int, ...]:
    """(data, fsdp, context, tensor, expert) sizes over n_devices, in the order of
    choices.MESH_AXES; mesh.data=-1 takes the devices the other axes leave. ConfigError
    unless they use all."""
    fixed = mesh.fsdp * mesh.context * mesh.tensor * mesh.expert
    data = mesh.data if mesh.data != -1 else n_devices // fixed
    _check(
        data >= 1 and data * fixed == n_devices,
        "mesh",
        f"data={mesh.data} fsdp={mesh.fsdp} context={mesh.context} tensor={mesh.tensor} expert={mesh.expert} does "
        f"not use exactly the {n_devices} available devices; make the product equal {n_devices} (data=-1 fills)",
    )
    return data, mesh.fsdp, mesh.context, mesh.tensor, mesh.expert


def check_mesh_fits(run: RunConfig, n_devices: int) -> tuple[int, ...]:
    """Resolve the mesh shape for n_devices and check the batch and the rows divide over it."""
    mesh = run.mesh
    data, *_ = resolve_mesh_shape(mesh, n_devices)
    dp = data * mesh.fsdp * mesh.expert
    micro = run.train.global_batch_size // run.train.grad_accum
    _check(
        micro % dp == 0,
        "train.global_batch_size",
        f"{run.train.global_batch_size} / grad_accum {run.train.grad_accum} = {micro} rows per micro-batch is not "
        f"divisible by the data-parallel size data*fsdp*expert = {dp} (the batch is split over the expert axis "
        f"too); pass a multiple of {dp * run.train.grad_accum} (a grpo stage's batch is algo.grpo.prompts_per_step "
        "x group_size / mini_batches)",
    )
    _check(
        run.train.seq_len % mesh.context == 0,
        "train.seq_len",
        f"{run.train.seq_len} tokens per row do not split over mesh.context={mesh.context} devices; pass a "
        f"multiple of {mesh.context}",
    )
    return data, mesh.fsdp, mesh.context, mesh.tensor, mesh.expert
