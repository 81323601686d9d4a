"""Train steps under LoRA: only the adapters move and only they have optimizer state; the base
is bit-for-bit untouched and is the DPO reference (policy == reference at step 0 gives log 2)."""

import jax
import numpy as np
import pytest

from ptrain.config import DataConfig, DPOAlgoConfig, GeneratedTaskConfig, OptimConfig
from ptrain.config.lora import LoRAConfig
from ptrain.data.preference import make_preference_pass
from ptrain.data.tokenizer import build_tokenizer
from ptrain.models.lora import LoRASpec, adapter_bytes, init_adapters
from ptrain.train.objectives import dpo_denominator, make_dpo_objective
from ptrain.train.optim import make_optimizer
from ptrain.train.state import init_train_state, split_model
from ptrain.train.step import make_train_step
from tests.train.helpers import tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    cfg = DataConfig(format="preference", generated=GeneratedTaskConfig(n_train=16, n_eval=4))
    batch = next(iter(make_preference_pass(cfg, tok, batch_size=8, seq_len=128)))
    model_def, params, rest = split_model(tiny_model(vocab_size=len(tok), max_seq_len=256))
    spec = LoRASpec.of(LoRAConfig(rank=4, alpha=8.0, dropout=0.1))
    adapters = init_adapters(params, spec, jax.random.key(0))
    return model_def, params, rest, batch, spec, adapters


def _lora_state(params, rest, spec, adapters, tx):
    return init_train_state(adapters, tx, seed=0, model_state=rest).replace(base_params=params, lora=spec)


def test_the_base_is_the_reference(setup):
    model_def, params, rest, batch, spec, adapters = setup
    obj = make_dpo_objective(model_def, DPOAlgoConfig(kind="sigmoid", beta=0.1))
    tx, _ = make_optimizer(OptimConfig(), 10)
    no_dropout = LoRASpec(spec.targets, spec.rank, spec.alpha)  # dropout would make the policy differ
    state = _lora_state(params, rest, no_dropout, adapters, tx)
    loss, m = obj(adapters, state, batch, dpo_denominator(batch))
    assert float(loss) == pytest.approx(np.log(2.0), rel=1e-6)
    assert float(m["margin"]) == pytest.approx(0.0, abs=1e-6)


def test_steps_move_only_the_adapters(setup):
    model_def, params, rest, batch, spec, adapters = setup
    tx, lr = make_optimizer(OptimConfig(lr=1e-2, schedule="constant"), 10)
    step = jax.jit(make_train_step(make_dpo_objective(model_def, DPOAlgoConfig(kind="sigmoid", beta=0.5)),
                                   dpo_denominator, tx, lr))  # fmt: skip
    state = _lora_state(params, rest, spec, adapters, tx)
    before = jax.tree.map(np.asarray, params)
    for _ in range(2):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < np.log(2.0)  # the adapted policy moved towards the chosen answers
    for got, want in zip(jax.tree.leaves(state.base_params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert all(float(np.max(np.abs(np.asarray(b)))) > 0 for b in jax.tree.leaves(state.params))  # B left zero
    # optimizer state: two Adam moments of the adapters, nothing the size of a base weight
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size * x.dtype.itemsize for x in moments) == 2 * adapter_bytes(adapters)
    assert adapter_bytes(adapters) < sum(x.size * 4 for x in jax.tree.leaves(params)) / 5
