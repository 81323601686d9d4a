"""LoRA adapters over the decoder (ptrain/models/lora.py) and their config group.

The adapted model at initialisation is the base model; the layers' unmerged update
(x W + (x A) B) equals the merged weight's (W + A B) for dense, scanned and MoE models (routed
experts and an untied head included); dropout draws masks only when given a key; the
gradient reaches every adapter; bad settings are refused naming the key.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config import ConfigError
from ptrain.config.lora import LoRAConfig
from ptrain.config.model import ModelConfig
from ptrain.models import Decoder
from ptrain.models.lora import LoRASpec, adapter_axes, attach, init_adapters, merge
from ptrain.train.state import logical_axes, split_model

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=32)
MOE = dict(n_experts=4, top_k=2, d_ff_expert=16, n_shared_experts=1, tie_embeddings=False)
IDS = jnp.arange(16).reshape(2, 8) % 64

MODELS = {
    "dense": (dict(), ["all-linear"]),
    "scanned": (dict(scan_layers=True), ["attention", "down_proj"]),
    "moe": (MOE, ["all-linear", "experts", "lm_head"]),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    kw, targets = MODELS[request.param]
    m = Decoder(ModelConfig(**SMALL, **kw), rngs=nnx.Rngs(0))
    model_def, params, model_state = split_model(m)
    spec = LoRASpec.of(LoRAConfig(rank=4, alpha=8.0, targets=targets, dropout=0.25))
    return m, model_def, params, model_state, spec


def _logits(model_def, params, model_state):
    return model_def.bind(params, model_state)(IDS)


def _perturbed(adapters, scale=0.05):
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_fresh_adapters_leave_the_model_unchanged(model):
    _, model_def, params, model_state, spec = model
    adapters = init_adapters(params, spec, jax.random.key(0))
    pairs = jax.tree.leaves(adapters, is_leaf=lambda n: isinstance(n, dict) and "a" in n)
    assert pairs and all(np.all(np.asarray(p["b"]) == 0) for p in pairs)
    # A is uniform in +-1/sqrt(fan_in); the smallest fan-in here is an expert's d_ff_expert (16)
    assert all(0 < np.max(np.abs(np.asarray(p["a"]))) <= 0.25 for p in pairs)
    base = _logits(model_def, params, model_state)
    np.testing.assert_allclose(_logits(model_def, attach(params, adapters, spec), model_state), base, atol=1e-6)
    np.testing.assert_allclose(_logits(model_def, merge(params, adapters, spec), model_state), base, atol=1e-6)


def test_unmerged_update_equals_the_merged_weight(model):
    _, model_def, params, model_state, spec = model
    adapters = _perturbed(init_adapters(params, spec, jax.random.key(0)))
    unmerged = _logits(model_def, attach(params, adapters, spec), model_state)
    merged = _logits(model_def, merge(params, adapters, spec), model_state)
    assert float(jnp.max(jnp.abs(unmerged - _logits(model_def, params, model_state)))) > 1e-2
    np.testing.assert_allclose(unmerged, merged, atol=2e-5)


def test_every_adapter_gets_a_gradient_and_dropout_needs_a_key(model):
    _, model_def, params, model_state, spec = model
    adapters = _perturbed(init_adapters(params, spec, jax.random.key(0)))

    def loss(a, key=None):
        return jnp.mean(_logits(model_def, attach(params, a, spec, key), model_state) ** 2)

    grads = jax.grad(loss)(adapters)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))
    no_key = loss(adapters)
    assert float(loss(adapters, None)) == float(no_key)  # no key: no dropout (evaluation)
    k1, k2 = loss(adapters, jax.random.key(1)), loss(adapters, jax.random.key(2))
    assert float(k1) != float(no_key) and float(k1) != float(k2)


def test_adapter_axes_follow_the_weights(model):
    m, _, params, _, spec = model
    adapters = init_adapters(params, spec, jax.random.key(0))
    axes = adapter_axes(logical_axes(m)[0], adapters, spec)
    is_pair = lambda n: isinstance(n, dict) and "a" in n  # noqa: E731
    for pair, names in zip(jax.tree.leaves(adapters, is_leaf=is_pair), jax.tree.leaves(axes, is_leaf=is_pair)):
        assert len(names["a"]) == pair["a"].ndim and names["a"][-1] is None  # the rank axis is replicated
        assert len(names["b"]) == pair["b"].ndim and None in names["b"]
        assert "embed" in names["a"] + names["b"]  # every targeted weight has a model axis on one side


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout"),
        (["model.lora.rank=4", "model.lora.targets=[q,mlp]"], r"model.lora.targets.*\['q'\]"),
        (["model.lora.rank=4", "model.lora.targets=[lm_head]"], "tie_embeddings"),
        (["model.lora.rank=4", "model.lora.targets=[experts]"], "dense"),
        (["model.lora.rank=4", "model.lora.base_dtype=int4"], "model.lora.base_dtype"),
    ],
)
def test_bad_lora_settings_are_refused_by_key(overrides, match):
    import ptrain

    with pytest.raises(ConfigError, match=match):
        ptrain.compose("sft_arithmetic", overrides)


def test_int8_base_keeps_each_channel_and_takes_a_quarter_of_the_bytes(model):
    from ptrain.models.lora import Int8Weight, quantize_targets
    from ptrain.stages.setup import frozen_base

    _, model_def, params, model_state, spec = model
    q = quantize_targets(params, spec)
    is_q = lambda x: isinstance(x, Int8Weight)  # noqa: E731
    quantized = [w for w in jax.tree.leaves(q, is_leaf=is_q) if is_q(w)]
    assert quantized and all(w.q.dtype == jnp.int8 for w in quantized)
    for w, orig in zip(
        quantized, [x for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(q, is_leaf=is_q)) if is_q(y)]
    ):
        assert w.q.size == orig.size  # one byte a weight, a float per output channel beside
        err = np.abs(np.asarray(w.astype(jnp.float32)) - np.asarray(orig))
        assert np.all(err <= np.asarray(w.scale) / 2 + 1e-7)  # rounding error: half a step of its channel
    adapters = _perturbed(init_adapters(params, spec, jax.random.key(0)))
    full = _logits(model_def, attach(params, adapters, spec), model_state)
    base = frozen_base(params, spec, "int8")
    low = _logits(model_def, attach(base, adapters, spec), model_state)
    assert float(jnp.max(jnp.abs(low - full))) < 0.05 * float(jnp.max(jnp.abs(full)))
    np.testing.assert_allclose(_logits(model_def, merge(base, adapters, spec), model_state), low, atol=2e-3)
