"""Decoder forward: shapes, masking (causal, packed segments, padding), numerics, remat/scan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, count_params, flops_per_token, load_hf, save_hf

TINY = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    max_seq_len=64,
    tie_embeddings=False,
)
LOGICAL = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "expert", None}


@pytest.fixture(scope="module")
def model():
    return Decoder(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def fwd(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def f(params, ids, pos, seg):
        return nnx.merge(graphdef, params, rest)(ids, pos, seg)

    return lambda ids, pos, seg: f(params, ids, pos, seg)


def jit_apply(model, fn):
    """jit(fn(model, *args)) over the model's state, so tests run compiled, not op by op."""
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))
    return lambda *a: f(state, *a)


def _ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(1, TINY.vocab_size, shape), jnp.int32)


def _default_pos_seg(B, L):
    return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)), jnp.ones((B, L), jnp.int32)


def test_shapes_dtype_and_logical_axes(model):
    ids = _ids(0, (2, 12))
    logits, aux = jit_apply(model, lambda m, x: m(x, return_aux=True))(ids)
    assert logits.shape == (2, 12, TINY.vocab_size) and logits.dtype == jnp.float32
    assert aux.lb_loss.shape == () and aux.expert_load.shape == (0, 0)
    params = nnx.state(model, nnx.Param)
    n = 0
    for path, var in nnx.to_flat_state(params):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var[...].ndim, path
        assert set(names) <= LOGICAL, (path, names)
        assert var[...].dtype == jnp.float32
        n += var[...].size
    assert n == count_params(TINY)


def test_causal_future_tokens_do_not_leak(fwd):
    ids = _ids(1, (1, 12))
    pos, seg = _default_pos_seg(1, 12)
    a = fwd(ids, pos, seg)
    b = fwd(ids.at[0, 8:].set(3), pos, seg)
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not np.allclose(a[:, 8:], b[:, 8:])


def test_packed_equals_unpacked_and_padding_is_finite(fwd):
    doc1, doc2 = _ids(2, (1, 5)), _ids(3, (1, 4))
    packed = jnp.concatenate([doc1, doc2, jnp.zeros((1, 3), jnp.int32)], axis=1)  # 5 + 4 + 3 padding = 12
    seg = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3], jnp.int32)
    pos = jnp.asarray([list(range(5)) + list(range(4)) + list(range(3))], jnp.int32)
    out = fwd(packed, pos, seg)
    pad = lambda d: jnp.concatenate([d, jnp.zeros((1, 12 - d.shape[1]), jnp.int32)], axis=1)
    p12, s12 = _default_pos_seg(1, 12)
    alone1 = fwd(pad(doc1), p12, s12)[:, :5]
    alone2 = fwd(pad(doc2), p12, s12)[:, :4]
    np.testing.assert_allclose(out[:, :5], alone1, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:9], alone2, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_bfloat16_compute_gives_float32_logits_close_to_float32(model):
    ids = _ids(4, (2, 12))
    bf = Decoder(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(bf, nnx.state(model, nnx.Param))
    call = lambda m, x: m(x)
    a, b = jit_apply(model, call)(ids), jit_apply(bf, call)(ids)
    assert b.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - b))) < 0.05 * float(jnp.max(jnp.abs(a)))


def test_scan_and_remat_match_the_layer_loop(model, tmp_path):
    """Same weights via save_hf -> load_hf(scan_layers=True, remat=full): same logits and grads."""
    save_hf(model, str(tmp_path))
    scanned = load_hf(str(tmp_path), scan_layers=True, remat="full")
    ids = _ids(5, (2, 12))
    call = lambda m, x: m(x)
    np.testing.assert_allclose(jit_apply(model, call)(ids), jit_apply(scanned, call)(ids), atol=1e-5)

    def grads(m):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        loss = lambda p, x: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p, rest)(x))[..., 0])
        return jax.jit(jax.grad(loss))(params, ids)

    g_loop, g_scan = grads(model), grads(scanned)
    np.testing.assert_allclose(g_loop["embed"][...], g_scan["embed"][...], atol=1e-6)
    np.testing.assert_allclose(
        g_loop["dense_blocks"][1]["mlp"]["up"][...], g_scan["dense_blocks"]["mlp"]["up"][...][1], atol=1e-6
    )


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    D, H, K, Dh, F, V, L = 32, 4, 2, 8, 48, 64, 2
    per_layer = D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F
    expected = 6 * (L * per_layer + V * D) + 12 * L * H * Dh * 128
    assert flops_per_token(cfg, 128) == expected


def test_bad_config_is_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="n_kv_heads"):
        Decoder(dataclasses.replace(TINY, n_kv_heads=3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size"):
        Decoder(dataclasses.replace(TINY, vocab_size=0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("window", [None, 40])
def test_blocked_causal_attention_equals_the_full_masked_softmax(window):
    """L = 150 spans three query blocks of 64, with packed segments and a sliding window."""
    from ptrain.models.layers import attend, attention_mask, causal_attend

    B, L, H, K, Dh = 2, 150, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, L, H, Dh))
    k = jax.random.normal(ks[1], (B, L, K, Dh))
    v = jax.random.normal(ks[2], (B, L, K, Dh))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], [50, 40, 45, 15], axis=1), jnp.int32)
    mask = attention_mask(seg, window)
    full = jax.jit(attend)(q, k, v, mask)
    blocked = jax.jit(causal_attend, static_argnums=(4,))(q, k, v, mask, window)
    np.testing.assert_allclose(blocked, full, atol=1e-5)

    # The blocked attention has a hand-written backward pass; autodiff of `attend` is the
    # reference for all three input gradients.
    dout = jax.random.normal(jax.random.key(1), q.shape)

    def grads(fn):
        return jax.jit(lambda q, k, v: jax.vjp(lambda *a: fn(*a), q, k, v)[1](dout))(q, k, v)

    want = grads(lambda q, k, v: attend(q, k, v, mask))
    got = grads(lambda q, k, v: causal_attend(q, k, v, mask, window))
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")

    # bfloat16 compute: the same gradients within bfloat16 resolution, in bfloat16.
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got16 = jax.jit(
        lambda q, k, v: jax.vjp(lambda *a: causal_attend(*a, mask, window), q, k, v)[1](dout.astype(jnp.bfloat16))
    )(*bf)
    for name, g, w in zip("qkv", got16, want):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=5e-2, rtol=5e-2, err_msg=f"bf16 d{name}")


def test_attention_against_the_head_major_cache_equals_attend():
    """Decode and prefill chunks (T = 1 and 5 queries) against a [B, K, S, Dh] cache."""
    from ptrain.models.layers import attend, attend_cached

    B, S, H, K, Dh = 3, 24, 4, 2, 8
    ks = jax.random.split(jax.random.key(2), 3)
    k = jax.random.normal(ks[1], (B, S, K, Dh))
    v = jax.random.normal(ks[2], (B, S, K, Dh))
    for T in (1, 5):
        q = jax.random.normal(ks[0], (B, T, H, Dh))
        slots = jnp.asarray([[3], [10], [S - T]]) + jnp.arange(T)[None, :]
        mask = jnp.arange(S)[None, None, :] <= slots[:, :, None]
        want = attend(q, k, v, mask)
        got = attend_cached(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"T={T}")


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_backward_matches_autodiff(dtype, tol):
    """The MLP's hand-written backward pass against autodiff of the same formula."""
    from ptrain.models.layers import swiglu

    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (2, 7, 16)).astype(dtype)
    wg = (0.3 * jax.random.normal(ks[1], (16, 24))).astype(dtype)
    wu = (0.3 * jax.random.normal(ks[2], (16, 24))).astype(dtype)
    wd = (0.3 * jax.random.normal(ks[3], (24, 16))).astype(dtype)
    dy = jax.random.normal(ks[4], (2, 7, 16)).astype(dtype)

    def plain(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    def grads(fn):
        y, vjp = jax.vjp(fn, x, wg, wu, wd)
        return (y, *vjp(dy))

    for name, got, want in zip(["y", "dx", "dw_gate", "dw_up", "dw_down"], grads(swiglu), grads(plain)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol, err_msg=name
        )
