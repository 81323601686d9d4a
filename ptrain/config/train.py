"""Config dataclasses of the train loop, optimizer, mesh, logging, checkpoints and algorithms.

Every field is documented where it is declared: meaning, unit, constraint. These are the
Hydra schemas of the groups `algo/ optim/ mesh/ logging/ checkpoint/` and of the `train`
node; `model/` and `data/` live in model.py and data.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptrain.config.grpo import EvalAlgoConfig, GRPOAlgoConfig


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps in a stage (> 0)."""
    global_batch_size: int = 16
    """Sequences (packed rows) per optimizer step, over all devices; must divide by the
    data-parallel size (mesh data * fsdp) times grad_accum."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, accumulated inside the jitted step (>= 1); the
    gradient is the same. Also a speed setting on CPU: XLA:CPU returns a step's temporaries
    to the kernel every step, which zeroes them again on the next, so micro-batches of about
    1k tokens are faster and need less memory (docs/performance.md)."""
    seq_len: int = 128
    """Tokens per row after packing/padding."""
    eval_every: int = 50
    """Held-out evaluation every N steps and at the end; 0 disables periodic evaluation."""
    eval_batches: int = 4
    """Batches of held-out loss per evaluation (0: loss evaluation off)."""
    eval_generate: int = 64
    """Held-out prompts answered greedily for exact-match accuracy per evaluation (0: off)."""
    eval_max_new_tokens: int = 64
    """Generation budget per held-out prompt, in tokens."""
    seed: int | None = None
    """Seed of the train state's RNG and of the on-policy DPO pairs' sampling; null: derived
    from the top-level `seed` (ptrain/config/seeds.py)."""
    vocab_chunk: int = 1024
    """> 0: the loss reads final hidden states and the output head and walks the vocabulary
    in chunks of this many columns, so [B, L, V] logits never exist (~a tenth of the memory
    at V = 150k). 0: it reads full [B, L, V] logits. The default also keeps the head's
    matmuls off output rows of 4096 floats, which XLA:CPU runs at about half speed."""
    nan_check: bool = True
    """Stop with an error when the loss turns NaN/inf (checked on the host one step behind)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: adamw | adam | sgd | adafactor | lion."""
    lr: float = 3e-4
    """Peak learning rate (> 0)."""
    schedule: str = "cosine"
    """constant | linear | cosine: shape after warmup."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many steps (>= 0)."""
    warmup_ratio: float = 0.0
    """Alternative to warmup_steps: fraction of the stage's steps (0 <= r < 1); the larger wins."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr for linear/cosine decay (0 <= r <= 1)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW); applied to matrices only unless the flags below say otherwise."""
    decay_norms: bool = False
    """Also decay normalisation scales."""
    decay_biases: bool = False
    """Also decay biases."""
    decay_embeddings: bool = False
    """Also decay the token embedding (and untied output head)."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping threshold; 0 disables."""


@dataclass
class MeshConfig:
    data: int = -1
    """Data-parallel axis size; -1 takes the devices left over by the other axes."""
    fsdp: int = 1
    """Fully-sharded data-parallel axis: params and optimizer state sharded, batch split."""
    tensor: int = 1
    """Tensor-parallel axis: heads and MLP hidden split."""
    expert: int = 1
    """Expert-parallel axis: routed experts split (MoE only)."""
    rules: list[Any] | None = None
    """Logical-axis -> mesh-axis rule table as [[logical, mesh_axis_or_list_or_null], ...];
    None uses ptrain.parallel.DEFAULT_RULES."""


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Write train metrics every N steps (JSONL/TensorBoard/console)."""
    console: bool = True
    """Rich progress bar with step, loss, tokens/s and ETA."""
    jsonl: bool = True
    """metrics.jsonl in the stage folder: every metric of every logged step."""
    tensorboard: bool = True
    """TensorBoard event files in the stage folder."""
    wandb_project: str | None = None
    """Weights & Biases project; None: off (needs the wandb package)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 50
    """Save every N steps (and always at the end of a stage); 0 saves only at the end."""
    keep: int = 2
    """Checkpoints kept per stage (the newest K, >= 1)."""
    async_save: bool = True
    """Save in a background thread while training continues."""
    resume: bool = True
    """Resume an unfinished stage from its newest valid checkpoint on re-launch."""


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
    0: those metrics read the data's own held-out pairs. Must be >= 0."""


@dataclass
class AlgoConfig:
    sft: SFTAlgoConfig = field(default_factory=SFTAlgoConfig)
    """Settings of SFT stages."""
    dpo: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)
    """Settings of DPO-family stages."""
    grpo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    """Settings of GRPO-family stages (ptrain/config/grpo.py)."""
    eval: EvalAlgoConfig = field(default_factory=EvalAlgoConfig)
    """How environments are evaluated (eval stages; RL stages' periodic evaluation)."""


@dataclass
class StageConfig:
    name: str = "sft"
    """Unique stage name; its files live in <run_dir>/stages/<name>/."""
    kind: str = "sft"
    """Which driver runs it: a kind of ptrain.config.stage_kinds.STAGES (sft | dpo | grpo | eval)."""
    init: str = "previous"
    """Starting weights: previous (the preceding stage's export; the base model for the
    first stage) | base (the model group's weights) | a local Hugging Face folder path."""
    train: dict[str, Any] = field(default_factory=dict)
    """Overrides of the top-level `train` node for this stage only."""
    optim: dict[str, Any] = field(default_factory=dict)
    """Overrides of `optim` for this stage only."""
    data: dict[str, Any] = field(default_factory=dict)
    """Overrides of `data` for this stage only."""
    algo: dict[str, Any] = field(default_factory=dict)
    """Overrides of `algo` for this stage only."""
    envs: list[str] = field(default_factory=list)
    """Names of the run's environments (`envs`) this stage samples; empty: all of them."""
