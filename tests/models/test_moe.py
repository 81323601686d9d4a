"""MoE decoder: router aux terms, RouterBias kept out of the params, the bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, RouterBias, update_router_bias

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
