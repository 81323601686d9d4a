"""A recipe's stages: `StageConfig` (one entry of `stages`), and the kinds a stage may
name with what each needs of the config (no JAX, no drivers).

The config validates `stages[i].kind` against this table and checks each stage's data and
environments by it; `ptrain.stages` maps the same kinds to the drivers that run them (a
test keeps the two key sets equal). A new kind is a row here and a driver there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StageKind:
    """What a stage kind needs of the config, and what it leaves behind."""

    data_format: str | None = None
    """The data.format the kind reads (the config checks it); None: any SFT-style format."""
    samples: bool = False
    """The kind samples the run's environments (it needs at least one)."""
    exports: bool = True
    """The kind writes new weights to export/ (eval does not: the next stage starts from
    the weights it evaluated)."""
    exports_policy: bool = True
    """What it exports is a policy (a causal LM) the next stage can start from. rm exports a
    reward model (a sequence classifier): a stage after it with init=previous starts from
    the weights the rm stage started from, as after eval."""


STAGES: dict[str, StageKind] = {
    "sft": StageKind(),
    "dpo": StageKind(data_format="preference"),
    "grpo": StageKind(samples=True),
    "eval": StageKind(samples=True, exports=False),
    "rm": StageKind(data_format="preference", exports_policy=False),
}


@dataclass
class StageConfig:
    name: str = "sft"
    """Unique stage name; its files live in <run_dir>/stages/<name>/."""
    kind: str = "sft"
    """Which driver runs it: a kind of ptrain.config.stages.STAGES (sft | dpo | grpo | eval | rm)."""
    init: str = "previous"
    """Starting weights: previous (the preceding stage's export, looking through eval and rm
    stages to the weights they started from; the base model for the first stage) | base (the
    model group's weights) | a local Hugging Face folder path (a causal LM)."""
    train: dict[str, Any] = field(default_factory=dict)
    """Overrides of the top-level `train` node for this stage only."""
    optim: dict[str, Any] = field(default_factory=dict)
    """Overrides of `optim` for this stage only."""
    data: dict[str, Any] = field(default_factory=dict)
    """Overrides of `data` for this stage only."""
    algo: dict[str, Any] = field(default_factory=dict)
    """Overrides of `algo` for this stage only."""
    lora: dict[str, Any] = field(default_factory=dict)
    """Overrides of `model.lora` for this stage only: e.g. {rank: 16} trains adapters in this
    stage over the previous stage's fully trained export (the other stages train every weight)."""
    envs: list[str] = field(default_factory=list)
    """Names of the run's environments (`envs`) this stage samples; empty: all of them."""
    reward_model: str | None = None
    """A grpo stage only: a reward-model folder (a Hugging Face sequence classifier with one
    label that shares the policy's tokenizer, e.g. ${run_dir}/stages/rm/export after a stage of
    kind rm) that scores this stage's episodes in place of the environments' verifiers (RLHF
    against a learned reward; ptrain/envs/reward_model.py). The verifiers' verdicts stay as
    metrics. Read when the stage starts, so an earlier stage of the run may write it."""
