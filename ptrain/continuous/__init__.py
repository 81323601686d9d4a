"""Continuous post-training: environments keep arriving, the model keeps improving, nothing
regresses, and every round's cost is on the leaderboard (ptrain/continuous/loop.py).

    python -m ptrain recipe=continuous continuous.inbox=INBOX run_dir=R
    python -m ptrain.continuous rollback R          # the previous champion again, pushed

    import ptrain
    result = ptrain.continuous("continuous", inbox="inbox/", run_dir="runs/c", max_rounds=2)
    ptrain.continuous.rollback("runs/c")

This module is callable: `ptrain.continuous(...)` is `ptrain.continuous.run(...)`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptrain.config import RunConfig
    from ptrain.continuous.loop import LoopResult

__all__ = ["rerun", "rollback", "run", "run_config"]


def run(
    recipe_or_config: str | RunConfig = "continuous",
    overrides: Sequence[str] = (),
    *,
    inbox: str | None = None,
    run_dir: str | None = None,
    max_rounds: int | None = None,
    until_idle: bool | None = None,
    **values: Any,
) -> LoopResult:
    """Run the continuous loop of a recipe (by name) or of a RunConfig, in this process, as
    `python -m ptrain recipe=... continuous.inbox=...` does. `inbox`, `max_rounds` and
    `until_idle` set those continuous.* keys; `values` are overrides as nested mappings
    (`algo={"grpo": {"group_size": 4}}`). Returns the rounds this call decided."""
    from ptrain.api import as_config, dotted_overrides

    extra = {"continuous": {"enabled": True}}
    for key, value in (("inbox", inbox), ("max_rounds", max_rounds), ("until_idle", until_idle)):
        if value is not None:
            extra["continuous"][key] = value
    cfg = as_config(recipe_or_config, [*overrides, *dotted_overrides(values), *dotted_overrides(extra)], run_dir)
    return run_config(cfg)


def run_config(cfg: RunConfig) -> LoopResult:
    """The loop of a composed RunConfig (continuous.enabled), in this process."""
    from ptrain.continuous.loop import run_loop
    from ptrain.runtime import tune_xla_cpu

    # Takes effect only if no JAX backend has started in this process yet.
    tune_xla_cpu(compute_dtype=cfg.model.dtype, moe=cfg.model.is_moe)
    return run_loop(cfg)


def rollback(run_dir: str, *, push: bool = True, urls: list[str] | None = None) -> str:
    """Make the champion before the current one current again (R/champion, the loop's state)
    and, with `push`, push it to `urls` (default: the continuous.serve_urls of the run's last
    launch). Returns its folder."""
    from ptrain.continuous.loop import rollback as _rollback

    return _rollback(run_dir, push=push, urls=urls)


def rerun(run_dir: str, round_index: int, out_dir: str) -> str:
    """Run round `round_index` of a continuous run again into `out_dir`, from its saved config
    (the same champion, environments, seeds): the round's manifest is enough to repeat it."""
    from ptrain.continuous.loop import rerun as _rerun

    return _rerun(run_dir, round_index, out_dir)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> LoopResult:
        return run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
