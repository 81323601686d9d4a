"""The algorithms' settings (Hydra group `algo/`): SFT, the DPO family, Bradley-Terry
reward models, and (from grpo.py) the GRPO family and environment evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ptrain.config.grpo import EvalAlgoConfig, GRPOAlgoConfig


@dataclass
class SFTAlgoConfig:
    aggregation: str = "token_mean"
    """Loss aggregation: token_mean (every target token weighs the same) | sequence_mean
    (mean over sequences of each one's token mean) | sum (summed token losses / norm_constant)."""
    norm_constant: float | None = None
    """Divisor for aggregation=sum, in tokens; None uses global_batch_size * seq_len."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon in [0, 1)."""
    z_loss: float = 0.0
    """Weight of the z-loss (log Z)^2 that keeps logits from drifting (PaLM)."""


@dataclass
class DPOAlgoConfig:
    kind: str = "sigmoid"
    """Preference loss: sigmoid (DPO) | ipo | hinge | robust | dpo_norm | simpo | orpo | rpo |
    dpop (formulas and papers: ptrain/losses/preference.py)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (> 0)."""
    label_smoothing: float = 0.0
    """Assumed label-noise rate for kind=robust, in [0, 0.5)."""
    gamma: float = 0.5
    """SimPO target reward margin (gamma/beta ratio form: margin = gamma)."""
    nll_weight: float = 1.0
    """Weight of the chosen NLL term for rpo/orpo."""
    dpop_lambda: float = 50.0
    """Weight of DPO-Positive's penalty on a chosen log-prob below the reference's, for
    kind=dpop (>= 0; Pal et al. 2024 use 50)."""
    precompute_reference: bool = False
    """Compute reference log-probs in one pass over the data before training (saves the
    reference params' memory) instead of inside every step."""
    bucket_lengths: bool = True
    """Cut each preference batch (training, the reference pass and the held-out metrics; a
    reward-model stage's too) to the shortest of train.seq_len, seq_len/2, ... (at least 128
    tokens, a multiple of mesh.context) that holds its longest side, so short pairs are not
    trained at the full context's cost; a stage compiles one step per length it meets. false:
    every batch at seq_len, one compile."""
    policy_pairs: int = 0
    """0: train on the data's own pairs. N > 0: before training, sample `policy_samples`
    completions from the stage's starting policy for each of the first N training prompts,
    grade them with the task's verifier, and train on (correct, incorrect) pairs of the
    policy's own samples (on-policy pairs, as in iterative RPO: Pang et al. 2024, arXiv
    2404.19733). Rows need task metadata (the embedded task has it). Must be >= 0."""
    policy_samples: int = 4
    """Completions sampled per prompt when policy_pairs > 0. Must be >= 1 (1 with greedy
    decoding: more would repeat it)."""
    policy_temperature: float = 1.0
    """Sampling temperature of those completions; 0 decodes greedily, so the rejected side
    is exactly the answer the policy gives at evaluation (SPIN's pairing when it is wrong:
    the data's answer against the policy's own, Chen et al. 2024, arXiv 2401.01335).
    Must be >= 0."""
    policy_step_level: bool = False
    """Cut each on-policy rejected completion after its first line that differs from the
    chosen one (Step-DPO: Lai et al. 2024, arXiv 2406.18629). The shared lines cancel in
    the margin, so the pair contrasts the first wrong step alone instead of pushing down
    every token the wrong completion goes on to write."""
    policy_max_new_tokens: int = 128
    """Length cap of those completions, in tokens; a completion cut by it counts as
    incorrect. Must be >= 1."""
    policy_eval_pairs: int = 128
    """With policy_pairs > 0: held-out prompts sampled and graded the same way into the
    held-out pairs the stage's preference metrics read (pairs drawn like the training ones).
    0: those metrics read the data's own held-out pairs. Must be >= 0. With env_pairs > 0:
    held-out tasks of each environment sampled into held-out pairs."""
    env_pairs: int = 0
    """0: pairs come from data (or policy_pairs). N > 0: before training, sample
    `policy_samples` episodes of each of N tasks drawn from the stage's environments and pair
    them in Nemotron 3 Nano's categories: correctness decides, and where an environment
    declares no tools any sample that calls one is rejected (ptrain/stages/env_pairs.py).
    Must be >= 0; excludes policy_pairs."""


@dataclass
class RMAlgoConfig:
    """A reward-model stage (kind rm): a scalar score r(x, y) read at each sequence's last
    token, trained on preference pairs with the Bradley-Terry loss
    -log sigmoid(r(chosen) - r(rejected) - margin) + center_rewards_coef * (r(chosen) + r(rejected))^2
    (Ouyang et al. 2022, arXiv 2203.02155; the centring term is TRL RewardTrainer's)."""

    margin: float = 0.0
    """Fixed margin the chosen score must clear over the rejected one before the loss lets
    go (Llama 2's margin loss, Touvron et al. 2023, with one margin for every pair). >= 0,
    in reward units; 0 is the plain Bradley-Terry loss."""
    center_rewards_coef: float = 0.0
    """Weight of the (r(chosen) + r(rejected))^2 penalty that keeps the scores centred on
    zero (Eisenstein et al. 2023, arXiv 2312.09244; TRL uses 0.01). >= 0; 0 leaves the
    scores' offset free, which the Bradley-Terry loss alone never pins down."""


def validate_rm(cfg: RMAlgoConfig, check) -> None:
    """Reject impossible values; `check(cond, key, message)` raises naming the key."""
    check(
        math.isfinite(cfg.margin) and cfg.margin >= 0,
        "algo.rm.margin",
        f"must be a finite number >= 0 (0: no margin), got {cfg.margin}",
    )
    check(
        math.isfinite(cfg.center_rewards_coef) and cfg.center_rewards_coef >= 0,
        "algo.rm.center_rewards_coef",
        f"must be a finite number >= 0 (0: off; TRL uses 0.01), got {cfg.center_rewards_coef}",
    )


@dataclass
class AlgoConfig:
    sft: SFTAlgoConfig = field(default_factory=SFTAlgoConfig)
    """Settings of SFT stages."""
    dpo: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)
    """Settings of DPO-family stages."""
    rm: RMAlgoConfig = field(default_factory=RMAlgoConfig)
    """Settings of reward-model stages (kind rm)."""
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    """Settings of GRPO-family stages (ptrain/config/grpo.py)."""
    eval: EvalAlgoConfig = field(default_factory=EvalAlgoConfig)
    """How environments are evaluated (eval stages; RL stages' periodic evaluation)."""
