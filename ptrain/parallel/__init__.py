"""Meshes, logical-axis rules and shardings.

Model code names logical axes only (`embed`, `mlp`, `heads`, ...); a rule table here maps
them to mesh axes (`data`, `fsdp`, `tensor`, `expert`). State shardings come from the
abstract state (`jax.eval_shape` of the init) plus the logical names. `multihost` runs one
program as several JAX processes (start-up, process 0 writes, barriers; docs/scaling.md).
"""

from ptrain.parallel.mesh import MESH_AXES, make_mesh, maybe_initialize_distributed
from ptrain.parallel.sharding import (
    BATCH_AXES,
    DEFAULT_RULES,
    batch_devices,
    batch_sharding,
    logical_to_spec,
    replicated,
    shardings_for,
)

__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "batch_devices",
    "batch_sharding",
    "logical_to_spec",
    "make_mesh",
    "maybe_initialize_distributed",
    "replicated",
    "shardings_for",
]
