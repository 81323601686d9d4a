"""Prints the loss and gradient of one tiny-model SFT objective as JSON; run in a fresh
process so that XLA_FLAGS (set by the caller) takes effect."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain.config import ModelConfig, SFTAlgoConfig
from ptrain.models import Decoder
from ptrain.train.objectives import make_sft_objective
from ptrain.train.state import TrainState, split_model

cfg = ModelConfig(
    vocab_size=128,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    d_ff=128,
    max_seq_len=128,
    qk_norm=True,
    tie_embeddings=False,
)
model_def, params, rest = split_model(Decoder(cfg, rngs=nnx.Rngs(0)))
objective = make_sft_objective(model_def, SFTAlgoConfig())
ids = np.random.default_rng(0).integers(0, 128, (2, 129)).astype(np.int32)
batch = dict(
    input_ids=ids[:, :-1],
    target_ids=ids[:, 1:],
    loss_mask=np.ones((2, 128), np.float32),
    segment_ids=np.ones((2, 128), np.int32),
    positions=np.broadcast_to(np.arange(128, dtype=np.int32), (2, 128)),
)


State = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None, rng=None, model_state=rest)


loss, grads = jax.jit(
    jax.value_and_grad(lambda p: objective(p, State, batch, {"loss": jnp.float32(256), "tokens": jnp.float32(256)})[0])
)(params)
flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
print(json.dumps({"loss": float(loss), "grad": flat[::97].tolist(), "grad_norm": float(np.linalg.norm(flat))}))
