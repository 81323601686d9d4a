"""MoE dispatch for ptrain: routing, permute, grouped matmul, combine, SwiGLU expert FFN.

Public API (stable; the model's MoE block and the tests code against it):

  route(router_logits_TxE, *, top_k, kind="softmax", bias_E=None, norm_topk_prob=True,
        routed_scaling_factor=1.0, n_groups=1, topk_groups=1) -> Routing
  permute(x_TxD, expert_ids_Txk, n_experts) -> (x_sorted_MxD, group_sizes_E, Permutation)
  grouped_matmul(lhs_MxK, rhs_GxKxN, group_sizes_G, *, implementation="auto",
                 preferred_element_type=None, tiling=None) -> out_MxN
  combine(y_sorted_MxD, perm, weights_Txk) -> y_TxD
  moe_ffn(x_TxD, expert_ids_Txk, weights_Txk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
          implementation="auto", tiling=None, mesh=None, expert_axis=None) -> y_TxD
  update_router_bias(bias_E, load_E, rate) -> bias_E    (aux-loss-free balancing step)

A MoE block is two calls:

  r = route(x_TxD @ w_router_DxE, top_k=cfg.top_k, kind=cfg.router, ...)
  y_TxD = moe_ffn(x_TxD, r.expert_ids_Txk, r.weights_Txk, w_gate, w_up, w_down,
                  implementation=cfg.moe_implementation)
  aux loss: cfg.router_aux_loss_coef * r.lb_loss; metrics: r.load_E

`implementation`: "xla" (portable; the fast CPU path), "ragged_dot" (lax.ragged_dot,
baseline), "pallas_tpu" (Mosaic), "pallas_gpu" (Pallas GPU, Triton lowering), the two
"*_interpret" variants that run those kernels on CPU, and "auto" (by backend).
`reference` holds the plain-jnp versions everything is tested against.
"""

from . import reference
from .ops import IMPLEMENTATIONS, Permutation, combine, grouped_matmul, moe_ffn, permute, resolve_implementation
from .routing import Routing, route, update_router_bias

__all__ = [
    "IMPLEMENTATIONS",
    "Permutation",
    "Routing",
    "combine",
    "grouped_matmul",
    "moe_ffn",
    "permute",
    "reference",
    "resolve_implementation",
    "route",
    "update_router_bias",
]
