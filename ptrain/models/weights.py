"""How a layer multiplies by its weights, whatever form they reach it in.

A projection weight reaches a module in one of three forms, and this module is the one place
that tells them apart:

- a plain array (training, prefill, decode off CPU): `x @ W` in the compute dtype;
- a `ptrain.models.lora.LoRAWeight` (adapters): `x W + (x A) B`, the update from lora.py;
- a `ptrain.kernels.cpu.PackedWeight`: the rollout engine's CPU decode layout, made from a
  Decoder's params by `pack_decode_weights` (a second copy beside the trained params). There
  an attention's q, k and v are one fused weight held under `q` (and `k` and `v`), a dense
  MLP's gate and up one under `gate` (and `up`), so a decode step reads each group with one
  kernel call.

The layers call `attention_qkv`, `attention_out`, `gated_mlp` and `logits` and never look at
a weight's form; the training model knows nothing of the decode layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ptrain.kernels import cpu as cpu_kernels
from ptrain.models import lora


def is_packed(w: Any) -> bool:
    """Whether `w` is in the CPU decode layout."""
    return isinstance(w, cpu_kernels.PackedWeight)


def attention_qkv(x_BxTxD: jax.Array, q, k, v, head_dim: int, dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x's queries [B, T, H, Dh], keys and values [B, T, K, Dh], from weights q [D, H, Dh] and
    k, v [D, K, Dh] (or one fused packed weight)."""
    if is_packed(q):
        if len(q.parts) != 3:
            raise ValueError("packed attention weights must hold q, k and v fused (pack_decode_weights)")
        lead = x_BxTxD.shape[:-1]
        return tuple(y.reshape(*lead, -1, head_dim) for y in q.split(cpu_kernels.packed_dense(x_BxTxD, q)))
    return tuple(lora.einsum_weight("bld,dnh->blnh", x_BxTxD, w, dtype) for w in (q, k, v))


def attention_out(out_BxTxHxDh: jax.Array, o, dtype: Any) -> jax.Array:
    """The output projection [B, T, D] of attention outputs, with o [H, Dh, D] (or packed)."""
    # One contraction over H * Dh: written as an einsum over (heads, head_dim), XLA:CPU
    # transposed both the activations and the whole weight to contract them, every call.
    B, T, H, Dh = out_BxTxHxDh.shape
    flat = out_BxTxHxDh.reshape(B, T, H * Dh)
    if is_packed(o):
        return cpu_kernels.packed_dense(flat, o)
    y = flat @ lora.base_of(o).astype(dtype).reshape(H * Dh, -1)
    return lora.add_update(y.astype(out_BxTxHxDh.dtype), out_BxTxHxDh, o)


def gated_mlp(x: jax.Array, gate, up, down, dtype: Any, swiglu) -> jax.Array:
    """down(silu(x W_gate) * (x W_up)). Plain weights go to `swiglu(x, gate, up, down)`, the
    layer's own fused forward and backward; packed ones read gate and up with one kernel call;
    adapters add their update to each projection."""
    if is_packed(gate):
        g, u = gate.split(cpu_kernels.packed_dense(x, gate))
        return cpu_kernels.packed_dense(jax.nn.silu(g) * u, down)
    if any(isinstance(w, lora.LoRAWeight) for w in (gate, up, down)):
        g, u = (lora.add_update(x @ lora.base_of(w).astype(dtype), x, w) for w in (gate, up))
        h = jax.nn.silu(g) * u
        return lora.add_update(h @ lora.base_of(down).astype(dtype), h, down)
    return swiglu(x, gate.astype(dtype), up.astype(dtype), down.astype(dtype))


def logits(h_BxLxD: jax.Array, head, dtype: Any) -> jax.Array:
    """float32 logits [B, L, V] of final-normed hidden states, with the head [D, V] (or packed)."""
    if is_packed(head):
        return cpu_kernels.packed_dense(h_BxLxD, head)
    return jnp.einsum("bld,dv->blv", h_BxLxD.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32)


def pack_decode_weights(params: dict) -> dict:
    """A Decoder's params (`split_model`'s pure dict) with its dense projections as
    `ptrain.kernels.cpu.PackedWeight`s, for `decode_step` on CPU (ptrain/kernels/cpu.py): each
    attention's q, k and v fused into one weight held under `q` (`k` and `v` hold the same
    object, so the step reads the three with one kernel call), its output projection, each
    dense MLP's gate and up fused the same way under `gate` and `up`, its down projection,
    and an untied output head. Norms, embeddings, routers and experts stay arrays. The
    caller keeps the unpacked params for prefill and training; this is a second copy. Call it
    outside jit: a jitted caller would return the shared weights as three buffers."""

    def attn(p: dict) -> dict:
        qkv = cpu_kernels.pack_fused(*(p[n].reshape(*p[n].shape[:-2], -1) for n in ("q", "k", "v")))
        o = p["o"]  # [..., H, Dh, D] -> [..., H * Dh, D]
        return {**p, "q": qkv, "k": qkv, "v": qkv, "o": cpu_kernels.pack(o.reshape(*o.shape[:-3], -1, o.shape[-1]))}

    def mlp(p: dict) -> dict:
        gate_up = cpu_kernels.pack_fused(p["gate"], p["up"])
        return {"gate": gate_up, "up": gate_up, "down": cpu_kernels.pack(p["down"])}

    def walk(node):  # pure dicts all the way down: a layer list is a dict keyed 0, 1, ...
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "attn":
                out[key] = attn(value)
            elif key == "mlp" and set(value) == {"gate", "up", "down"}:
                out[key] = mlp(value)
            elif key == "lm_head":
                out[key] = cpu_kernels.pack(value)
            else:
                out[key] = walk(value)
        return out

    return walk(params)
