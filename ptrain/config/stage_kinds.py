"""The stage kinds a recipe may name, and what each needs of the config (no JAX, no drivers).

The config validates `stages[i].kind` against this table and checks each stage's data and
environments by it; `ptrain.stages` maps the same kinds to the drivers that run them (a
test keeps the two key sets equal). A new kind is a row here and a driver there.
"""

from __future__ import annotations

from dataclasses import dataclass


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


STAGES: dict[str, StageKind] = {
    "sft": StageKind(),
    "dpo": StageKind(data_format="preference"),
    "grpo": StageKind(samples=True),
    "eval": StageKind(samples=True, exports=False),
}
