"""MoE layer forward+backward on this CPU: ptrain vs lax.ragged_dot, a dense one-hot einsum and torch.

One process, one machine, interleaved repeats (machines here are shared, so compare the
ratios of one run). The layer is router + softmax top-k + SwiGLU experts + weighted
combine, float32, gradients for the input and every weight:

  ptrain      ptrain.kernels.moe.route + moe_ffn(implementation="xla")  (sorted rows, tiled)
  ragged_dot  the same with implementation="ragged_dot" (lax.ragged_dot: dense masking on CPU)
  dense       every expert for every token, combined with a dense [T, E] weight matrix
  torch       transformers' Qwen3MoeSparseMoeBlock (torch CPU; loops over the hit experts)

"roofline" is the time the active FLOPs (3 x (6 T k d f + 2 T d E)) take at the matmul
peak measured in the same run (jitted float32 4096x4096 jnp.dot).

  python tools/bench_moe.py                          # both issue shapes
  python tools/bench_moe.py --experts 16 --top-k 4 --skip ragged_dot dense
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ptrain.kernels import moe


def _time(fn, repeats):
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def matmul_peak(repeats: int) -> float:
    """GFLOP/s of a jitted float32 4096^3 matmul (best of `repeats`)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32)
    f = jax.jit(jnp.dot)
    times = _time(lambda: f(a, a).block_until_ready(), repeats)
    return 2 * 4096**3 / min(times) / 1e9


def make_params(T, D, F, E, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    return dict(
        x=jax.random.normal(ks[0], (T, D), jnp.float32),
        cot=jax.random.normal(ks[1], (T, D), jnp.float32),
        w_router=jax.random.normal(ks[2], (D, E), jnp.float32) / np.sqrt(D),
        w_gate=jax.random.normal(ks[3], (E, D, F), jnp.float32) / np.sqrt(D),
        w_up=jax.random.normal(ks[4], (E, D, F), jnp.float32) / np.sqrt(D),
        w_down=jax.random.normal(ks[5], (E, F, D), jnp.float32) / np.sqrt(F),
    )


def jax_layer(kind: str, top_k: int):
    """A jitted value_and_grad of sum(layer(x) * cot) for one of the JAX variants."""

    def layer(x, w_router, w_gate, w_up, w_down):
        r = moe.route(x @ w_router, top_k=top_k)
        if kind == "dense":
            E = w_gate.shape[0]
            combine_TxE = jnp.zeros((x.shape[0], E), x.dtype).at[jnp.arange(x.shape[0])[:, None], r.expert_ids_Txk].add(
                r.weights_Txk)
            h = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
            return jnp.einsum("tef,efd,te->td", h, w_down, combine_TxE)
        impl = {"ptrain": "xla", "ragged_dot": "ragged_dot"}[kind]
        return moe.moe_ffn(x, r.expert_ids_Txk, r.weights_Txk, w_gate, w_up, w_down, implementation=impl)

    def loss(x, w_router, w_gate, w_up, w_down, cot):
        return jnp.sum(layer(x, w_router, w_gate, w_up, w_down) * cot)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    def run(p):
        return jax.block_until_ready(step(p["x"], p["w_router"], p["w_gate"], p["w_up"], p["w_down"], p["cot"]))

    return run


def torch_layer(p, top_k):
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    T, D = p["x"].shape
    E, _, F = p["w_gate"].shape
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=top_k,
                         norm_topk_prob=True, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(np.asarray(p["w_router"]).T.copy()))
        gate_up = np.concatenate([np.asarray(p["w_gate"]), np.asarray(p["w_up"])], axis=-1).transpose(0, 2, 1)
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up.copy()))
        block.experts.down_proj.copy_(torch.from_numpy(np.asarray(p["w_down"]).transpose(0, 2, 1).copy()))
    x = torch.from_numpy(np.array(p["x"])).reshape(1, T, D).requires_grad_(True)
    cot = torch.from_numpy(np.array(p["cot"])).reshape(1, T, D)

    def run():
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = block(x)
        (y * cot).sum().backward()
        return y

    return run


def bench_shape(T, D, F, E, k, repeats, skip, peak):
    p = make_params(T, D, F, E)
    runs = {}
    for kind in ("ptrain", "ragged_dot", "dense"):
        if kind not in skip:
            runs[kind] = (lambda r: (lambda: r(p)))(jax_layer(kind, k))
    if "torch" not in skip:
        runs["torch"] = torch_layer(p, k)
    for fn in runs.values():
        fn()  # compile and warm every variant before timing any of them
    times = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so load changes hit every variant alike
        for name, fn in runs.items():
            times[name].extend(_time(fn, 1))
    flops = 3 * (6 * T * k * D * F + 2 * T * D * E)
    roofline_ms = flops / (peak * 1e9) * 1e3
    rows = []
    for name, ts in times.items():
        best, med = min(ts) * 1e3, statistics.median(ts) * 1e3
        rows.append(dict(name=name, best_ms=best, median_ms=med, gflops=flops / (best / 1e3) / 1e9,
                         pct_peak=100 * flops / (best / 1e3) / 1e9 / peak, x_roofline=best / roofline_ms))
    torch_best = next((r["best_ms"] for r in rows if r["name"] == "torch"), None)
    for r in rows:
        r["speedup_vs_torch"] = torch_best / r["best_ms"] if torch_best else float("nan")
    return rows, roofline_ms, flops


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--top-k", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["ptrain", "ragged_dot", "dense", "torch"])
    args = ap.parse_args()
    if len(args.experts) != len(args.top_k):
        ap.error("--experts and --top-k pair up: give the same number of each")
    try:
        import torch

        torch.set_num_threads(os.cpu_count())
    except ImportError:
        args.skip.append("torch")
    peak = matmul_peak(args.repeats)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, float32 matmul peak {peak:.1f} GFLOP/s (4096^3 jnp.dot)")
    for E, k in zip(args.experts, args.top_k):
        rows, roofline_ms, flops = bench_shape(args.tokens, args.d_model, args.d_ff, E, k, args.repeats, args.skip, peak)
        print(f"\nT={args.tokens} d={args.d_model} f={args.d_ff} E={E} top-{k}: {flops / 1e9:.1f} GFLOP active "
              f"(fwd+bwd), roofline {roofline_ms:.0f} ms")
        print("| variant | best ms | median ms | GFLOP/s | % peak | x roofline | speed-up vs torch |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['best_ms']:.0f} | {r['median_ms']:.0f} | {r['gflops']:.0f} | {r['pct_peak']:.0f}% "
                  f"| {r['x_roofline']:.2f} | {r['speedup_vs_torch']:.2f} |")


if __name__ == "__main__":
    main()
