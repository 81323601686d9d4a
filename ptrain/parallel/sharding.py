"""Logical-axis rules -> PartitionSpecs -> NamedShardings for state and batches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ptrain.config.choices import BATCH_AXES

# Logical axis -> mesh axes, tried in order. Params are sharded over fsdp on their
# embedding dimension (ZeRO-3 style) and over tensor on heads / MLP hidden; experts over
# the expert axis. Activations' batch axis spans data, fsdp and expert, their sequence
# (`length`) axis the context axis: outside the MoE blocks the expert axis is one more
# data-parallel axis (as in MaxText), so attention is not computed E times over, and the
# MoE block's all-to-all starts from tokens already split over the expert axis.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("length", "context"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("expert", "expert"),
    ("layers", None),
    ("norm", None),
)


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def rule_axes(rules: Sequence[tuple[str, Any]] | None, logical: str) -> tuple[str, ...]:
    """Mesh axes the first rule for `logical` names (rules None: DEFAULT_RULES)."""
    for name, mesh_axes in rules or DEFAULT_RULES:
        if name == logical:
            return _as_tuple(mesh_axes)
    return ()


def split_axes(mesh: Mesh, rules: Sequence[tuple[str, Any]] | None, logical: str) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the rules put `logical` on."""
    return tuple(a for a in rule_axes(rules, logical) if a in mesh.shape and mesh.shape[a] > 1)


def sole_split_axis(mesh: Mesh, rules: Sequence[tuple[str, Any]] | None, logical: str, why: str) -> str | None:
    """The one mesh axis of size > 1 holding `logical`, or None; ValueError (saying `why` one
    axis is needed, and the fix) when the rules spread it over several."""
    axes = split_axes(mesh, rules, logical)
    if len(axes) > 1:
        raise ValueError(
            f"mesh.rules map the logical '{logical}' axis to the mesh axes {list(axes)}, all larger than 1; {why}: "
            f"map '{logical}' to one of them"
        )
    return axes[0] if axes else None


def logical_to_spec(
    names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Sequence[tuple[str, Any]] = DEFAULT_RULES
) -> P:
    """Map one array's logical axis names to a PartitionSpec.

    A mesh axis is used at most once per array, and only where it divides the
    dimension; otherwise that dimension stays replicated (small models on big meshes
    still run, just with less sharding).
    """
    table = {}
    for logical, mesh_axes in rules:
        table.setdefault(logical, _as_tuple(mesh_axes))
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        axes = []
        size = 1
        for ax in table.get(name, ()) if name else ():
            n = mesh.shape[ax]
            if ax in used or n == 1 or dim % (size * n):
                continue
            axes.append(ax)
            size *= n
        used.update(axes)
        out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*out)


def shardings_for(abstract_tree, logical_tree, mesh: Mesh, rules: Sequence[tuple[str, Any]] = DEFAULT_RULES):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs given matching logical names.

    `logical_tree` mirrors `abstract_tree` with a tuple of names (or None) per leaf;
    leaves it lacks (scalars, optimizer counters) are replicated.
    """

    def one(x, names):
        shape = getattr(x, "shape", ())
        if not names or len(names) != len(shape):
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))

    return jax.tree.map(one, abstract_tree, logical_tree, is_leaf=lambda n: n is None)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp x expert; the rest replicated."""
    return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.shape)))


def batch_devices(mesh: Mesh) -> int:
    """How many ways `batch_sharding` splits a batch's rows (data x fsdp x expert): what a row
    count must be a multiple of."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def shardings_following_params(tree, abstract_params, param_shardings, mesh: Mesh):
    """Shardings for a tree whose array leaves mirror params (optimizer moments, grads).

    A leaf takes the sharding of the parameter whose key path is a suffix of its own
    path and whose shape matches (Adam's mu/nu); everything else (step counters,
    factored Adafactor rows) is replicated.
    """
    shapes = jax.tree.map(lambda x: tuple(x.shape), abstract_params)
    by_path = {}
    flat_s = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    flat_shape = jax.tree.leaves(shapes, is_leaf=lambda n: isinstance(n, tuple))
    for (path, s), shape in zip(flat_s, flat_shape):
        by_path[tuple(path)] = (s, shape)

    def one(path, x):
        path = tuple(path)
        for k in range(len(path)):
            hit = by_path.get(path[k:])
            if hit is not None and hit[1] == tuple(getattr(x, "shape", ())):
                return hit[0]
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, tree)
