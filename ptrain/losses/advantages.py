"""Group-relative advantages for RL with verifiable rewards (one group = the G samples of a prompt).

For rewards r_1..r_G of one prompt:
  baseline="mean"           A_i = r_i - mean_j r_j                          GRPO, Shao et al. 2402.03300
  baseline="leave_one_out"  A_i = r_i - mean_{j != i} r_j                   RLOO, Ahmadian et al. 2402.14740
                                = G / (G - 1) (r_i - mean_j r_j)
  normalize_std=True        A_i <- A_i / (std_j r_j + eps)                  GRPO; off in Dr. GRPO 2503.20783
  invalid_tool_call_advantage=a  A_i <- a where invalid_BxG flags sample i   Nemotron 3 (a = -5)
std is the sample standard deviation (ddof=1, as TRL and verl compute it; `ddof=0` for the
population one). A group whose rewards are all equal carries no learning signal: its
advantages are exactly 0 (not rounding noise divided by eps) and it is counted in
`frac_zero_std` (TRL's `frac_reward_zero_std`; DAPO's dynamic sampling drops such groups).

The options come as one group, `cfg: AdvantageConfig` (ptrain/config/advantages.py; an
`algo.grpo` config extends it), as `policy_loss` takes PolicyLossConfig: a new option is a field
there, its check in `AdvantageConfig.advantage_problems`, and its use here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ptrain.config.advantages import AdvantageConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdvantageAux:
    """Group statistics, float32 scalars.

    Attributes:
      frac_zero_std: fraction of groups whose rewards are all equal.
      reward_mean: mean reward over all samples.
      reward_std: mean over groups of the within-group standard deviation.
      advantage_abs_mean: mean |A|.
    """

    frac_zero_std: jax.Array
    reward_mean: jax.Array
    reward_std: jax.Array
    advantage_abs_mean: jax.Array


def group_advantages(
    rewards_BxG: jax.Array,
    *,
    cfg: AdvantageConfig | None = None,
    invalid_BxG: jax.Array | None = None,
    eps: float = 1e-6,
    ddof: int = 1,
) -> tuple[jax.Array, AdvantageAux]:
    """Group-normalised advantages (formulas in the module docstring).

    Args:
      rewards_BxG: `[B, G]` scalar reward of each of the G samples of each of B prompts.
        Flat `[B * G]` rewards with prompt-major order reshape with `.reshape(B, G)`.
      cfg: the options as one group (`ptrain.config.AdvantageConfig`, or an `algo.grpo` config,
        which extends it): baseline ("mean" or "leave_one_out"), normalize_std (divide by the
        group std + eps), invalid_tool_call_advantage. None: the defaults (GRPO).
      invalid_BxG: `[B, G]` bool, samples whose advantage is cfg.invalid_tool_call_advantage
        instead (those with an invalid tool call); ignored while that option is None.
      eps: added to the std.
      ddof: delta degrees of freedom of the std (1: sample std; 0: population std).

    Returns:
      (advantages_BxG float32, AdvantageAux); the reward statistics are of all samples,
      advantage_abs_mean of the advantages returned.
    """
    cfg = cfg if cfg is not None else AdvantageConfig()
    problems = cfg.advantage_problems()
    if problems:
        field, text = problems[0]
        raise ValueError(f"{field} {text}.")
    rewards = jnp.asarray(rewards_BxG, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(
            f"rewards must be [B, G] (prompts x samples per prompt), got shape {tuple(rewards.shape)}; "
            "reshape flat prompt-major rewards with rewards.reshape(num_prompts, group_size)."
        )
    group = rewards.shape[1]
    if group < 2 and (cfg.baseline == "leave_one_out" or cfg.normalize_std):
        raise ValueError(
            f"group size {group} is too small: leave_one_out and the std need at least 2 samples per "
            "prompt (set G >= 2)."
        )
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof!r}.")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}.")
    if invalid_BxG is not None and tuple(jnp.shape(invalid_BxG)) != tuple(rewards.shape):
        raise ValueError(
            f"invalid_BxG must have the rewards' shape {tuple(rewards.shape)}, got {tuple(jnp.shape(invalid_BxG))}."
        )

    mean = jnp.mean(rewards, axis=1, keepdims=True)
    centred = rewards - mean
    if cfg.baseline == "leave_one_out":
        centred = centred * (group / (group - 1))
    std = jnp.sqrt(jnp.sum(jnp.square(rewards - mean), axis=1, keepdims=True) / max(group - ddof, 1))
    adv = centred / (std + eps) if cfg.normalize_std else centred
    # Exact equality, not std < tol: a group is degenerate only when every reward is identical.
    zero_std = jnp.max(rewards, axis=1, keepdims=True) == jnp.min(rewards, axis=1, keepdims=True)
    adv = jnp.where(zero_std, 0.0, adv)
    if invalid_BxG is not None and cfg.invalid_tool_call_advantage is not None:
        adv = jnp.where(jnp.asarray(invalid_BxG, bool), jnp.float32(cfg.invalid_tool_call_advantage), adv)
    aux = AdvantageAux(
        frac_zero_std=jnp.mean(zero_std.astype(jnp.float32)),
        reward_mean=jnp.mean(rewards),
        reward_std=jnp.mean(std),
        advantage_abs_mean=jnp.mean(jnp.abs(adv)),
    )
    return adv, aux
