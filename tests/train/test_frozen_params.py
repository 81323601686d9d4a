"""Frozen parameters (GRPO's algo.grpo.freeze_router): zero updates, weight decay included,
while every other parameter trains."""

import jax
import numpy as np
import pytest

from ptrain.config import OptimConfig
from ptrain.train.optim import frozen_labels, make_optimizer
from ptrain.train.state import split_model
from tests.train.helpers import tiny_model


def test_router_weights_stay_put_and_the_rest_moves():
    model = tiny_model(n_experts=4, top_k=2, d_ff_expert=16, family="qwen3_moe")
    _, params, _ = split_model(model)
    labels = frozen_labels(params, ("router",))
    paths = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(labels)[0]}
    assert any(v == "frozen" for v in paths.values()) and all(
        ("router" in k) == (v == "frozen") for k, v in paths.items()
    )
    tx, _ = make_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1), 10, frozen=("router",))
    state = tx.init(params)
    grads = jax.tree.map(lambda x: np.ones_like(x), params)
    updates, _ = tx.update(grads, state, params)
    for (path, u), (_, label) in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                                     jax.tree_util.tree_flatten_with_path(labels)[0]):  # fmt: skip
        moved = float(np.abs(np.asarray(u)).max())
        assert (moved == 0.0) == (label == "frozen"), jax.tree_util.keystr(path)


def test_freezing_the_router_of_a_dense_model_is_a_config_error():
    from ptrain.config import ConfigError
    from ptrain.stages.setup import _check_frozen_names

    _check_frozen_names(tiny_model(n_experts=4, top_k=2, d_ff_expert=16, family="qwen3_moe"), ("router",), "grpo")
    with pytest.raises(ConfigError, match=r"algo\.grpo\.freeze_router: the grpo stage's model has no 'router' "
                       r"parameters \(qwen3, dense\).*set algo\.grpo\.freeze_router=false"):  # fmt: skip
        _check_frozen_names(tiny_model(), ("router",), "grpo")
