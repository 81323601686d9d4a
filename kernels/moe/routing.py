"""Token-to-expert routing (pure JAX; no kernel needed: it is O(T*E)).

Covers the routers of the MoE families ptrain trains:
  softmax top-k            Switch / Mixtral / Qwen3-MoE (`norm_topk_prob`)
  sigmoid + selection bias DeepSeek-V3 (aux-loss-free balancing, arXiv:2408.15664):
                           the bias shifts which experts are *selected*, the weights
                           come from the unbiased scores
  group-limited routing    DeepSeek-V2/V3: keep the best `topk_groups` of `n_groups`
                           expert groups per token, then take the top-k inside them
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

ROUTER_KINDS = ("softmax", "sigmoid")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Result of `route` (a pytree).

    expert_ids_Txk   int32    chosen experts, best first
    weights_Txk      float32  combine weights, already times `routed_scaling_factor`
    load_E           float32  fraction of the T*k assignments that went to each expert
    lb_loss          float32  Switch load-balancing loss E * sum_e f_e * P_e (1.0 when uniform)
    router_probs_TxE float32  router probabilities (softmax; for sigmoid, scores / row sum)
    """

    expert_ids_Txk: jax.Array
    weights_Txk: jax.Array
    load_E: jax.Array
    lb_loss: jax.Array
    router_probs_TxE: jax.Array


def _check_route_args(n_experts, top_k, kind, bias_E, n_groups, topk_groups):
    if kind not in ROUTER_KINDS:
        raise ValueError(f"route: kind={kind!r} is not one of {ROUTER_KINDS}; pass kind='softmax' or 'sigmoid'.")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, n_experts={n_experts}]; lower top_k.")
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(
            f"route: n_groups={n_groups} must divide n_experts={n_experts}; use n_groups=1 to disable group-limited routing."
        )
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"route: topk_groups={topk_groups} must be in [1, n_groups={n_groups}].")
    if top_k > topk_groups * (n_experts // n_groups):
        raise ValueError(
            f"route: top_k={top_k} exceeds the {topk_groups * (n_experts // n_groups)} experts in the "
            f"{topk_groups} kept groups; raise topk_groups or lower top_k."
        )
    if bias_E is not None and tuple(bias_E.shape) != (n_experts,):
        raise ValueError(f"route: bias_E has shape {tuple(bias_E.shape)}, expected ({n_experts},).")


def _group_limit(choice_TxE, kind: str, n_groups: int, topk_groups: int):
    """Masks the experts of all but the best `topk_groups` groups with -inf.

    Group score: the best expert of the group (DeepSeek-V2, softmax) or the sum of the
    best two (DeepSeek-V3, sigmoid), both on the selection scores.
    """
    T, E = choice_TxE.shape
    grouped_TxGxS = choice_TxE.reshape(T, n_groups, E // n_groups)
    if kind == "sigmoid" and E // n_groups >= 2:
        group_score_TxG = jnp.sum(jax.lax.top_k(grouped_TxGxS, 2)[0], axis=-1)
    else:
        group_score_TxG = jnp.max(grouped_TxGxS, axis=-1)
    _, keep_idx_Txg = jax.lax.top_k(group_score_TxG, topk_groups)
    keep_TxG = jnp.zeros((T, n_groups), bool).at[jnp.arange(T)[:, None], keep_idx_Txg].set(True)
    keep_TxE = jnp.repeat(keep_TxG, E // n_groups, axis=1)
    return jnp.where(keep_TxE, choice_TxE, -jnp.inf)


def route(
    router_logits_TxE: jax.Array,
    *,
    top_k: int,
    kind: str = "softmax",
    bias_E: jax.Array | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    n_groups: int = 1,
    topk_groups: int = 1,
    token_mask_T: jax.Array | None = None,
) -> Routing:
    """Chooses `top_k` experts per token and their combine weights.

    softmax: p = softmax(logits); ids = top_k(p [+ bias]); w = p[ids] (/ sum if norm_topk_prob)
    sigmoid: s = sigmoid(logits); ids = top_k(s + bias); w = s[ids] (/ sum if norm_topk_prob)
    then w *= routed_scaling_factor. The selection is not differentiable; the weights and
    `lb_loss` are (through the router probabilities).

    Args:
      router_logits_TxE: router logits, any float dtype (computed in float32).
      top_k: experts per token.
      kind: "softmax" (Switch, Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
      bias_E: aux-loss-free balancing bias (DeepSeek-V3, arXiv:2408.15664), added to the
        scores for SELECTION only; updated outside the optimizer.
      norm_topk_prob: renormalise the k weights to sum to one.
      routed_scaling_factor: multiplier on the weights (DeepSeek-V3: 2.5).
      n_groups, topk_groups: group-limited routing (DeepSeek-V2/V3); 1, 1 disables it.
      token_mask_T: 1 for real tokens, 0 for padding (None: all real). Padding is routed like
        any token but left out of `load_E` and `lb_loss`, so neither the balancing loss nor the
        bias update learns from it (transformers masks its load-balancing loss alike).

    Returns:
      `Routing`; `lb_loss` is the Switch Transformer loss (Fedus et al. 2021, eq. 4)
      E * sum_e f_e * P_e with f_e = load_E and P_e the mean router probability.
    """
    if router_logits_TxE.ndim != 2:
        raise ValueError(
            f"route: router_logits_TxE must be 2-D [tokens, experts], got shape {router_logits_TxE.shape}; "
            "flatten batch and length first."
        )
    T, E = router_logits_TxE.shape
    _check_route_args(E, top_k, kind, bias_E, n_groups, topk_groups)
    logits = router_logits_TxE.astype(jnp.float32)
    if kind == "softmax":
        scores_TxE = jax.nn.softmax(logits, axis=-1)
        probs_TxE = scores_TxE
    else:
        scores_TxE = jax.nn.sigmoid(logits)
        probs_TxE = scores_TxE / (jnp.sum(scores_TxE, axis=-1, keepdims=True) + 1e-20)

    choice_TxE = jax.lax.stop_gradient(scores_TxE)
    if bias_E is not None:
        choice_TxE = choice_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :]
    if n_groups > 1 and topk_groups < n_groups:
        choice_TxE = _group_limit(choice_TxE, kind, n_groups, topk_groups)
    _, expert_ids_Txk = jax.lax.top_k(choice_TxE, top_k)
    expert_ids_Txk = expert_ids_Txk.astype(jnp.int32)

    weights_Txk = jnp.take_along_axis(scores_TxE, expert_ids_Txk, axis=-1)
    if norm_topk_prob:
        weights_Txk = weights_Txk / (jnp.sum(weights_Txk, axis=-1, keepdims=True) + 1e-20)
    weights_Txk = weights_Txk * routed_scaling_factor

    if token_mask_T is None:
        counts_E = jnp.zeros((E,), jnp.float32).at[expert_ids_Txk.reshape(-1)].add(1.0)
        load_E = counts_E / (T * top_k)
        lb_loss = E * jnp.sum(load_E * jnp.mean(probs_TxE, axis=0))
    else:
        if token_mask_T.shape != (T,):
            raise ValueError(f"route: token_mask_T must be [tokens] = ({T},), got shape {token_mask_T.shape}")
        m_T = token_mask_T.astype(jnp.float32)
        real = jnp.maximum(jnp.sum(m_T), 1.0)
        counts_E = jnp.zeros((E,), jnp.float32).at[expert_ids_Txk.reshape(-1)].add(jnp.repeat(m_T, top_k))
        load_E = counts_E / (real * top_k)
        lb_loss = E * jnp.sum(load_E * (jnp.sum(probs_TxE * m_T[:, None], axis=0) / real))
    return Routing(expert_ids_Txk, weights_Txk, load_E, lb_loss, probs_TxE)


def update_router_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free bias step (DeepSeek-V3): bias += rate * sign(mean(load) - load).

    Runs outside the optimizer, once per train step, on the (batch-mean) `Routing.load_E`.
    """
    if bias_E.shape != load_E.shape:
        raise ValueError(f"update_router_bias: bias_E {bias_E.shape} and load_E {load_E.shape} must match.")
    return bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E).astype(bias_E.dtype)
