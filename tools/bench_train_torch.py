"""The plain PyTorch baseline of `tools/bench_train.py`: the same Qwen3-style decoder,
forward + backward + gradient clipping + AdamW, in eager torch on this CPU.

    python tools/bench_train_torch.py            # 8 layers, d 512, batch 8 x 512, float32

Written directly in torch (RMSNorm, q/k-norm, RoPE, grouped-query SDPA with is_causal,
SwiGLU, untied head), no transformers, so it is the fastest simple loop torch offers; it
prints the median step time and tokens/s over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ptrain.runtime import reexec_with_malloc_tuning  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, H, K, Dh, F_ = a.d_model, a.heads, a.kv_heads, a.head_dim, a.d_ff
        self.a = a
        self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm = RMSNorm(D), RMSNorm(D), RMSNorm(Dh), RMSNorm(Dh)
        self.q, self.k, self.v = (nn.Linear(D, n * Dh, bias=False) for n in (H, K, K))
        self.o = nn.Linear(H * Dh, D, bias=False)
        self.gate, self.up, self.down = (
            nn.Linear(D, F_, bias=False),
            nn.Linear(D, F_, bias=False),
            nn.Linear(F_, D, bias=False),
        )

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        a = self.a
        h = self.attn_norm(x)
        q = rotate(self.q_norm(self.q(h).view(B, L, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
        k = rotate(self.k_norm(self.k(h).view(B, L, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
        v = self.v(h).view(B, L, a.kv_heads, a.head_dim).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, L, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.embed = nn.Embedding(a.vocab, a.d_model)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm, self.head = RMSNorm(a.d_model), nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, ids):
        L, Dh = ids.shape[1], self.a.head_dim
        inv = 1.0 / (1e6 ** (torch.arange(0, Dh, 2).float() / Dh))
        ang = torch.outer(torch.arange(L).float(), inv)
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [
        ("layers", 8),
        ("d-model", 512),
        ("heads", 8),
        ("kv-heads", 4),
        ("head-dim", 64),
        ("d-ff", 1536),
        ("vocab", 4096),
        ("batch", 8),
        ("seq", 512),
        ("warmup", 1),
        ("steps", 5),
    ]:
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = Decoder(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    print(
        json.dumps(
            {
                "batch": f"{a.batch}x{a.seq}",
                "threads": torch.get_num_threads(),
                "step_s_median": round(step, 3),
                "tokens_per_s": round(a.batch * a.seq / step, 1),
                "final_loss": round(float(loss.detach()), 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    reexec_with_malloc_tuning()  # the CLI's malloc setting (PTRAIN_MALLOC_TUNING=0 turns it off)
    main()
