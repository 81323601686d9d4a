"""Pure loss functions: SFT, preference (DPO family), policy gradient (GRPO family), advantages.

Every loss is a plain function of arrays returning `(loss, aux)`, where aux is a typed pytree
dataclass of metrics (passes through jit; log its fields). Nothing here calls a model: log-probs
of the policy, the reference and the rollout engine are inputs.

  logprobs     vocab_stats / token_logprobs / entropy_from_logits (chunked over the vocabulary),
               *_from_hidden variants that never materialise [B, L, V] logits, sequence_logprobs
  sft          sft_loss, sft_token_losses, and *_from_stats variants (e.g. on vocab_stats_from_hidden)
  preference   preference_loss (sigmoid, robust, ipo, hinge, dpo_norm, simpo, orpo, rpo)
  policy       policy_loss (GRPO / Dr. GRPO / DAPO / GSPO / CISPO options), kl_penalty
  advantages   group_advantages (mean or leave-one-out baseline, optional std normalisation, the
               invalid-tool-call override; options as one AdvantageConfig, `cfg=`)
"""

from ptrain.losses.advantages import AdvantageAux, group_advantages
from ptrain.losses.logprobs import (
    VocabStats,
    entropy_from_logits,
    sequence_logprobs,
    token_logprobs,
    token_logprobs_from_hidden,
    vocab_stats,
    vocab_stats_from_hidden,
)
from ptrain.losses.policy import PolicyAux, kl_penalty, policy_loss
from ptrain.losses.preference import PREFERENCE_KINDS, PreferenceAux, preference_loss
from ptrain.losses.reduce import masked_mean, safe_divide
from ptrain.losses.sft import SFTAux, sft_loss, sft_loss_from_stats, sft_token_losses, token_losses_from_stats

__all__ = [
    "AdvantageAux",
    "PREFERENCE_KINDS",
    "PolicyAux",
    "PreferenceAux",
    "SFTAux",
    "VocabStats",
    "entropy_from_logits",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "preference_loss",
    "safe_divide",
    "sequence_logprobs",
    "sft_loss",
    "sft_loss_from_stats",
    "sft_token_losses",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "token_losses_from_stats",
    "vocab_stats",
    "vocab_stats_from_hidden",
]
