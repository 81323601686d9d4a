"""route + moe_ffn reproduce transformers' Qwen3MoeSparseMoeBlock (torch CPU): output and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptrain.kernels import moe

torch = pytest.importorskip("torch")
qwen3 = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
Qwen3MoeConfig = pytest.importorskip("transformers.models.qwen3_moe.configuration_qwen3_moe").Qwen3MoeConfig

T, D, F, E, K = 24, 32, 16, 8, 2


@pytest.mark.parity
def test_matches_qwen3_moe_block():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(T, D)).astype(np.float32)
    cot = rng.normal(size=(T, D)).astype(np.float32)
    w_router = rng.normal(size=(D, E)).astype(np.float32) / np.sqrt(D)
    w_gate, w_up = (rng.normal(size=(E, D, F)).astype(np.float32) / np.sqrt(D) for _ in range(2))
    w_down = rng.normal(size=(E, F, D)).astype(np.float32) / np.sqrt(F)

    cfg = Qwen3MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    block = qwen3.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(w_router.T.copy()))
        # HF stores [gate; up] as [E, 2F, D] and down as [E, D, F] (nn.Linear layout).
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([w_gate, w_up], -1).transpose(0, 2, 1).copy()))
        block.experts.down_proj.copy_(torch.from_numpy(w_down.transpose(0, 2, 1).copy()))
    xt = torch.from_numpy(x.copy()).reshape(1, T, D).requires_grad_(True)
    yt = block(xt)
    (yt * torch.from_numpy(cot).reshape(1, T, D)).sum().backward()

    def loss(x, w_router, w_gate, w_up, w_down):
        r = moe.route(x @ w_router, top_k=K, norm_topk_prob=True)
        y = moe.moe_ffn(x, r.expert_ids_Txk, r.weights_Txk, w_gate, w_up, w_down, implementation="xla")
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, w_router, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy().reshape(T, D), rtol=1e-4, atol=1e-5)
    g_gate_up = block.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1)
    expected = {
        "x": xt.grad.numpy().reshape(T, D),
        "router": block.gate.weight.grad.numpy().T,
        "gate": g_gate_up[..., :F],
        "up": g_gate_up[..., F:],
        "down": block.experts.down_proj.grad.numpy().transpose(0, 2, 1),
    }
    for (name, want), got in zip(expected.items(), grads):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=name)
