"""Every named choice a config field takes, in one jax-free place.

Config validation rejects a value outside these tuples (naming the key and listing them),
and the code that acts on a choice imports the same tuple: the optimizer factory, the
losses and objectives, the decoder's own check, the mesh. A new option (a GRPO loss, a
schedule) is added here once, next to the code that implements it.
"""

from __future__ import annotations

from ptrain.config.stages import STAGES

# --- stages: ptrain/config/stages.py is the table (ptrain.stages maps it to drivers)
STAGE_KINDS: tuple[str, ...] = tuple(STAGES)
"""Stage kinds with a driver (stages[i].kind)."""
STAGE_INITS = ("previous", "base")
"""Named starting points of a stage (stages[i].init); any other value is a Hugging Face folder."""

# --- optimizer (optim.*), built by ptrain.train.optim
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")
SCHEDULES = ("constant", "linear", "cosine")

# --- model numerics (model.*), read by ptrain.models.decoder
COMPUTE_DTYPES = ("float32", "bfloat16")
"""model.dtype. float16 is refused: its 5-bit exponent underflows small gradients and
overflows large activations unless the loss is scaled, and ptrain has no loss scaling;
bfloat16 has float32's range and is what accelerators train in."""
PARAM_DTYPES = ("float32", "bfloat16")
REMAT_MODES = ("none", "full", "dots", "attention")
CONTEXT_ATTENTION = ("ring", "all_to_all")
"""model.context_attention: how attention runs when the mesh splits the sequence over its
`context` axis (ptrain.models.context_parallel)."""
ROUTERS = ("softmax", "sigmoid")

# --- algorithms (algo.*), used by ptrain.losses and ptrain.train.objectives
SFT_AGGREGATIONS = ("token_mean", "sequence_mean", "sum")
PREFERENCE_KINDS = ("sigmoid", "ipo", "hinge", "robust", "dpo_norm", "simpo", "orpo", "rpo", "dpop")
REFERENCE_FREE_KINDS = ("simpo", "orpo")
"""Preference kinds that never read the reference model (no frozen copy, no precompute pass)."""
LENGTH_NORMALISED_KINDS = ("dpo_norm", "simpo", "orpo", "rpo")
"""Preference kinds that need per-sequence token counts."""
SMOOTHABLE_KINDS = ("sigmoid", "robust", "dpo_norm", "simpo")
"""Preference kinds that take algo.dpo.label_smoothing."""

# --- RL (algo.grpo.*), used by ptrain.losses.policy, ptrain.losses.advantages, ptrain.stages.grpo
POLICY_OBJECTIVES = ("ppo", "cispo")
RATIO_LEVELS = ("token", "sequence")
POLICY_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_CORRECTIONS = (None, "is", "tis", "mis")
IS_LEVELS = ("token", "sequence", "geometric")
ADVANTAGE_BASELINES = ("mean", "leave_one_out")
GRPO_MODES = ("sync", "async")
ROLLOUT_KINDS = ("local", "sglang")
WEIGHT_DTYPES = ("bfloat16", "float32")
WEIGHT_PUSH_MODES = ("stage", "drain", "abort", "pause")

# --- data (data.*), used by ptrain.data
SOURCE_KINDS = ("generated", "envs", "jsonl", "parquet", "arrow")
FORMATS = ("auto", "chat", "prompt_completion", "preference")
BAD_ROW_POLICIES = ("skip", "fail")
TASK_OPS = ("+", "-", "*")

# --- mesh (mesh.*), built by ptrain.parallel.mesh
MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")
"""The mesh axes every batch is split over (its logical `batch` axis): the batch must divide
over data x fsdp x expert, and mesh.rules cannot move it."""


def one_of(choices: tuple[str, ...]) -> str:
    """'a, b or c': the options of a choice as a message lists them."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
