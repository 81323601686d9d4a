"""The device mesh (Hydra group `mesh/`): axis sizes and the logical-axis rule table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MeshConfig:
    data: int = -1
    """Data-parallel axis size; -1 takes the devices left over by the other axes."""
    fsdp: int = 1
    """Fully-sharded data-parallel axis: params and optimizer state sharded, batch split."""
    context: int = 1
    """Context-parallel axis: every sequence split along its length (activations and
    attention; model.context_attention says how attention crosses the split)."""
    tensor: int = 1
    """Tensor-parallel axis: heads and MLP hidden split."""
    expert: int = 1
    """Expert-parallel axis: routed experts split (MoE), and the batch split over it as well,
    so outside the MoE blocks it is one more data-parallel axis (the batch must divide over
    data x fsdp x expert)."""
    rules: list[Any] | None = None
    """Logical-axis -> mesh-axis rule table as [[logical, mesh_axis_or_list_or_null], ...];
    None uses ptrain.parallel.DEFAULT_RULES."""
