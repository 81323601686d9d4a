"""`shard_map` on every jax ptrain supports: `jax.shard_map` since jax 0.7, the experimental
module before it. Shared by the expert-parallel MoE dispatch and context-parallel attention."""

from __future__ import annotations

import jax


def shard_map(fn, mesh, in_specs, out_specs):
    """fn mapped over the shards of `mesh` (manual axes: every axis of the mesh)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as experimental  # jax < 0.7

    return experimental(fn, mesh, in_specs=in_specs, out_specs=out_specs)
