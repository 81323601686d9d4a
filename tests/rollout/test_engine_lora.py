"""LocalEngine serving LoRA adapters: a sample's tokens and log-probs under an adapter are those
of the merged model; requests for different adapters (and the base) share decode steps with
the same results as alone; a PEFT folder loads; loading is adapter-sized and the base stays;
mismatched adapters and bad requests are refused naming the problem."""

import jax
import numpy as np
import pytest
from flax import nnx

from ptrain.config.lora import LoRAConfig
from ptrain.config.model import ModelConfig
from ptrain.models import Decoder
from ptrain.models.lora import LoRASpec, init_adapters, merge
from ptrain.models.peft_io import save_peft
from ptrain.rollout.local import LocalEngine, LoRAError
from ptrain.rollout.protocol import GenerateRequest, RequestError, SamplingParams
from ptrain.train.state import split_model

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=128)
PROMPTS = [[5, 9, 2, 44, 17], [3, 3, 8, 1], [60, 12, 7, 7, 7, 30]]


def _adapters(params, spec, seed):
    ad = init_adapters(params, spec, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def setup():
    model = Decoder(CFG, rngs=nnx.Rngs(3))
    _, params, _ = split_model(model)
    spec_a = LoRASpec.of(LoRAConfig(rank=4, alpha=8.0, targets=["all-linear"]))
    spec_b = LoRASpec.of(LoRAConfig(rank=2, alpha=2.0, targets=["q_proj", "v_proj", "down_proj"]))
    ad_a, ad_b = _adapters(params, spec_a, 1), _adapters(params, spec_b, 2)
    eng = LocalEngine(model, max_running_requests=8, context_length=64, decode_steps=4, max_loras=2, max_lora_rank=8)
    yield model, params, eng, (ad_a, spec_a), (ad_b, spec_b)
    eng.close()


def _greedy(engine, prompt, lora=None, n_new=8):
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=n_new, temperature=0.0), lora_path=lora)
    return engine.submit(req)


def _merged_engine(model, params, adapters, spec):
    m = Decoder(CFG, rngs=nnx.Rngs(0))  # a module of its own: updating it must not touch `model`
    state = nnx.state(m, nnx.Param)
    nnx.replace_by_pure_dict(state, merge(params, adapters, spec))
    nnx.update(m, state)
    return LocalEngine(m, max_running_requests=8, context_length=64, decode_steps=4)


def test_mixed_adapter_batch_matches_the_merged_models(setup):
    model, params, eng, (ad_a, spec_a), (ad_b, spec_b) = setup
    assert eng.load_lora("a", adapters=ad_a, spec=spec_a) == 1
    assert eng.load_lora("b", adapters=ad_b, spec=spec_b) == 2
    assert set(eng.loras()) == {"a", "b"} and eng.info()["loras"]["b"]["rank"] == 2
    futures = [(lora, p, _greedy(eng, p, lora)) for p in PROMPTS for lora in (None, "a", "b")]  # one batch
    got = {(lora, tuple(p)): f.result()[0] for lora, p, f in futures}
    for lora, (ad, spec) in ((None, (None, None)), ("a", (ad_a, spec_a)), ("b", (ad_b, spec_b))):
        ref_eng = _merged_engine(model, params, ad, spec) if ad is not None else LocalEngine(
            model, max_running_requests=8, context_length=64, decode_steps=4)  # fmt: skip
        try:
            for p in PROMPTS:
                ref = _greedy(ref_eng, p).result()[0]
                s = got[(lora, tuple(p))]
                assert list(s.output_ids) == list(ref.output_ids), (lora, p)
                np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=2e-5)
        finally:
            ref_eng.close()
    outs = {lora: tuple(got[(lora, tuple(PROMPTS[0]))].output_ids) for lora in (None, "a", "b")}
    assert len(set(outs.values())) == 3  # the adapters do change what is sampled


def test_peft_folder_loads_and_replace_and_unload(setup, tmp_path):
    model, params, eng, (ad_a, spec_a), _ = setup
    save_peft(ad_a, spec_a, CFG, str(tmp_path / "peft_a"))
    eng.unload_lora("b")
    assert eng.load_lora("from_peft", str(tmp_path / "peft_a")) == 2  # b's slot, freed
    base_before = jax.tree.map(np.asarray, eng._params)
    with pytest.raises(LoRAError, match="slots are in use"):
        eng.load_lora("c", adapters=ad_a, spec=spec_a)
    a = _greedy(eng, PROMPTS[1], "a").result()[0]
    f = _greedy(eng, PROMPTS[1], "from_peft").result()[0]
    assert list(f.output_ids) == list(a.output_ids)
    np.testing.assert_allclose(f.logprobs, a.logprobs, atol=1e-5)
    # replace: the trainer's push into the same slot, the base untouched
    zero = jax.tree.map(np.zeros_like, ad_a)
    slot = eng.loras()["a"]["slot"]
    assert eng.load_lora("a", adapters=zero, spec=spec_a, replace=True) == slot
    base = _greedy(eng, PROMPTS[1]).result()[0]
    assert list(_greedy(eng, PROMPTS[1], "a").result()[0].output_ids) == list(base.output_ids)
    for x, y in zip(jax.tree.leaves(eng._params), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(np.asarray(x), y)
    eng.unload_lora("from_peft")
    with pytest.raises(RequestError, match="no adapter of that name"):
        _greedy(eng, PROMPTS[0], "from_peft")


def test_adapters_that_do_not_fit_are_refused(setup, tmp_path):
    model, params, eng, (ad_a, spec_a), _ = setup
    with pytest.raises(LoRAError, match="max_lora_rank"):
        eng.load_lora("big", adapters=ad_a, spec=LoRASpec(spec_a.targets, 16, 16.0))
    other = ModelConfig(**{**CFG.__dict__, "d_model": 48})
    _, other_params, _ = split_model(Decoder(other, rngs=nnx.Rngs(0)))
    save_peft(init_adapters(other_params, spec_a, jax.random.key(0)), spec_a, other, str(tmp_path / "other"))
    with pytest.raises(LoRAError, match="this model needs"):
        eng.load_lora("other", str(tmp_path / "other"))
    with pytest.raises(LoRAError, match="PEFT adapter folder"):
        eng.load_lora("missing", str(tmp_path / "missing"))
    with pytest.raises(LoRAError, match="already loaded"):
        eng.load_lora("a", adapters=ad_a, spec=spec_a)
    with pytest.raises(LoRAError, match="no adapter named"):
        eng.unload_lora("nope")
    plain = LocalEngine(Decoder(CFG, rngs=nnx.Rngs(3)), max_running_requests=2, context_length=32)
    try:
        with pytest.raises(RequestError, match="serves no LoRA adapters"):
            _greedy(plain, PROMPTS[0], "a")
        with pytest.raises(LoRAError, match="max_loras >= 1"):
            plain.load_lora("a", adapters=ad_a, spec=spec_a)
    finally:
        plain.close()


def test_the_trainers_push_is_a_weight_update_of_the_adapter_alone(setup):
    """update_lora: a new weight version, the default adapter serves requests without lora_path."""
    model, params, _, (ad_a, spec_a), _ = setup
    eng = LocalEngine(model, max_running_requests=4, context_length=64, decode_steps=4, max_loras=1, max_lora_rank=4)
    try:
        zero = jax.tree.map(np.zeros_like, ad_a)
        assert eng.update_lora("policy", zero, spec_a, weight_version="0", mode="abort") == "0"
        eng.set_default_lora("policy")
        base = _greedy(eng, PROMPTS[2]).result()[0]
        assert eng.update_lora("policy", ad_a, spec_a, weight_version="1") == "1"
        pushed = _greedy(eng, PROMPTS[2]).result()[0]
        explicit = _greedy(eng, PROMPTS[2], "policy").result()[0]
        assert pushed.weight_version == "1" and list(pushed.output_ids) == list(explicit.output_ids)
        assert list(pushed.output_ids) != list(base.output_ids)
        ref = _merged_engine(model, params, ad_a, spec_a)
        try:
            np.testing.assert_allclose(pushed.logprobs, _greedy(ref, PROMPTS[2]).result()[0].logprobs, atol=2e-5)
        finally:
            ref.close()
        with pytest.raises(LoRAError, match="rank 8"):
            eng.update_lora("policy", ad_a, LoRASpec(spec_a.targets, 8, 8.0))
    finally:
        eng.close()
