"""A stage's starting point: the tokenizer, the model loaded onto the mesh, the optimizer and
the placed train state (`setup_stage` -> `Stage`), and the jit that runs the pure step with
its shardings and donation (`jit_step`). Plain functions and small records, not a Trainer.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain.config import RunConfig
from ptrain.config.seeds import component_seed
from ptrain.models.lora import LoRASpec
from ptrain.parallel import batch_sharding, make_mesh, replicated, shardings_for
from ptrain.parallel.multihost import primary_first
from ptrain.parallel.sharding import DEFAULT_RULES, shardings_following_params
from ptrain.train.state import ModelDef, TrainState, logical_axes, split_model
from ptrain.train.step import PostUpdate


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
    # The embedded tokenizer is trained and saved once, by process 0; the others load it.
    return primary_first(
        lambda: get_tokenizer(
            run.data.tokenizer_path, os.path.join(run.run_dir, "tokenizer"), vocab_size=run.data.tokenizer_vocab_size
        ),
        "ptrain:tokenizer",
    )


def stage_data(run: RunConfig, tokenizer) -> Any:
    """The stage's data config with generated rows written as JSONL into <run_dir>/data:
    the embedded arithmetic task (source=generated) or the environments' demonstrations
    (source=envs, ptrain/envs/demonstrations.py). Other sources pass through."""
    # Process 0 writes the files; the others then find the same rows there and leave them be.
    return primary_first(lambda: _write_stage_data(run, tokenizer), "ptrain:stage_data")


def _write_stage_data(run: RunConfig, tokenizer) -> Any:
    from ptrain.data.sources import write_generated

    out_dir = os.path.join(run.run_dir, "data")
    if run.data.source != "envs":
        return write_generated(run.data, out_dir)
    import dataclasses

    from ptrain.config import ConfigError
    from ptrain.data.tasks import write_jsonl

    if run.data.format == "preference":
        raise ConfigError(
            "config key 'data.source': source=envs writes chat demonstrations, and this stage reads preference "
            "pairs (data.format=preference); give the stage a preference source (e.g. data.source=jsonl with "
            "data.train_path=pairs.jsonl, or algo.dpo.policy_pairs)"
        )
    from ptrain.envs.demonstrations import demonstration_rows
    from ptrain.envs.registry import close_envs, make_env

    d = run.data.envs
    configs = [run.envs[n] for n in (d.envs or sorted(run.envs))]
    envs = {e.env_name: make_env(e, tokenizer=tokenizer, sandbox=run.sandbox) for e in configs}
    try:
        train, held = demonstration_rows(list(envs.values()), [e.weight for e in configs], n_train=d.n_train,
                                         n_eval=d.n_eval, seed=component_seed(run, "train.seed"))  # fmt: skip
    finally:
        close_envs(envs)
    # Same rows as on disk (a resumed run): the files stay untouched, so their mtimes do.
    paths = {split: write_jsonl(rows, os.path.join(out_dir, f"envs_{split}.jsonl"), if_changed=True)
             for split, rows in (("train", train), ("eval", held))}  # fmt: skip
    return dataclasses.replace(
        run.data, source="jsonl", format="chat", train_path=paths["train"], eval_path=paths["eval"] if held else None
    )


def ensure_base_model(run: RunConfig, tokenizer) -> str:
    """The embedded tiny model as a Hugging Face folder in <run_dir>/base_model (built once).

    Built from the model config with the tokenizer's vocabulary, saved with the tokenizer
    so the folder loads in transformers and SGLang like any published checkpoint.
    """
    # Built by process 0; the others wait for it and find it there.
    return primary_first(lambda: _build_base_model(run, tokenizer), "ptrain:base_model")


def _build_base_model(run: RunConfig, tokenizer) -> str:
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
        context_attention=m.context_attention,
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
    spec = base = base_sh = None
    if run.model.lora.enabled:  # train adapters over the frozen base, which is also the reference
        spec, base, base_sh = LoRASpec.of(run.model.lora), params, param_sh
        if run.model.lora.base_dtype != "float32":
            base = jax.jit(lambda t: frozen_base(t, spec, run.model.lora.base_dtype))(base)
            base_sh = jax.tree.map(lambda x: x.sharding, base)
        params, param_sh = lora_adapters(run, spec, base, param_axes, mesh)
        with_reference = False
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
        base_params=base,
        lora=spec,
    )
    shardings = TrainState(
        step=rep,
        params=param_sh,
        opt_state=opt_sh,
        rng=rep,
        model_state=mstate_sh,
        ref_params=param_sh if with_reference else None,
        base_params=base_sh,
        lora=spec,
    )
    return Placed(model_def, state, shardings, mesh)


def frozen_base(base, spec: LoRASpec, base_dtype: str):
    """The frozen base in model.lora.base_dtype: bfloat16 throughout, or with int8 the adapted
    weights quantized per output channel and the rest bfloat16."""
    from ptrain.models.lora import Int8Weight, quantize_targets

    if base_dtype == "int8":
        base = quantize_targets(base, spec)

    def cast(x):
        if isinstance(x, Int8Weight) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(jnp.bfloat16)

    return jax.tree.map(cast, base, is_leaf=lambda x: isinstance(x, Int8Weight))


def lora_adapters(run: RunConfig, spec: LoRASpec, base, param_axes, mesh):
    """Fresh adapters for the placed `base` (cast in place to model.lora.base_dtype) and their
    shardings, which follow the logical axes of the weights they adapt."""
    from ptrain.config import ConfigError
    from ptrain.config.seeds import derive_seed
    from ptrain.models.lora import adapter_axes, init_adapters

    try:
        adapters = init_adapters(base, spec, jax.random.key(derive_seed(component_seed(run, "train.seed"), "lora")))
    except ValueError as e:
        raise ConfigError(f"config key 'model.lora.targets': {e}; pass targets this model has") from None
    sh = shardings_for(adapters, adapter_axes(param_axes, adapters, spec), mesh, rules_of(run))
    return jax.device_put(adapters, sh), sh


def jit_step(step_fn, placed: Placed):
    """jit once, here in the driver: state in/out shardings, batch split over data x fsdp x expert, state donated."""
    return jax.jit(
        step_fn,
        in_shardings=(placed.state_shardings, batch_sharding(placed.mesh)),
        out_shardings=(placed.state_shardings, None),
        donate_argnums=(0,),
    )


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


def stage_mesh(run: RunConfig):
    from ptrain.config.run import check_mesh_fits

    check_mesh_fits(run, jax.device_count())
    return make_mesh(run.mesh)


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
