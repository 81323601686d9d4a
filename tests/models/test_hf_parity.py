"""Number-for-number parity with transformers (marker `parity`; needs torch).

Tiny random models of every supported family are built locally from transformers'
config classes (no hub), with every weight (norms, biases, router bias included) drawn
at random so that no mapping error can hide behind an identity initialisation. Checks:
  1. load_hf logits == transformers logits (float32, right-padded batch), max abs diff
     <= 1e-4 * max |logit|;
  2. save_hf -> transformers.from_pretrained -> the same logits (round trip);
  3. gradients of a token-mean cross-entropy w.r.t. every parameter agree after mapping
     the names (transformers' fused runtime expert tensors are split per expert).
A Qwen3-MoE model with dense and MoE layers mixed (`mlp_only_layers`, `decoder_sparse_step`)
runs the same checks.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0, CPU wheel)")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

from ptrain.models import load_hf, save_hf  # noqa: E402
from ptrain.models.hf import _flat_state, _to_hf, tensor_map  # noqa: E402

pytestmark = pytest.mark.parity
torch.set_num_threads(2)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, norm_topk_prob=False, **MOE)),
    # Dense and MoE layers mixed: layer 0 in mlp_only_layers, MoE on every second layer
    # (decoder_sparse_step=2) -> dense, MoE, dense, MoE; loaded with scanned layer groups.
    "qwen3_moe_mixed": (
        "Qwen3MoeConfig",
        dict(
            num_experts=8, norm_topk_prob=True, num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, **MOE
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "dots1": (
        "Dots1Config",
        dict(
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            **MOE,
        ),
    ),
}
LOAD_OVERRIDES = {"qwen3_moe_mixed": dict(scan_layers=True)}
"""load_hf options per family (default: the plain layer loop)."""
B, L = 3, 10
LENGTHS = [10, 7, 4]


def _randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "correction_bias" in name:
                p.copy_(0.05 * noise)
            else:
                p.copy_(0.15 * noise)


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128, (B, L)).astype(np.int64)
    mask = (np.arange(L)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.int64)
    ids = ids * mask
    return ids, mask


def _torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


def _assert_close_on_valid(a, b, mask, what):
    valid = mask.astype(bool)
    scale = max(1.0, float(np.abs(b[valid]).max()))
    diff = float(np.abs(a[valid] - b[valid]).max())
    assert diff <= 1e-4 * scale, f"{what}: max abs diff {diff:.3g} > 1e-4 * logit scale {scale:.3g}"


def _xent_jax(logits, ids, mask):
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    tgt = jnp.asarray(ids[:, 1:], jnp.int32)
    m = jnp.asarray(mask[:, 1:], jnp.float32)
    return -jnp.sum(jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0] * m) / jnp.sum(m)


def _jax_logits_and_grads(model, ids, mask):
    """One compiled value_and_grad per family: float32 logits [B, L, V] and flat grads."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(jnp.asarray(ids, jnp.int32), None, jnp.asarray(mask, jnp.int32))
        return _xent_jax(logits, ids, mask), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), _flat_state(grads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, torch model, ptrain model loaded from its folder, (jax logits, jax grads))."""
    cls_name, extra = FAMILIES[request.param]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    tmodel = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    _randomise(tmodel, 1)
    tmodel.eval()
    folder = str(tmp_path_factory.mktemp(request.param) / "hf")
    tmodel.save_pretrained(folder)
    jmodel = load_hf(folder, **LOAD_OVERRIDES.get(request.param, {}))
    return request.param, tmodel, jmodel, _jax_logits_and_grads(jmodel, *_batch())


def test_logits_match_transformers(pair):
    name, tmodel, _, (jlogits, _) = pair
    ids, mask = _batch()
    _assert_close_on_valid(jlogits, _torch_logits(tmodel, ids, mask), mask, name)


def test_save_hf_round_trips_through_transformers(pair, tmp_path):
    name, _, jmodel, (jlogits, _) = pair
    save_hf(jmodel, str(tmp_path), max_shard_bytes=200_000)  # force several shards + index
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
    ids, mask = _batch()
    _assert_close_on_valid(jlogits, _torch_logits(back, ids, mask), mask, f"{name} round trip")


def _torch_grads_by_checkpoint_name(tmodel, ids, mask, family):
    """Gradients keyed by checkpoint tensor names (fused runtime expert tensors split)."""
    tmodel.zero_grad()
    logits = tmodel(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float()
    loss = _xent_torch(logits, ids, mask)
    loss.backward()
    out = {}
    for n, p in tmodel.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.numpy()
        moe_prefix = n.replace(".mlp.", ".block_sparse_moe.") if family == "mixtral" else n
        if n.endswith("experts.gate_up_proj"):
            F = g.shape[1] // 2
            base = moe_prefix[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
                out[f"{base}{e}.{gate}.weight"] = g[e, :F]
                out[f"{base}{e}.{up}.weight"] = g[e, F:]
        elif n.endswith("experts.down_proj"):
            base = moe_prefix[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.{'w2' if family == 'mixtral' else 'down_proj'}.weight"] = g[e]
        elif family == "mixtral" and ".mlp.gate." in n:
            out[moe_prefix] = g
        else:
            out[n] = g
    return out


def _xent_torch(logits, ids, mask):
    logp = torch.log_softmax(logits[:, :-1], -1)
    tgt = torch.tensor(ids[:, 1:])
    m = torch.tensor(mask[:, 1:], dtype=torch.float32)
    return -(logp.gather(-1, tgt[..., None])[..., 0] * m).sum() / m.sum()


def test_gradients_match_transformers(pair):
    name, tmodel, jmodel, (_, jgrads) = pair
    ids, mask = _batch()
    tgrads = _torch_grads_by_checkpoint_name(tmodel, ids, mask, name)
    cfg = jmodel.cfg
    checked = 0
    for m in tensor_map(cfg):
        if m.hf_name not in tgrads:  # buffers (router bias) have no gradient
            assert "correction_bias" in m.hf_name, m.hf_name
            continue
        ours = np.asarray(jgrads[m.path][...])
        ours = _to_hf(ours[m.index] if m.index else ours, m)
        ref = tgrads[m.hf_name]
        scale = max(1e-3, float(np.abs(ref).max()))
        diff = float(np.abs(ours - ref).max())
        assert diff <= 1e-4 * scale + 1e-7, f"{name} grad {m.hf_name}: max abs diff {diff:.3g} (scale {scale:.3g})"
        checked += 1
    assert checked >= len(tgrads) - (1 if cfg.tie_embeddings else 0)
