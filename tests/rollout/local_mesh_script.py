"""Run by test_local.py with 8 host devices: LocalEngine on a (data 4, tensor 2) mesh gives the
single-device greedy tokens and log-probs, with weights and KV cache really split."""

import sys

import jax
import numpy as np
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, save_hf
from ptrain.rollout.local import LocalEngine
from ptrain.rollout.protocol import GenerateRequest, SamplingParams

assert jax.device_count() == 8, jax.devices()
cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=64)
path = sys.argv[1]
save_hf(Decoder(cfg, rngs=nnx.Rngs(3)), path)
rng = np.random.default_rng(0)
reqs = [
    GenerateRequest(tuple(rng.integers(1, 60, 5 + i).tolist()), SamplingParams(max_new_tokens=8, temperature=0.0))
    for i in range(6)
]
sampled = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=8, temperature=1.0, n=2, sampling_seed=4))
results = []
for tp in (1, 2):
    with LocalEngine.from_hf(path, tp_size=tp, max_running_requests=8, context_length=48) as eng:
        if tp == 2:
            specs = {str(x.sharding.spec) for x in jax.tree.leaves(eng._params)}
            assert any("tensor" in s for s in specs), specs
            assert any("tensor" in str(x.sharding.spec) for x in jax.tree.leaves(eng._caches))
        results.append(eng.generate_many(reqs + [sampled]))
one, split = results
for a, b in zip(one, split):
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids, (x.output_ids, y.output_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
print("ok mesh")
