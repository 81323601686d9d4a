"""The rollout engine a stage samples with, by `rollout.kind`.

    engine = make_engine(run, model_def, params, model_state, mesh=mesh, tokenizer=tok, seed=s,
                         stage_dir=stage_dir)

local: `LocalEngine` on the stage's own weights, in process (as several JAX processes, a
`PrimaryEngine`: a LocalEngine in process 0 alone, on one of its devices). sglang: `FleetEngine` on the
fleet named by rollout.urls / rollout.router_url, exporting weight versions into
`<stage_dir>/weights`, or with rollout.weight_dir set into a folder of the stage's own under
it (weight_sync.run_weight_dir), so runs may share that root. Both speak the rollout
protocol; the stage syncs either to its weights with `update_weights` before sampling.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax

from ptrain.parallel.multihost import host_array, on_primary


def make_engine(run, model_def, params, model_state, *, mesh, tokenizer, seed: int, stage_dir: str | None = None,
                lora=None):  # fmt: skip
    """LocalEngine or FleetEngine for `run.rollout` (RunConfig), over the model
    `model_def.bind(params, model_state)`; `tokenizer` gives the stop ids. `lora` (a LoRASpec):
    a LocalEngine with one adapter slot of that shape, `params` being the frozen base."""
    from ptrain.data.tokenizer import stop_token_ids

    ro = run.rollout
    model = model_def.bind(params, model_state)
    eos = stop_token_ids(tokenizer)
    if ro.kind == "local":
        from ptrain.config.run import ConfigError
        from ptrain.rollout.local import LocalEngine

        # seq_len + 1 tokens make seq_len shifted training positions; the model's own limit
        # caps the default, so a seq_len at that limit needs no rollout.context_length.
        limit = model.cfg.max_seq_len
        context = ro.context_length or min(run.train.seq_len + 1, limit)
        if context > limit:
            raise ConfigError(
                f"config key 'rollout.context_length': {context} exceeds the model's max_seq_len={limit}; "
                f"pass at most {limit}, or null (train.seq_len + 1, capped at {limit})"
            )
        options = dict(
            max_running_requests=ro.max_running_requests,
            context_length=context,
            eos_token_ids=eos,
            decode_steps=ro.decode_steps,
            seed=seed,
            **({} if lora is None else dict(max_loras=1, max_lora_rank=lora.rank, lora_targets=lora.targets)),
        )
        if jax.process_count() > 1:
            return PrimaryEngine(lambda p, s: LocalEngine(model_def.bind(p, s), **options), params, model_state)
        return LocalEngine(model, mesh=mesh, **options)
    if ro.kind == "sglang":
        from ptrain.rollout.fleet import FleetEngine

        extra = {"eos_token_id": list(eos)} if eos else None
        return FleetEngine.from_config(
            ro, model_cfg=model.cfg, weight_dir=fleet_weight_dir(run, stage_dir), eos_token_ids=eos, seed=seed,
            extra_config=extra,
        )  # fmt: skip
    raise ValueError(f"rollout.kind={ro.kind!r}: pass local or sglang")


def fleet_weight_dir(run, stage_dir: str | None) -> str:
    """Where a stage's FleetEngine exports weight versions: `<stage_dir>/weights`, or with
    rollout.weight_dir set, the stage's own folder under it (weight_sync.run_weight_dir), which
    no other run writes or prunes and a resumed run finds again."""
    from ptrain.rollout.weight_sync import run_weight_dir

    owner = stage_dir or run.run_dir
    if not run.rollout.weight_dir:
        return os.path.join(owner, "weights")
    name = f"{run.name}-{os.path.basename(os.path.normpath(stage_dir))}" if stage_dir else run.name
    return run_weight_dir(run.rollout.weight_dir, owner, name)


class PrimaryEngine:
    """The embedded engine of a job of several JAX processes: a LocalEngine in process 0 alone,
    on one of its devices, since sampling holds no collective the processes could reach in
    step. Process 0 samples (the stages call it through `on_primary`). Building it and every
    weight update are collectives: every process calls them in the same order, each gathers
    the (sharded) weights or adapters to its host, process 0 installs them, and a failure
    there is raised on every process (`on_primary`), so none is left waiting. `default_lora` is
    known everywhere, as the stage asks it on every process; the rest of the engine exists in
    process 0 only."""

    def __init__(self, make: Callable, params, model_state):
        params, model_state = jax.tree.map(host_array, (params, model_state))
        self._engine = None
        self._default_lora: str | None = None

        def build() -> None:
            self._engine = make(params, model_state)

        self._in_primary(build, "building the embedded engine in process 0")

    @staticmethod
    def _in_primary(fn: Callable, what: str):
        from ptrain.rollout.protocol import EngineUnavailable

        return on_primary(fn, what, keep=(EngineUnavailable,))

    @property
    def default_lora(self) -> str | None:
        return self._default_lora

    def set_default_lora(self, name: str | None) -> None:
        if self._engine is not None:
            self._engine.set_default_lora(name)
        self._default_lora = name

    def update_weights(self, params, model_state=None, *, weight_version: str | None = None, mode: str = "drain"):
        params, model_state = jax.tree.map(host_array, (params, model_state))
        return self._in_primary(
            lambda: self._engine.update_weights(params, model_state, weight_version=weight_version, mode=mode),
            "installing weights in process 0's engine",
        )

    def load_lora(self, name: str, path: str | None = None, *, adapters=None, spec=None, replace: bool = False):
        adapters = jax.tree.map(host_array, adapters)
        return self._in_primary(
            lambda: self._engine.load_lora(name, path, adapters=adapters, spec=spec, replace=replace),
            f"loading adapter {name!r} in process 0's engine",
        )

    def update_lora(self, name: str, adapters, spec, *, weight_version: str | None = None, mode: str = "drain"):
        adapters = jax.tree.map(host_array, adapters)
        return self._in_primary(
            lambda: self._engine.update_lora(name, adapters, spec, weight_version=weight_version, mode=mode),
            f"installing adapter {name!r} in process 0's engine",
        )

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def __getattr__(self, name: str):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(
                f"PrimaryEngine.{name}: the embedded engine of a job of several processes runs in process 0 alone; "
                "sample through ptrain.parallel.multihost.on_primary"
            )
        return getattr(engine, name)
