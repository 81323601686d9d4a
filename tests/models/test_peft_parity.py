"""LoRA adapters number for number against PEFT on transformers (marker `parity`).

Both directions on the same tiny random base (float32, max abs logit difference <= 1e-5):
  ptrain -> PEFT: our adapters written as a PEFT folder, loaded by `PeftModel.from_pretrained`
  onto the transformers model of our exported base, give our logits;
  PEFT -> ptrain: a PEFT adapter with random A and B (init_lora_weights=False, so B is not
  zero and no mapping error hides), saved by PEFT, read by `load_peft`, gives PEFT's logits.
Plus the refusals of adapters ptrain does not run.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from ptrain.config.lora import LoRAConfig
from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, load_hf, save_hf
from ptrain.models.lora import LoRASpec, attach, init_adapters
from ptrain.models.peft_io import load_peft, read_peft_spec, save_peft
from ptrain.train.state import split_model

pytestmark = pytest.mark.parity
torch.set_num_threads(2)

CFG = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=32)
IDS = np.array([[1, 5, 9, 14, 3, 7, 2, 11], [4, 4, 8, 15, 16, 23, 42, 6]])


@pytest.fixture(scope="module", params=[dict(qkv_bias=True, qk_norm=False, family="qwen2"), dict(tie_embeddings=False)],
                ids=["qwen2", "qwen3_untied"])  # fmt: skip
def base(request, tmp_path_factory):
    cfg = ModelConfig(**CFG, **request.param)
    folder = str(tmp_path_factory.mktemp("base"))
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), folder)
    model = load_hf(folder)
    model_def, params, model_state = split_model(model)
    return folder, model.cfg, model_def, params, model_state


def _ours(model_def, params, model_state, adapters, spec):
    return np.asarray(model_def.bind(attach(params, adapters, spec), model_state)(jnp.asarray(IDS)))


def _hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def test_ptrain_adapter_loads_in_peft_with_the_same_logits(base, tmp_path):
    folder, cfg, model_def, params, model_state = base
    targets = ["all-linear"] + ([] if cfg.tie_embeddings else ["lm_head"])
    spec = LoRASpec.of(LoRAConfig(rank=4, alpha=8.0, targets=targets))
    adapters = init_adapters(params, spec, jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), adapters)
    save_peft(adapters, spec, cfg, str(tmp_path / "adapter"), base_model=folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ours = _ours(model_def, params, model_state, adapters, spec)
    base_logits = np.asarray(model_def.bind(params, model_state)(jnp.asarray(IDS)))
    assert np.max(np.abs(ours - base_logits)) > 1e-2  # the adapter does change the model
    np.testing.assert_allclose(_hf_logits(hf), ours, atol=1e-5, rtol=0)


def test_peft_adapter_loads_in_ptrain_with_the_same_logits(base, tmp_path):
    folder, cfg, model_def, params, model_state = base
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    lcfg = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                           init_lora_weights=False, use_rslora=True)  # fmt: skip
    pm = peft.get_peft_model(hf, lcfg).eval()
    pm.save_pretrained(str(tmp_path / "adapter"))
    adapters, spec = load_peft(str(tmp_path / "adapter"), params, cfg)
    assert spec.targets == ("q_proj", "v_proj", "o_proj", "down_proj") and spec.rank == 3 and spec.rslora
    np.testing.assert_allclose(_hf_logits(pm), _ours(model_def, params, model_state, adapters, spec), atol=1e-5)


def test_adapters_ptrain_does_not_run_are_refused(base, tmp_path):
    folder, cfg, model_def, params, model_state = base
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"], bias="lora_only")).save_pretrained(
        str(tmp_path / "bias")
    )
    with pytest.raises(ValueError, match="bias"):
        read_peft_spec(str(tmp_path / "bias"))
    spec = LoRASpec.of(LoRAConfig(rank=2, targets=["q_proj"]))
    save_peft(init_adapters(params, spec, jax.random.key(0)), spec, cfg, str(tmp_path / "small"))
    other = ModelConfig(**dict(CFG, d_model=48, family=cfg.family, qkv_bias=cfg.qkv_bias))
    _, other_params, _ = split_model(Decoder(other, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="shape .* this model needs"):
        load_peft(str(tmp_path / "small"), other_params, other)
    with open(tmp_path / "small" / "adapter_config.json") as f:
        c = json.load(f)
    c["target_modules"] = ["q_proj", "mystery_proj"]
    with open(tmp_path / "small" / "adapter_config.json", "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match="mystery_proj"):
        read_peft_spec(str(tmp_path / "small"))
    assert not os.path.exists(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="PEFT adapter folder"):
        read_peft_spec(str(tmp_path / "nothing"))
