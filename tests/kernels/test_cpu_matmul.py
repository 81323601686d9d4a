"""The CPU packed matmul kernel (ptrain.kernels.cpu.packed_dense) against numpy, the panel
layout, and a model's decode step on packed weights against the same step on arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ptrain.kernels import cpu

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, init_cache, pack_decode_weights
from ptrain.train.state import split_model

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler on this machine")


@pytest.mark.parametrize(
    "M,K,N",
    [
        (16, 64, 96),  # the decode shape family: 16 rows, N a multiple of 16
        (1, 33, 7),  # one row, K odd, N below one panel
        (21, 40, 50),  # a full and a partial row block, a ragged last panel
        (40, 16, 129),  # three row blocks, one column past the panels
        (5, 0, 16),  # K = 0: zeros
    ],
)
def test_packed_dense_matches_numpy(M, K, N):
    r = np.random.default_rng(M * 1000 + K + N)
    x = r.normal(size=(M, K)).astype(np.float32)
    w = r.normal(size=(K, N)).astype(np.float32)
    got = np.asarray(jax.jit(cpu.dense)(jnp.asarray(x), cpu.pack(jnp.asarray(w))))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_leading_axes_of_x_are_kept():
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(3, 2, 24)), jnp.float32)
    w = jnp.asarray(r.normal(size=(24, 40)), jnp.float32)
    got = cpu.dense(x, cpu.pack(w))
    assert got.shape == (3, 2, 40)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


def test_pack_is_panel_major_and_round_trips():
    w = jnp.arange(2 * 5 * 20, dtype=jnp.float32).reshape(2, 5, 20)  # stacked layers, K 5, N 20
    p = cpu.pack(w)
    assert p.panels.shape == (2, 2, 5, 16) and p.n == 20 and p.k == 5
    np.testing.assert_array_equal(np.asarray(p.panels[1, 0, 3]), np.asarray(w[1, 3, :16]))
    np.testing.assert_array_equal(np.asarray(p.panels[1, 1, 3, :4]), np.asarray(w[1, 3, 16:]))
    assert not np.any(np.asarray(p.panels[:, 1, :, 4:]))  # padding columns are zeros
    np.testing.assert_array_equal(np.asarray(cpu.unpack(p)), np.asarray(w))
    assert p[...] is p  # read as an nnx.Param's array is


def test_a_mismatched_weight_is_a_clear_error():
    with pytest.raises(ValueError, match="packed"):
        cpu.dense(jnp.zeros((2, 8)), cpu.pack(jnp.zeros((16, 32))))


TINY = ModelConfig(
    family="qwen3", vocab_size=200, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
    max_seq_len=64, tie_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        dataclasses.replace(TINY, scan_layers=True, qkv_bias=True, qk_norm=False),
        dataclasses.replace(TINY, family="qwen3_moe", n_experts=4, top_k=2, d_ff_expert=16, tie_embeddings=True),
    ],
    ids=["dense", "scanned-bias", "moe-tied"],
)
def test_decode_step_on_packed_weights_matches_arrays(cfg):
    model_def, params, state = split_model(Decoder(cfg, rngs=nnx.Rngs(0)))
    packed = pack_decode_weights(params)
    kinds = {type(x).__name__ for x in jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, cpu.PackedWeight))}
    assert "PackedWeight" in kinds
    if cfg.tie_embeddings:
        assert "lm_head" not in packed  # the tied head stays the embedding's transpose
    B, S = 3, 16
    caches = init_cache(cfg, B, S)
    tok = jnp.asarray([[5], [17], [199]], jnp.int32)
    pos = jnp.asarray([[0], [3], [7]], jnp.int32)
    mask = jnp.arange(S)[None, None, :] <= pos[:, :, None]

    @jax.jit
    def step(p, c):
        return model_def.bind(p, state).decode_step(tok, pos, mask, c, pos[:, 0])

    want, want_caches = step(params, caches)
    got, got_caches = step(packed, caches)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_caches), jax.tree.leaves(want_caches)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_static_generation_on_packed_weights_matches_arrays():
    from ptrain.models.generate import StaticGenerator

    model = Decoder(TINY, rngs=nnx.Rngs(3))
    gen = StaticGenerator(model)
    assert gen._decode_state is not None  # float32 on one CPU device: packed
    prompts = [[1, 2, 3], [4, 5]]
    got = gen(prompts, max_new_tokens=6)
    want = gen(prompts, max_new_tokens=6, state=gen.state)  # packs the passed state per call
    np.testing.assert_array_equal(got.tokens_BxN, want.tokens_BxN)
    # greedy tokens equal the full forward's argmax path, step by step
    ids = list(prompts[0])
    for t in range(6):
        logits = model(jnp.asarray([ids]))
        assert int(got.tokens_BxN[0, t]) == int(jnp.argmax(logits[0, -1]))
        ids.append(int(got.tokens_BxN[0, t]))


def test_sharded_or_bfloat16_weights_are_not_packed():
    assert cpu.packing_applies({"w": jnp.zeros((4, 4), jnp.float32)})
    assert not cpu.packing_applies({"w": jnp.zeros((4, 4), jnp.bfloat16)})
    assert not cpu.packing_applies({})


def test_fused_weights_share_one_buffer_and_split_back():
    r = np.random.default_rng(4)
    a, b = (jnp.asarray(r.normal(size=(24, n)), jnp.float32) for n in (20, 12))
    fused = cpu.pack_fused(a, b)
    assert fused.parts == (20, 12) and fused.n == 32
    x = jnp.asarray(r.normal(size=(3, 24)), jnp.float32)
    ya, yb = fused.split(cpu.dense(x, fused))
    np.testing.assert_allclose(np.asarray(ya), np.asarray(x @ a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(yb), np.asarray(x @ b), rtol=1e-5, atol=1e-5)
    _, params, _ = split_model(Decoder(TINY, rngs=nnx.Rngs(0)))
    attn = pack_decode_weights(params)["dense_blocks"][0]["attn"]
    assert attn["q"] is attn["k"] is attn["v"]  # one copy of q | k | v, read by one call
