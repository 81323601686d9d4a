"""TrainState: the whole of a run's mutable state as one small pytree.

Params live as plain nested dicts of arrays (`nnx.to_pure_dict`), so optax, Orbax and
sharding rules see ordinary pytrees; `ModelDef.bind` turns them back into the NNX module
inside a jitted function. Non-trainable model state (e.g. the MoE router's aux-loss-free
bias) is kept apart in `model_state` so the optimizer never touches it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ptrain.models.lora import LoRASpec, attach, merge

PyTree = Any


@struct.dataclass
class TrainState:
    step: jax.Array
    """Optimizer steps taken (int32 scalar)."""
    params: PyTree
    """Trainable parameters, nested dict of float32 arrays."""
    opt_state: PyTree
    """Optimizer state matching params."""
    rng: jax.Array
    """PRNG key data (uint32[2]); split inside the step when randomness is needed."""
    model_state: PyTree = None
    """Non-trainable model variables (router bias, ...); updated by the step, not the optimizer."""
    ref_params: PyTree = None
    """Frozen reference parameters for losses that need them (DPO); None otherwise (and under
    LoRA, whose base is the reference)."""
    base_params: PyTree = None
    """Under LoRA: the frozen base weights, with `params` holding only the adapters
    (ptrain/models/lora.py). Not checkpointed: it is the stage's starting model. None otherwise."""
    lora: LoRASpec | None = struct.field(pytree_node=False, default=None)
    """Under LoRA, the adapters' static settings; None otherwise."""

    def model_params(self, params: PyTree = None, batch: dict | None = None) -> PyTree:
        """The module's param tree for `ModelDef.bind`: `params` (default: this state's), or,
        under LoRA, the base with those adapters attached. With `batch` (a training
        micro-batch) adapter dropout draws its masks from the state's rng, the step and the
        micro-batch, so every micro-batch of every step draws its own."""
        params = self.params if params is None else params
        if self.lora is None:
            return params
        key = None
        if batch is not None and self.lora.dropout > 0:
            key = jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)
            ids = [jnp.sum(x, dtype=jnp.uint32) for x in jax.tree.leaves(batch) if jnp.issubdtype(x.dtype, jnp.integer)]
            key = jax.random.fold_in(key, sum(ids, jnp.zeros((), jnp.uint32)))
        return attach(self.base_params, params, self.lora, key)

    def merged_params(self) -> PyTree:
        """Plain weights of the current model (under LoRA the adapters merged into the base):
        what the rollout engine and an export take."""
        if self.lora is None:
            return self.params
        return merge(self.base_params, self.params, self.lora)

    def reference_params(self) -> PyTree:
        """The frozen reference model's param tree: `ref_params`, or under LoRA the base
        without adapters (no second copy of the weights)."""
        return self.base_params if self.lora is not None else self.ref_params

    def checkpointed(self) -> TrainState:
        """What a checkpoint holds: everything but the frozen base (which the stage reloads)."""
        return self.replace(base_params=None)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of a split NNX model: rebuilds the module from pure-dict state."""

    graphdef: Any

    def bind(self, params: PyTree, model_state: PyTree = None) -> nnx.Module:
        if model_state:
            return nnx.merge(self.graphdef, params, model_state)
        return nnx.merge(self.graphdef, params)


def split_model(model: nnx.Module) -> tuple[ModelDef, PyTree, PyTree]:
    """Split a module into (static def, params dict, other-state dict)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return ModelDef(graphdef), nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def logical_axes(model: nnx.Module) -> tuple[PyTree, PyTree]:
    """Logical axis names of (params, other state) as pytrees of tuples matching the pure dicts.

    Reads the `out_sharding` metadata the model code attaches to each variable; a
    variable without it is replicated (all-None axes).
    """

    def names(state):
        flat = {}
        for path, var in nnx.to_flat_state(state):
            spec = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
            ndim = jnp.ndim(var.get_value() if hasattr(var, "get_value") else var.value)
            flat[path] = tuple(spec) if spec else (None,) * ndim
        return _unflatten(flat)

    _, params, rest = nnx.split(model, nnx.Param, ...)
    return names(params), names(rest)


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def init_train_state(
    params: PyTree, tx, *, seed: int, model_state: PyTree = None, ref_params: PyTree | None = None
) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        model_state=model_state or {},
        ref_params=ref_params,
    )
