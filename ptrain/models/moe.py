"""Mixture-of-Experts MLP block on `ptrain.kernels.moe` (route + grouped-matmul experts).

Families: Qwen3-MoE and Mixtral (softmax top-k, `norm_topk_prob`), DeepSeek-V3 routing
(sigmoid scores; an aux-loss-free bias that selects experts but does not weight them;
group-limited top-k; routed scaling factor; shared experts). Token-choice and dropless:
every token reaches its top_k experts (no capacity factor), as in the HF reference.

The aux-loss-free bias is a `RouterBias` variable, not an `nnx.Param`, so
`nnx.split(model, nnx.Param, ...)` keeps it out of the optimizer; the train step moves it
with `update_router_bias(state, aux.expert_load, rate)` (DeepSeek-V3, arXiv:2408.15664).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain.kernels import moe as moe_kernels
from ptrain.models.layers import MLP, as_dtype, param


class RouterBias(nnx.Variable):
    """Per-expert selection bias of a sigmoid router; state outside the optimizer."""


class MoE(nnx.Module):
    """Routed SwiGLU experts (+ optional shared experts) for one decoder layer.

    x [B, L, D] -> (y [B, L, D], lb_loss scalar, load [E]).
    """

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
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

    def __call__(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        B, L, D = x_BxLxD.shape
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
        )
        y_TxD = moe_kernels.moe_ffn(
            x_TxD,
            r.expert_ids_Txk,
            r.weights_Txk.astype(x_TxD.dtype),
            self.w_gate[...],
            self.w_up[...],
            self.w_down[...],
            implementation=self.implementation,
        )
        if self.n_shared:
            y_TxD = y_TxD + self.shared(x_TxD)
        return y_TxD.reshape(B, L, D), r.lb_loss, r.load_E


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
    # Layer order = order of the integer layer index in the path (list layout), or the
    # leading axis of a single stacked variable (scan layout).
    bias_items.sort(key=lambda t: tuple(k for k in t[1] if isinstance(k, int)))
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
