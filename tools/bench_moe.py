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
  python tools/bench_moe.py --single-thread          # 1 thread each, CPU time: for a loaded machine

Unlike the other benchmarks this one does not restart with the CLI's huge-page malloc
tunable (ptrain/runtime.py): torch shares the process, and with the tunable torch's block
got 2x faster and ptrain's layer 1.7x slower at 64 experts, while ptrain alone got faster.
So the table compares both at glibc's defaults, and what the CLI gets is measured without
torch:

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python tools/bench_moe.py --skip torch ragged_dot dense

--single-thread runs XLA and torch on one thread and times process CPU time instead of
wall time: on a shared machine under load the wall-clock ratios drift with the load,
while single-thread CPU times stay comparable (they do not show threading efficiency).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__" and "--single-thread" in sys.argv:  # must precede the jax import
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from ptrain.kernels import moe

CLOCK = time.perf_counter


PEAK_N = 4096


def matmul_run():
    """A jitted float32 4096^3 matmul: the peak the roofline is measured against."""
    a = jax.random.normal(jax.random.PRNGKey(0), (PEAK_N, PEAK_N), jnp.float32)
    f = jax.jit(jnp.dot)
    return lambda: f(a, a).block_until_ready()


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
            combine_TxE = (
                jnp.zeros((x.shape[0], E), x.dtype)
                .at[jnp.arange(x.shape[0])[:, None], r.expert_ids_Txk]
                .add(r.weights_Txk)
            )
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
    cfg = Qwen3MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        hidden_act="silu",
    )
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


def dense_bytes(kind, T, D, F, E, k):
    """Rough peak memory of the variants that materialise every expert for every row."""
    if kind == "dense":
        return 6 * T * E * F * 4  # gate, up, h and their gradients, [T, E, F] float32
    if kind == "ragged_dot":
        return 2 * T * k * E * max(2 * F, D) * 4  # masked [M, E, N] products, forward and backward
    return 0


def bench_shape(T, D, F, E, k, repeats, skip, max_gb):
    p = make_params(T, D, F, E)
    runs = {"matmul": matmul_run()}
    for kind in ("ptrain", "ragged_dot", "dense"):
        if kind in skip:
            continue
        gb = dense_bytes(kind, T, D, F, E, k) / 2**30
        if gb > max_gb:
            print(f"  {kind}: skipped, needs about {gb:.1f} GB (> --max-gb {max_gb})")
            continue
        runs[kind] = (lambda r: lambda: r(p))(jax_layer(kind, k))
    if "torch" not in skip:
        runs["torch"] = torch_layer(p, k)
    for fn in runs.values():
        fn()  # compile and warm every variant before timing any of them
    times = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so load changes hit every variant alike
        for name, fn in runs.items():
            t0 = CLOCK()
            fn()
            times[name].append(CLOCK() - t0)
    # The peak is timed interleaved with the variants, so a load change moves both.
    peak = 2 * PEAK_N**3 / min(times.pop("matmul")) / 1e9
    flops = 3 * (6 * T * k * D * F + 2 * T * D * E)
    roofline_ms = flops / (peak * 1e9) * 1e3
    rows = []
    for name, ts in times.items():
        best, med = min(ts) * 1e3, statistics.median(ts) * 1e3
        rows.append(
            dict(
                name=name,
                best_ms=best,
                median_ms=med,
                gflops=flops / (best / 1e3) / 1e9,
                pct_peak=100 * flops / (best / 1e3) / 1e9 / peak,
                x_roofline=best / roofline_ms,
            )
        )
    torch_best = next((r["best_ms"] for r in rows if r["name"] == "torch"), None)
    for r in rows:
        r["speedup_vs_torch"] = torch_best / r["best_ms"] if torch_best else float("nan")
    return rows, roofline_ms, flops, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--experts", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--top-k", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["ptrain", "ragged_dot", "dense", "torch"])
    ap.add_argument("--single-thread", action="store_true", help="one thread each; time CPU seconds")
    ap.add_argument("--max-gb", type=float, default=3.0, help="skip dense variants needing more memory")
    args = ap.parse_args()
    global CLOCK
    if args.single_thread:
        CLOCK = time.process_time
    if len(args.experts) != len(args.top_k):
        ap.error("--experts and --top-k pair up: give the same number of each")
    try:
        import torch

        torch.set_num_threads(1 if args.single_thread else os.cpu_count())
    except ImportError:
        args.skip.append("torch")
    mode = "1 thread, CPU time" if args.single_thread else f"{os.cpu_count()} CPUs, wall time"
    print(f"jax {jax.__version__}, torch {torch.__version__ if 'torch' not in args.skip else '-'}, {mode}")
    for E, k in zip(args.experts, args.top_k):
        load = os.getloadavg()[0]
        rows, roofline_ms, flops, peak = bench_shape(
            args.tokens, args.d_model, args.d_ff, E, k, args.repeats, args.skip, args.max_gb
        )
        print(
            f"\nT={args.tokens} d={args.d_model} f={args.d_ff} E={E} top-{k}: {flops / 1e9:.1f} GFLOP active "
            f"(fwd+bwd); matmul peak {peak:.0f} GFLOP/s (float32 4096^3 jnp.dot, interleaved) -> roofline "
            f"{roofline_ms:.0f} ms; load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        print("| variant | best ms | median ms | GFLOP/s | % peak | x roofline | speed-up vs torch |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['name']} | {r['best_ms']:.0f} | {r['median_ms']:.0f} | {r['gflops']:.0f} | {r['pct_peak']:.0f}% "
                f"| {r['x_roofline']:.2f} | {r['speedup_vs_torch']:.2f} |"
            )


if __name__ == "__main__":
    main()
