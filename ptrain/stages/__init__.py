"""Stage drivers, one thin loop per kind, found by kind.

The kinds and what they need of the config are `ptrain.config.stages.STAGES`; this
module maps each kind to its driver. A driver's module is imported only when a stage of
that kind runs, so composing and validating a config never loads JAX.

A driver is `run(run: RunConfig, stage_dir: str, init_path: str | None) -> dict`: it
trains the stage from the weights at `init_path` (None: the embedded model), writes its
export and DONE.json into `stage_dir`, and returns the stage summary.
"""

from __future__ import annotations

from collections.abc import Callable

from ptrain.config.stages import STAGES


def _sft() -> Callable[..., dict]:
    from ptrain.stages.sft import run_sft_stage

    return run_sft_stage


def _dpo() -> Callable[..., dict]:
    from ptrain.stages.dpo import run_dpo_stage

    return run_dpo_stage


def _grpo() -> Callable[..., dict]:
    from ptrain.stages.grpo import run_grpo_stage

    return run_grpo_stage


def _eval() -> Callable[..., dict]:
    from ptrain.stages.eval import run_eval_stage

    return run_eval_stage


def _rm() -> Callable[..., dict]:
    from ptrain.stages.rm import run_rm_stage

    return run_rm_stage


DRIVERS: dict[str, Callable[[], Callable[..., dict]]] = {
    "sft": _sft,
    "dpo": _dpo,
    "grpo": _grpo,
    "eval": _eval,
    "rm": _rm,
}
"""Stage kind -> a function that imports and returns its driver."""


def stage_driver(kind: str) -> Callable[..., dict]:
    """The driver function of a stage kind (its module imported now)."""
    if kind not in DRIVERS:
        raise ValueError(f"unknown stage kind '{kind}'; pass one of {', '.join(STAGES)}")
    return DRIVERS[kind]()
