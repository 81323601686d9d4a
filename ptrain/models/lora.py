"""LoRA adapters over a decoder's param tree (Hu et al. 2021), as pure functions.

An adapter pytree mirrors the targeted leaves of the params (`split_model`'s pure dict):
where the base holds W with input axes I and output axes O (plus leading stacked-layer or
expert axes), the adapter holds {"a": [..., *I, r], "b": [..., r, *O]}, and the model
computes with W + scale * A @ B. Training differentiates the adapters only; the base stays
a separate, frozen input of the step.

`attach` puts `LoRAWeight`s where the module reads those weights, and the layers add the
low-rank update to their projection (`einsum_weight`, `add_update`): x W + scale * (x A) B,
never forming W + A B, with dropout on the adapter's input. The routed experts and the
output head read their weight whole (the grouped expert matmul, the chunked vocabulary
loss), so there the update is merged into the weight (`merged`), an extra r/min(I, O) of
that matmul's work. `merge` bakes the adapters into plain weights for the engine and for a
merged export; `ptrain/models/peft_io.py` reads and writes PEFT's adapter folders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ptrain.config.lora import LoRAConfig

PyTree = Any

# Where each target sits in the param tree: the leaf's last path component (and the one
# before it), its number of input axes and of output axes; leading axes are stacked layers
# (scan_layers) or experts.
_ATTENTION = {"q": ("q_proj", 1, 2), "k": ("k_proj", 1, 2), "v": ("v_proj", 1, 2), "o": ("o_proj", 2, 1)}
_MLP = {"gate": ("gate_proj", 1, 1), "up": ("up_proj", 1, 1), "down": ("down_proj", 1, 1)}
_EXPERTS = {"w_gate": ("experts", 1, 1), "w_up": ("experts", 1, 1), "w_down": ("experts", 1, 1)}


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """The static half of an adapter config (hashable: it rides in jit's cache key)."""

    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    @classmethod
    def of(cls, cfg: LoRAConfig) -> LoRASpec:
        return cls(cfg.target_names(), int(cfg.rank), float(cfg.alpha), float(cfg.dropout), bool(cfg.rslora))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def target_of(path: tuple) -> tuple[str, int, int] | None:
    """(target name, input axes, output axes) of the weight at `path` (a tuple of keys), or None."""
    last = path[-1]
    parent = path[-2] if len(path) > 1 else None
    if parent == "attn" and last in _ATTENTION:
        return _ATTENTION[last]
    if parent in ("mlp", "shared") and last in _MLP:
        return _MLP[last]
    if parent == "mlp" and last in _EXPERTS:
        return _EXPERTS[last]
    if path == ("lm_head",):
        return ("lm_head", 1, 1)
    return None


def targeted_paths(params: PyTree, spec: LoRASpec) -> dict[tuple, tuple[int, int]]:
    """{path: (input axes, output axes)} of every weight the spec targets, in tree order."""
    out = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Int8Weight))[0]:
        names = _names(path)
        t = target_of(names)
        if t is not None and t[0] in spec.targets:
            out[names] = t[1:]
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def split_shape(shape: tuple, n_in: int, n_out: int) -> tuple[tuple, tuple, tuple]:
    """(leading, input, output) parts of a weight's shape (or its axis names)."""
    lead = len(shape) - n_in - n_out
    return shape[:lead], shape[lead : lead + n_in], shape[lead + n_in :]


def init_adapters(params: PyTree, spec: LoRASpec, key: jax.Array) -> dict:
    """Fresh adapters for `params`: A uniform in +-1/sqrt(fan_in) (PEFT's kaiming-uniform with
    a = sqrt(5)), B zero, so the adapted model equals the base. float32 whatever the base."""
    paths = targeted_paths(params, spec)
    if not paths:
        raise ValueError(f"model.lora.targets {list(spec.targets)} match no weight of this model")
    out: dict = {}
    for i, (path, (n_in, n_out)) in enumerate(paths.items()):
        lead, ins, outs = split_shape(tuple(_get(params, path).shape), n_in, n_out)
        bound = 1.0 / math.sqrt(math.prod(ins))
        a = jax.random.uniform(jax.random.fold_in(key, i), (*lead, *ins, spec.rank), jnp.float32, -bound, bound)
        _set(out, path, {"a": a, "b": jnp.zeros((*lead, spec.rank, *outs), jnp.float32)})
    return out


def adapter_axes(param_axes: PyTree, adapters: dict, spec: LoRASpec) -> dict:
    """Logical axis names of `adapters`: A keeps the weight's leading and input axes, B its
    leading and output axes; the rank axis is replicated."""
    out: dict = {}
    flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
    for path, _ in flat:
        names = _names(path)
        wpath, which = names[:-1], names[-1]
        if which != "a":
            continue
        axes = tuple(_get(param_axes, wpath))
        _, n_in, n_out = target_of(wpath)
        lead, ins, outs = split_shape(axes, n_in, n_out)
        _set(out, wpath, {"a": (*lead, *ins, None), "b": (*lead, None, *outs)})
    return out


@struct.dataclass
class Int8Weight:
    """A frozen weight stored as int8 with one float32 scale per output channel (symmetric
    absmax: W ~ q * scale), the idea of QLoRA's quantized base (Dettmers et al. 2023) in its
    simplest form. Read through `astype`, like an array, so the layers need not know."""

    q: jax.Array
    scale: jax.Array
    """float32, the weight's shape with every input axis 1."""

    @property
    def shape(self) -> tuple:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    def astype(self, dtype) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_int8(w: jax.Array, n_in: int, n_out: int) -> Int8Weight:
    """Per-output-channel symmetric int8 of a weight [..., *I, *O]: the scale is the largest |w|
    over the input axes / 127, so every channel keeps its own range."""
    axes = tuple(range(w.ndim - n_in - n_out, w.ndim - n_out))
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return Int8Weight(jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale)


def quantize_targets(base: PyTree, spec: LoRASpec) -> PyTree:
    """`base` with every weight the adapters target held as an Int8Weight (the rest unchanged)."""
    out = jax.tree.map(lambda x: x, base)
    for path, (n_in, n_out) in targeted_paths(base, spec).items():
        _set(out, path, quantize_int8(_get(base, path), n_in, n_out))
    return out


@struct.dataclass
class LoRAWeight:
    """A frozen weight and its adapter, where the module reads the weight. `w[...]` returns it
    whole, as an nnx.Param's array does. `key` is the dropout key (PRNG key data, one per
    leading index) or None. With `rows` (serving several adapters at once) A and B hold one
    adapter per slot, [slots, *I, r] and [slots, r, *O], and `rows` [B] names the slot of each
    batch row."""

    base: jax.Array
    a: jax.Array
    b: jax.Array
    key: jax.Array | None
    scale: float = struct.field(pytree_node=False)
    dropout: float = struct.field(pytree_node=False)
    n_in: int = struct.field(pytree_node=False)
    rows: jax.Array | None = None

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("a LoRAWeight is read whole: w[...]")
        return self

    def update(self, x: jax.Array, dtype: Any) -> jax.Array:
        """scale * (dropout(x) A) B for x [..., *I]: shape [..., *O]."""
        ins, rank = self.a.shape[-1 - self.n_in : -1], self.a.shape[-1]
        outs = self.b.shape[self.a.ndim - self.n_in :]  # b is [..., r, *O], a is [..., *I, r]
        n_i, n_o = math.prod(ins), math.prod(outs)
        lead = x.shape[: x.ndim - self.n_in]
        x = x.reshape(*lead, n_i).astype(dtype)
        if self.rows is not None:
            # Row b's tokens use slot rows[b]; a call over flattened tokens [B * L, ...] (an MoE's
            # shared experts) repeats each row's slot over its L tokens.
            rows = jnp.repeat(self.rows, lead[0] // self.rows.shape[0])
            a = self.a.reshape(-1, n_i, rank)[rows].astype(dtype)
            b = self.b.reshape(-1, rank, n_o)[rows].astype(dtype)
            h = jnp.einsum("bmi,bir->bmr", x.reshape(lead[0], -1, n_i), a)
            y = jnp.einsum("bmr,bro->bmo", h, b)
            return (self.scale * y).reshape(*lead, *outs)
        if self.key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(jax.random.wrap_key_data(self.key), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros((), x.dtype))
        h = x @ self.a.reshape(n_i, rank).astype(dtype)
        y = h @ self.b.reshape(rank, n_o).astype(dtype)
        return (self.scale * y).reshape(*lead, *outs)

    def merged(self) -> jax.Array:
        """W + scale * A @ B, float32 (or the base's dtype when wider)."""
        if self.rows is not None:
            raise ValueError("served adapters apply per row; the routed experts and the output head cannot take them")
        return _merge_one(self.base, self.a, self.b, self.scale, self.n_in)


def _merge_one(base, a, b, scale: float, n_in: int) -> jax.Array:
    rank = a.shape[-1]
    lead = a.shape[: a.ndim - 1 - n_in]
    a2 = a.reshape(*lead, -1, rank).astype(jnp.float32)
    b2 = b.reshape(*lead, rank, -1).astype(jnp.float32)
    dtype = jnp.promote_types(base.dtype, jnp.float32)
    return base.astype(dtype) + (scale * (a2 @ b2)).reshape(base.shape).astype(dtype)


def base_of(w):
    """The frozen weight of a LoRAWeight; any other weight as it is."""
    return w.base if isinstance(w, LoRAWeight) else w


def merged(w):
    """A weight the module reads whole: a LoRAWeight's merged weight, any other as it is."""
    return w.merged() if isinstance(w, LoRAWeight) else w


def add_update(y: jax.Array, x: jax.Array, w) -> jax.Array:
    """y (= x W) plus a LoRAWeight's update of x, in y's dtype; y itself for any other weight."""
    if not isinstance(w, LoRAWeight):
        return y
    return y + w.update(x, y.dtype).astype(y.dtype)


def einsum_weight(spec: str, x: jax.Array, w, dtype: Any) -> jax.Array:
    """jnp.einsum(spec, x, W) with W cast to `dtype`, plus the update when w is a LoRAWeight."""
    return add_update(jnp.einsum(spec, x, base_of(w).astype(dtype)), x, w)


def attach(base: PyTree, adapters: dict, spec: LoRASpec, dropout_key: jax.Array | None = None) -> PyTree:
    """The module's param tree: `base` with every adapted weight a LoRAWeight. With
    `dropout_key` (a PRNG key) and spec.dropout > 0, each weight draws its own masks."""
    out = jax.tree.map(lambda x: x, base)  # new dict nodes; the arrays are shared
    flat = [(_names(p)[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
    for i, path in enumerate(dict.fromkeys(flat)):
        ad, w = _get(adapters, path), _get(base, path)
        _, n_in, n_out = target_of(path)
        key = None
        if dropout_key is not None and spec.dropout > 0:
            lead = w.shape[: w.ndim - n_in - n_out]
            keys = jax.random.split(jax.random.fold_in(dropout_key, i), math.prod(lead) or 1)
            key = jax.random.key_data(keys).reshape(*lead, -1)
        _set(out, path, LoRAWeight(w, ad["a"], ad["b"], key, spec.scale, spec.dropout, n_in))
    return out


def merge(base: PyTree, adapters: dict, spec: LoRASpec) -> PyTree:
    """`base` with every adapted weight replaced by W + scale * A @ B (plain arrays)."""
    out = jax.tree.map(lambda x: x, base)
    flat = [(_names(p)[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
    for path in dict.fromkeys(flat):
        ad, w = _get(adapters, path), _get(base, path)
        merged_w = _merge_one(w, ad["a"], ad["b"], spec.scale, target_of(path)[1])
        _set(out, path, merged_w.astype(jnp.promote_types(w.dtype, jnp.float32)))
    return out


# ----------------------------------------------------------------------------- serving slots

SERVABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Targets an engine serves per request: the routed experts and the output head read their
weight whole, so their adapters exist only merged (a merged export)."""


def empty_slots(params: PyTree, targets: tuple[str, ...], n_slots: int, rank: int) -> dict:
    """Zero adapters with `n_slots` slots for every weight of `targets`: A [..., slots, *I, r] and
    B [..., slots, r, *O], the slot axis after the stacked-layer axis. Slot 0 stays zero (the
    base model)."""
    out: dict = {}
    spec = LoRASpec(targets, rank, float(rank))
    for path, (n_in, n_out) in targeted_paths(params, spec).items():
        lead, ins, outs = split_shape(tuple(_get(params, path).shape), n_in, n_out)
        a = jnp.zeros((*lead, n_slots, *ins, rank), jnp.float32)
        _set(out, path, {"a": a, "b": jnp.zeros((*lead, n_slots, rank, *outs), jnp.float32)})
    return out


def write_slot(slots: dict, slot: int, adapters: dict, spec: LoRASpec) -> dict:
    """`slots` with slot `slot` holding `adapters` (scale folded into B, rank zero-padded to the
    slots' rank); weights the adapters do not target get zeros there."""
    out = jax.tree.map(lambda x: x, slots)
    paths = {_names(p)[:-1] for p, _ in jax.tree_util.tree_flatten_with_path(slots)[0]}
    for path in paths:
        pair = _get(slots, path)
        lead = pair["a"].ndim - 2 - target_of(path)[1]
        a = jnp.zeros(pair["a"].shape[:lead] + pair["a"].shape[lead + 1 :], jnp.float32)
        b = jnp.zeros(pair["b"].shape[:lead] + pair["b"].shape[lead + 1 :], jnp.float32)
        try:
            new = _get(adapters, path)
        except KeyError:
            new = None
        if new is not None:
            r = new["a"].shape[-1]
            a = a.at[..., :r].set(jnp.asarray(new["a"], jnp.float32))
            rank_part = (slice(None),) * lead + (slice(0, r),)
            b = b.at[rank_part].set(spec.scale * jnp.asarray(new["b"], jnp.float32))
        index = (slice(None),) * lead + (slot,)
        _set(out, path, {"a": pair["a"].at[index].set(a), "b": pair["b"].at[index].set(b)})
    return out


def attach_slots(base: PyTree, slots: dict, rows: jax.Array) -> PyTree:
    """The module's param tree for a batch whose row b uses adapter slot rows[b] (0: none)."""
    out = jax.tree.map(lambda x: x, base)
    flat = [(_names(p)[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(slots)[0]]
    for path in dict.fromkeys(flat):
        pair, w = _get(slots, path), _get(base, path)
        _, n_in, n_out = target_of(path)
        lead = w.shape[: w.ndim - n_in - n_out]
        r = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (*lead, rows.shape[0]))  # scanned layers slice it too
        _set(out, path, LoRAWeight(w, pair["a"], pair["b"], None, 1.0, 0.0, n_in, r))
    return out


def adapter_bytes(adapters: dict) -> int:
    """Bytes of the adapter arrays (what an optimizer moment and a push of them cost)."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(adapters)))
