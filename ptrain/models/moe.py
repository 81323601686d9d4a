"""Mixture-of-Experts MLP block on `ptrain.kernels.moe` (route + grouped-matmul experts).

Families: Qwen3-MoE and Mixtral (softmax top-k, `norm_topk_prob`), DeepSeek-V3 routing
(sigmoid scores; an aux-loss-free bias that selects experts but does not weight them;
group-limited top-k; routed scaling factor; shared experts). Token-choice and dropless:
every token reaches its top_k experts (no capacity factor), as in the HF reference.

The aux-loss-free bias is a `RouterBias` variable, not an `nnx.Param`, so
`nnx.split(model, nnx.Param, ...)` keeps it out of the optimizer; the train step moves it
with `update_router_bias(state, aux.expert_load, rate)` (DeepSeek-V3, arXiv:2408.15664).

Expert parallelism: built with an `ExpertParallel` plan (the Decoder makes one with
`expert_parallel_plan` when the rules put the experts on a mesh axis larger than 1), the
block runs its experts with `moe_ffn(..., mesh=, expert_axis=)`: inside `shard_map` each
device takes its own slice of the tokens, sends every row to the device that holds its
expert (all-to-all: padded on CPU, ragged on GPU/TPU), runs its local experts and sends
the results back. The expert weights enter the shard_map split over the expert axis only
(shard_map gathers any fsdp / tensor split of their other dimensions). The block's input
and output are constrained to the activations' batch layout (the rules' `batch` axes), so
the shard_map's split of the tokens over every device stays inside the block; left to
sharding propagation it spread into the attention, and with a tensor axis XLA then
replicated whole activations to get back to a heads split. Routing, the load-balancing
loss and the shared experts stay outside, under the ordinary automatic partitioning.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ptrain.kernels import moe as moe_kernels
from ptrain.models import lora
from ptrain.models.layers import MLP, as_dtype, param


class RouterBias(nnx.Variable):
    """Per-expert selection bias of a sigmoid router; state outside the optimizer."""


def expert_parallel_axis(cfg: Any, mesh: jax.sharding.Mesh | None, rules=None) -> str | None:
    """The mesh axis the MoE blocks run expert-parallel on, or None (no mesh, a dense
    model, or the logical `expert` axis maps to mesh axes of size 1 only).

    The axis is the one the rule table (default ptrain.parallel.DEFAULT_RULES) maps the
    logical `expert` axis to, so the dispatch follows the expert weights' own placement.
    Raises ValueError when the experts cannot split evenly over it, or when the rules
    spread them over more than one axis of size > 1 (the all-to-all runs over one axis).
    """
    if mesh is None or not cfg.is_moe:
        return None
    from ptrain.parallel.sharding import sole_split_axis

    axis = sole_split_axis(mesh, rules, "expert", "expert parallelism exchanges tokens over one mesh axis")
    if axis is None:
        return None
    if cfg.n_experts % mesh.shape[axis]:
        raise ValueError(
            f"model.n_experts={cfg.n_experts} does not split over the {mesh.shape[axis]} devices of mesh axis "
            f"{axis!r}; choose a mesh.{axis} size that divides the number of experts"
        )
    return axis


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How the MoE blocks run expert-parallel (hashable: a static attribute of the module).

    mesh: the device mesh; axis: the mesh axis the experts are split over; batch_axes and
    length_axes: the mesh axes (of size > 1) the activations' batch and sequence dimensions
    are split over.
    """

    mesh: jax.sharding.Mesh
    axis: str
    batch_axes: tuple[str, ...]
    length_axes: tuple[str, ...] = ()


def expert_parallel_plan(cfg: Any, mesh: jax.sharding.Mesh | None, rules=None) -> ExpertParallel | None:
    """The ExpertParallel plan for `cfg` on `mesh` under `rules`, or None (see expert_parallel_axis).

    With the experts unsplit but the sequence split (context parallelism), the plan runs
    the same dispatch over an axis of size 1: each device routes its own tokens through
    every expert. Left to automatic partitioning, the token sort of the dispatch gathered
    every token of the sequence onto each device, undoing the split."""
    from ptrain.parallel.sharding import split_axes

    axis = expert_parallel_axis(cfg, mesh, rules)
    if axis is None and cfg.is_moe and mesh is not None and split_axes(mesh, rules, "length"):
        axis = next((a for a in mesh.axis_names if mesh.shape[a] == 1), None)
    if axis is None:
        return None
    return ExpertParallel(mesh, axis, split_axes(mesh, rules, "batch"), split_axes(mesh, rules, "length"))


class MoE(nnx.Module):
    """Routed SwiGLU experts (+ optional shared experts) for one decoder layer.

    x [B, L, D] -> (y [B, L, D], lb_loss scalar, load [E]).
    ep: run the experts expert-parallel by this plan (module docstring); None: one program,
    sharded by XLA from the weights' logical axes.
    """

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs, ep: ExpertParallel | None = None):
        self.ep = ep
        D, E, F = cfg.d_model, cfg.n_experts, cfg.d_ff_expert
        pd = as_dtype(cfg.param_dtype)
        self.dtype = as_dtype(cfg.dtype)
        self.top_k = cfg.top_k
        self.kind = cfg.router
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = float(cfg.routed_scaling_factor)
        self.n_groups, self.topk_groups = cfg.n_groups, cfg.topk_groups
        self.implementation = cfg.moe_implementation
        self.router = param(rngs, (D, E), ("embed", None), std=cfg.init_std, dtype=pd)
        if cfg.router == "sigmoid":
            self.bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,), eager_sharding=False)
        self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "mlp"), std=cfg.init_std, dtype=pd)
        self.w_up = param(rngs, (E, D, F), ("expert", "embed", "mlp"), std=cfg.init_std, dtype=pd)
        self.w_down = param(rngs, (E, F, D), ("expert", "mlp", "embed"), std=cfg.init_std, dtype=pd)
        self.n_shared = cfg.n_shared_experts
        if cfg.n_shared_experts:
            self.shared = MLP(D, F * cfg.n_shared_experts, cfg, rngs=rngs)

    def __call__(
        self, x_BxLxD: jax.Array, token_mask_BxL: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """token_mask_BxL: 1 for real tokens, 0 for padding, which the load and the balancing
        loss leave out (None: every token counts)."""
        B, L, D = x_BxLxD.shape
        # The expert-parallel path splits the tokens over every device of the mesh; a call
        # whose token count does not divide (KV-cache decoding of a few rows) takes the
        # single-program path instead, where XLA gathers the experts it needs. Static
        # shapes, so the choice is made once per trace.
        ep = self.ep if self.ep is not None and (B * L) % self.ep.mesh.size == 0 else None
        x_BxLxD = self._batch_layout(x_BxLxD, ep)
        x_TxD = x_BxLxD.reshape(B * L, D)
        # Router in float32, as the HF references do (scores decide discrete choices).
        logits_TxE = x_TxD.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        r = moe_kernels.route(
            logits_TxE,
            top_k=self.top_k,
            kind=self.kind,
            bias_E=self.bias[...] if self.kind == "sigmoid" else None,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
            token_mask_T=None if token_mask_BxL is None else token_mask_BxL.reshape(B * L),
        )
        y_TxD = moe_kernels.moe_ffn(
            x_TxD,
            r.expert_ids_Txk,
            r.weights_Txk.astype(x_TxD.dtype),
            # An adapter of the routed experts is merged into each expert's weight: the grouped
            # matmul takes one weight per expert.
            lora.merged(self.w_gate[...]),
            lora.merged(self.w_up[...]),
            lora.merged(self.w_down[...]),
            implementation=self.implementation,
            mesh=None if ep is None else ep.mesh,
            expert_axis=None if ep is None else ep.axis,
            token_axes=None if ep is None else ep.batch_axes + ep.length_axes,
        )
        if self.n_shared:
            y_TxD = y_TxD + self.shared(x_TxD)
        return self._batch_layout(y_TxD.reshape(B, L, D), ep), r.lb_loss, r.load_E

    @staticmethod
    def _batch_layout(a_BxLxD: jax.Array, ep: ExpertParallel | None) -> jax.Array:
        """Pins the block's input and output to the activations' batch layout around the
        shard_map (module docstring), so its all-token split does not spread into the
        attention through sharding propagation, forwards or backwards."""
        if ep is None:
            return a_BxLxD
        B, L, _ = a_BxLxD.shape
        size = lambda axes: math.prod(ep.mesh.shape[a] for a in axes)  # noqa: E731
        if B % size(ep.batch_axes) or L % size(ep.length_axes):
            return a_BxLxD
        layout = NamedSharding(ep.mesh, PartitionSpec(ep.batch_axes or None, ep.length_axes or None, None))
        return jax.lax.with_sharding_constraint(a_BxLxD, layout)


def update_router_bias(state: nnx.State, expert_load_LxE: jax.Array, rate: float) -> nnx.State:
    """Aux-loss-free balancing step on every RouterBias in `state` (pure; returns a new State).

    bias_l += rate * sign(mean(load_l) - load_l) for MoE layer l (DeepSeek-V3). `state` is
    any State holding the model's RouterBias variables (e.g. the `rest` of
    `nnx.split(model, nnx.Param, ...)`); `expert_load_LxE` is `ModelAux.expert_load`
    (rows in layer order; average it over micro-batches first). Other variables pass
    through unchanged; with no RouterBias (softmax routers) the state is returned as is.
    """
    flat = list(nnx.to_flat_state(state))
    bias_items = [
        (i, p, v)
        for i, (p, v) in enumerate(flat)
        if isinstance(v, RouterBias) or getattr(v, "type", None) is RouterBias
    ]
    if not bias_items:
        return state
    # Layer order = the order of the MoE layer groups (`moe_blocks`, `moe_blocks_1`, ...),
    # then the integer layer index in the path (list layout) or the leading axis of the
    # group's stacked variable (scan layout).
    bias_items.sort(key=lambda t: _layer_order_key(t[1]))
    row = 0
    for i, path, var in bias_items:
        bias = var[...]
        n = bias.shape[0] if bias.ndim == 2 else 1
        load = expert_load_LxE[row : row + n]
        if bias.ndim == 1:
            new = moe_kernels.update_router_bias(bias, load[0], rate)
        else:
            new = jax.vmap(moe_kernels.update_router_bias, in_axes=(0, 0, None))(bias, load, rate)
        flat[i] = (path, var.replace(new))
        row += n
    if row != expert_load_LxE.shape[0]:
        raise ValueError(
            f"update_router_bias: expert_load has {expert_load_LxE.shape[0]} rows but the state holds {row} "
            "MoE layers with a RouterBias; pass ModelAux.expert_load of the same model"
        )
    return nnx.from_flat_state(flat)


def _layer_order_key(path: tuple) -> tuple:
    """Sort key of a variable path in layer order: (group number, integer indices)."""
    group = 0
    for k in path:
        m = re.fullmatch(r"moe_blocks(?:_(\d+))?", str(k))
        if m:
            group = int(m.group(1) or 0)
            break
    return (group,) + tuple(k for k in path if isinstance(k, int))
