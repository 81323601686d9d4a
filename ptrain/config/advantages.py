"""How an RL stage turns rewards into advantages (`algo.grpo.baseline`, `normalize_std`,
`invalid_tool_call_advantage`), as one group.

Why a group: `ptrain.losses.group_advantages` takes `AdvantageConfig` whole (`cfg=`), as
`policy_loss` takes PolicyLossConfig, so a new advantage option is a field here, its check in
`advantage_problems`, and its use in that function, with no keyword list to extend at each call.
`algo.grpo` extends it (GRPOAlgoConfig), so the keys stay `algo.grpo.baseline`, ...; the stage
passes its config whole. The config check reports each problem under `algo.grpo.<field>` before
any compute; the function raises the first as a ValueError.

Numerical details of the standard deviation (eps, ddof) are arguments of the function, not run
options. Reward shaping before the advantages (DAPO's overlong penalty) stays with the rest of
DAPO's data shaping in GRPOAlgoConfig. Formulas and papers: ptrain/losses/advantages.py.

The check method has its own name (not `problems`): GRPOAlgoConfig inherits this group, the
sampling group and PolicyLossConfig together, and a shared method name would resolve to just
one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptrain.config.choices import ADVANTAGE_BASELINES


@dataclass
class AdvantageConfig:
    baseline: str = "mean"
    """Group baseline: mean (GRPO) | leave_one_out (RLOO)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std (GRPO; off in Dr. GRPO)."""
    invalid_tool_call_advantage: float | None = None
    """If set, trajectories with an invalid tool call get this advantage instead of the
    group-relative one (Nemotron 3 uses -5)."""

    def advantage_problems(self) -> list[tuple[str, str]]:
        """Every impossible value, as (field, what is wrong and what to pass). The config check
        reports each under `algo.grpo.<field>`, group_advantages raises the first as a ValueError
        after the field's name; a message reads after either."""
        out: list[tuple[str, str]] = []
        if self.baseline not in ADVANTAGE_BASELINES:
            out.append(("baseline", f"must be one of {', '.join(ADVANTAGE_BASELINES)}, got {self.baseline!r}"))
        value = self.invalid_tool_call_advantage
        if value is not None and not math.isfinite(value):
            out.append(("invalid_tool_call_advantage", f"must be a finite number, got {value}"))
        return out
