"""MoE decoder: router aux terms, RouterBias kept out of the params, the bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, RouterBias, count_params, update_router_bias

# ragged_dot: at these tiny shapes it compiles several times faster than the tiled "xla"
# path (the MoE parity tests run the default implementation).
CFG = dict(
    family="dots1",
    vocab_size=64,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    n_experts=8,
    top_k=2,
    d_ff_expert=16,
    n_shared_experts=1,
    router="sigmoid",
    n_groups=4,
    topk_groups=2,
    first_k_dense=1,
    routed_scaling_factor=2.5,
    tie_embeddings=False,
    moe_implementation="ragged_dot",
)


@pytest.mark.parametrize("scan", [False, True])
def test_router_aux_and_bias_update(scan):
    model = Decoder(ModelConfig(**CFG, scan_layers=scan), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not any(isinstance(v, RouterBias) for _, v in nnx.to_flat_state(params))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
    fwd = jax.jit(lambda p, r: nnx.merge(graphdef, p, r)(ids, return_aux=True))
    logits, aux = fwd(params, rest)
    assert logits.shape == (2, 8, 64) and aux.expert_load.shape == (2, 8)  # two MoE layers after one dense
    np.testing.assert_allclose(aux.expert_load.sum(-1), 1.0, atol=1e-6)
    assert float(aux.lb_loss) > 0

    rate = 0.01
    new_rest = jax.jit(lambda r, load: update_router_bias(r, load, rate))(rest, aux.expert_load)
    biases = [v[...] for _, v in nnx.to_flat_state(new_rest) if isinstance(v, RouterBias)]
    got = jnp.concatenate([b.reshape(-1, 8) for b in biases])
    want = rate * jnp.sign(aux.expert_load.mean(-1, keepdims=True) - aux.expert_load)
    np.testing.assert_allclose(got, want, atol=1e-7)
    logits2, _ = fwd(params, new_rest)  # the bias changes which experts are chosen
    assert logits2.shape == logits.shape and np.isfinite(np.asarray(logits2)).all()
    with pytest.raises(ValueError, match="expert_load has 3 rows"):
        update_router_bias(rest, jnp.zeros((3, 8)), rate)


def test_padding_does_not_move_the_expert_load():
    """Rows padded at the end (segment id 0) report the load of their real tokens alone: what
    the balancing loss and the bias update of an RL batch read, however long its padding."""
    model = Decoder(ModelConfig(**CFG), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 6)), jnp.int32)
    _, short = model(ids, return_aux=True)
    padded = jnp.concatenate([ids, jnp.zeros((2, 10), jnp.int32)], axis=1)
    seg = (jnp.arange(16) < 6).astype(jnp.int32)[None, :].repeat(2, 0)
    _, aux = model(padded, segment_ids=seg, return_aux=True)
    np.testing.assert_allclose(aux.expert_load, short.expert_load, atol=1e-6)
    np.testing.assert_allclose(float(aux.lb_loss), float(short.lb_loss), rtol=1e-5)


def test_dense_model_has_empty_aux_and_no_router_bias():
    cfg = {
        k: v
        for k, v in CFG.items()
        if k
        not in (
            "n_experts",
            "router",
            "n_shared_experts",
            "n_groups",
            "topk_groups",
            "first_k_dense",
            "routed_scaling_factor",
        )
    }
    model = Decoder(ModelConfig(**{**cfg, "family": "qwen3"}), rngs=nnx.Rngs(0))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    assert update_router_bias(rest, jnp.zeros((0, 0)), 0.01) is rest


# ----------------------------------------------------------------------------- mixed dense/MoE layers


def test_layer_pattern_follows_the_qwen3_moe_rule_and_groups_consecutive_layers():
    from ptrain.models.decoder import layer_groups, moe_layer_flags

    cfg = ModelConfig(**{**CFG, "n_layers": 6, "first_k_dense": 0, "dense_layers": [4], "moe_layer_step": 1})
    assert moe_layer_flags(cfg) == (True, True, True, True, False, True)
    # transformers' Qwen3MoeDecoderLayer: MoE iff i not in mlp_only_layers and (i + 1) % step == 0
    cfg = ModelConfig(**{**CFG, "n_layers": 6, "first_k_dense": 0, "dense_layers": [3], "moe_layer_step": 2})
    assert moe_layer_flags(cfg) == tuple(i not in (3,) and (i + 1) % 2 == 0 for i in range(6))
    groups = layer_groups(cfg)  # D M D D D M
    assert [(g.name, g.cache_key, g.start, g.n) for g in groups] == [
        ("dense_blocks", "dense", 0, 1),
        ("moe_blocks", "moe", 1, 1),
        ("dense_blocks_1", "dense_1", 2, 3),
        ("moe_blocks_1", "moe_1", 5, 1),
    ]
    # the existing layouts keep their groups (and so their parameter paths)
    assert [g.name for g in layer_groups(ModelConfig(**CFG))] == ["dense_blocks", "moe_blocks"]
    dense = ModelConfig(**{**CFG, "n_experts": 0, "dense_layers": [1]})
    assert [(g.name, g.n) for g in layer_groups(dense)] == [("dense_blocks", 3)]
    with pytest.raises(ValueError, match=r"model\.dense_layers=\[3\]"):
        Decoder(ModelConfig(**{**CFG, "dense_layers": [3]}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="moe_layer_step"):
        Decoder(ModelConfig(**{**CFG, "moe_layer_step": 0}), rngs=nnx.Rngs(0))


MIXED = {**CFG, "n_layers": 4, "first_k_dense": 0, "dense_layers": [2]}  # M M D M: two MoE groups


@pytest.mark.parametrize("scan", [False, True])
def test_mixed_layers_decode_with_the_cache_and_update_each_layers_bias(scan):
    from ptrain.models import init_cache
    from ptrain.models.generate import decode_mask

    cfg = ModelConfig(**MIXED, scan_layers=scan)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert set(nnx.state(model).keys()) >= {"moe_blocks", "dense_blocks", "moe_blocks_1"}
    assert sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))) == count_params(cfg)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 7)), jnp.int32)
    S = 8

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        full, aux = m(ids, return_aux=True)
        caches = init_cache(cfg, 2, S)
        assert set(caches) == {"moe", "dense", "moe_1"}
        pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
        pads = jnp.zeros((2,), jnp.int32)
        pre, caches = m.decode_step(ids[:, :6], pos, decode_mask(pads, jnp.arange(6), S, None), caches, 0)
        step, _ = m.decode_step(ids[:, 6:], pos[:, :1] + 6, decode_mask(pads, jnp.arange(6, 7), S, None), caches, 6)
        return full, aux, jnp.concatenate([pre, step], axis=1)

    full, aux, cached = run(state)
    np.testing.assert_allclose(cached, full, atol=2e-5)
    assert aux.expert_load.shape == (3, 8)  # MoE layers 0, 1, 3 in layer order

    # Distinct loads per layer: each layer's bias moves by its own row (layer 3 lives in moe_blocks_1).
    load = jnp.stack([jnp.eye(8)[i] for i in (0, 3, 5)]) * 0.5 + 0.5 / 8
    rest = nnx.split(model, nnx.Param, ...)[2]
    new = nnx.to_flat_state(update_router_bias(rest, load, 0.01))
    by_layer = {}
    for path, v in new:
        if isinstance(v, RouterBias):
            rows = v[...].reshape(-1, 8)
            first = {"moe_blocks": 0, "moe_blocks_1": 3}[path[0]] + (0 if scan else path[1])
            for r, row in enumerate(rows):
                by_layer[first + r] = np.asarray(row)
    assert sorted(by_layer) == [0, 1, 3]
    for row, layer in enumerate((0, 1, 3)):
        want = 0.01 * np.sign(np.asarray(load[row]).mean() - np.asarray(load[row]))
        np.testing.assert_allclose(by_layer[layer], want, atol=1e-7, err_msg=f"layer {layer}")


class _FakeMesh:
    def __init__(self, **shape):
        self.shape = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, **shape}


def test_expert_parallel_plan_follows_the_rules_and_refuses_uneven_splits():
    from ptrain.models.moe import expert_parallel_axis, expert_parallel_plan

    cfg = ModelConfig(**CFG)
    assert expert_parallel_axis(cfg, None) is None
    assert expert_parallel_axis(cfg, _FakeMesh(data=8)) is None  # expert axis of size 1: automatic partitioning
    assert expert_parallel_axis(cfg, _FakeMesh(data=2, expert=4)) == "expert"
    assert expert_parallel_axis(ModelConfig(**{**CFG, "n_experts": 0}), _FakeMesh(expert=4)) is None
    assert expert_parallel_axis(cfg, _FakeMesh(fsdp=4), [("expert", "fsdp")]) == "fsdp"
    plan = expert_parallel_plan(cfg, _FakeMesh(data=2, expert=4))  # default rules: batch over (data, fsdp, expert)
    assert (plan.axis, plan.batch_axes) == ("expert", ("data", "expert"))
    assert expert_parallel_plan(cfg, _FakeMesh(data=8)) is None
    with pytest.raises(ValueError, match=r"n_experts=8 does not split over the 3 devices"):
        expert_parallel_axis(cfg, _FakeMesh(expert=3))
    with pytest.raises(ValueError, match="over one mesh axis"):
        expert_parallel_axis(cfg, _FakeMesh(expert=2, fsdp=2), [("expert", ("expert", "fsdp"))])
