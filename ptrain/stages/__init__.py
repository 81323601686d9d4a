"""Stage drivers, one thin loop per kind, and the registry that finds them by kind.

`STAGES` is the one table of stage kinds: the config validates `stages[i].kind` against
its keys (without importing JAX: a driver's module is imported only when a stage of that
kind runs), and the pipeline asks `stage_driver(kind)` for the function that runs it. A
new kind (grpo) is one file under stages/ and one line here.

A driver is `run(run: RunConfig, stage_dir: str, init_path: str | None) -> dict`: it
trains the stage from the weights at `init_path` (None: the embedded model), writes its
export and DONE.json into `stage_dir`, and returns the stage summary.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StageKind:
    """How a stage kind is run, and what its data must look like."""

    driver: str
    """'module:function' of the driver, imported on first use."""
    data_format: str | None = None
    """The data.format the kind reads (the config checks it); None: any SFT-style format."""
    samples: bool = False
    """The kind samples the run's environments (it needs at least one)."""
    exports: bool = True
    """The kind writes new weights to export/ (eval does not: the next stage starts from
    the weights it evaluated)."""


STAGES: dict[str, StageKind] = {
    "sft": StageKind("ptrain.stages.sft:run_sft_stage"),
    "dpo": StageKind("ptrain.stages.dpo:run_dpo_stage", data_format="preference"),
    "grpo": StageKind("ptrain.stages.grpo:run_grpo_stage", samples=True),
    "eval": StageKind("ptrain.stages.eval:run_eval_stage", samples=True, exports=False),
}


def stage_driver(kind: str) -> Callable[..., dict]:
    """The driver function of a stage kind (its module imported now)."""
    if kind not in STAGES:
        raise ValueError(f"unknown stage kind '{kind}'; pass one of {', '.join(STAGES)}")
    module, _, name = STAGES[kind].driver.partition(":")
    return getattr(importlib.import_module(module), name)
