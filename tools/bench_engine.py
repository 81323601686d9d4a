"""Rollout-engine benchmark: LocalEngine beside transformers' generate, in one process.

    python tools/bench_engine.py                          # every part below
    python tools/bench_engine.py --only decode --rounds 3
    python tools/bench_engine.py --small                  # a 2-layer d128 model (smoke)

Parts (the 8-layer d512 Qwen3 of tools/bench_model.py, float32, 2 torch threads):
  decode   batch 16, 64-token prompts, 128 new tokens, temperature 1: output tokens/s of
           LocalEngine and of transformers' `generate` (sampling, KV cache, SDPA), their
           ratio, and the fraction of the floor: per decode step the weights read once at
           the memory rate plus the step's FLOPs at the matmul rate, both measured here.
  grpo     64 prompts x 8 samples, 64-token prompts, at most 256 new tokens, 64 stop ids
           so output lengths spread widely (geometric, mean ~V/64): useful output
           tokens/s of continuous batching (LocalEngine, 16 rows) against static batching
           (StaticGenerator, batches of 16 rows that each run to their longest row).
  prefix   time to prefill a 512-token prompt with n=8 samples against n=1 (one new
           token each; the prefix cache is flushed between runs).
  logprob  engine log-probs of sampled tokens against the trainer's forward on the same
           tokens (mean/max absolute difference), float32 and bfloat16.
Peak RSS of the process is printed at the end, and at the start which decode path each
CPU kernel takes on this machine (ptrain.kernels.cpu.choose: timed against XLA's once).
PTRAIN_CPU_KERNELS=0 runs the engine on XLA's attention and dots instead of the decode
kernels (attention, and the projections on packed weights), PTRAIN_CPU_KERNELS=force on
both kernels, for an A/B; PTRAIN_CPU_KERNEL_ISA=avx2 builds them for AVX2 only.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ptrain.config.model import ModelConfig  # noqa: E402
from ptrain.models import Decoder, count_params, save_hf  # noqa: E402
from ptrain.models.generate import StaticGenerator  # noqa: E402
from ptrain.rollout.local import LocalEngine  # noqa: E402
from ptrain.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from tools.bench_model import DENSE  # noqa: E402

SMALL = ModelConfig(family="qwen3", vocab_size=4096, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                    d_ff=384, max_seq_len=1024, tie_embeddings=False)  # fmt: skip


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """float32 GFLOP/s of an n x n matmul, best of reps."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_time(lambda: f(a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def memory_rate(mb: int = 512, reps: int = 5) -> float:
    """GB/s of reading an array once (a sum over mb MiB of float32)."""
    a = jnp.ones((mb * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(a).block_until_ready()
    best = min(_time(lambda: f(a).block_until_ready()) for _ in range(reps))
    return a.size * 4 / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _prompts(cfg: ModelConfig, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(5, cfg.vocab_size, (n, length)).tolist()


def bench_decode(cfg: ModelConfig, model, rounds: int, gflops: float, gbs: float) -> None:
    B, P, N = 16, 64, 128
    prompts = _prompts(cfg, B, P, 1)
    engine = LocalEngine(model, max_running_requests=B, context_length=P + N + 16, decode_steps=8)
    sp = SamplingParams(max_new_tokens=N, temperature=1.0, ignore_eos=True)

    def run_engine():
        outs = engine.generate_many([GenerateRequest(p, sp) for p in prompts])
        assert all(len(o[0].output_ids) == N for o in outs)

    run_engine()  # compile
    ours = [B * N / _time(run_engine) for _ in range(rounds)]
    engine.close()

    import torch
    import transformers

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        tm = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").float().eval()
    ids = torch.tensor(prompts, dtype=torch.long)

    def run_torch():
        with torch.inference_mode():
            tm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                        top_p=1.0, max_new_tokens=N, min_new_tokens=N, use_cache=True, pad_token_id=0)  # fmt: skip

    run_torch()
    theirs = [B * N / _time(run_torch) for _ in range(rounds)]

    # Floor of one decode step: every weight read once, plus the step's FLOPs.
    n_params = count_params(cfg, embedding=False) + cfg.vocab_size * cfg.d_model  # head (the embedding is a gather)
    weight_s = n_params * 4 / (gbs * 1e9)
    ctx = P + N / 2
    flops = 2 * n_params * B + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * ctx * B
    step_floor = max(weight_s, flops / (gflops * 1e9))
    floor_tok_s = B / step_floor
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"decode  B={B} P={P} N={N}: ptrain {mo:.0f} tok/s (rounds {[round(x) for x in ours]}), "
          f"transformers {mt:.0f} tok/s ({[round(x) for x in theirs]}), ratio {mo / mt:.2f}x; floor {floor_tok_s:.0f} "
          f"tok/s (weights {weight_s * 1e3:.1f} ms at {gbs:.1f} GB/s, FLOPs {flops / (gflops * 1e9) * 1e3:.1f} ms "
          f"at {gflops:.0f} GFLOP/s per step): {mo / floor_tok_s:.2f} of the floor", flush=True)  # fmt: skip


def bench_grpo(cfg: ModelConfig, model, rounds: int) -> None:
    n_prompts, G, P, N, rows = 64, 8, 64, 256, 16
    prompts = _prompts(cfg, n_prompts, P, 2)
    stop = list(range(cfg.vocab_size - 64, cfg.vocab_size))
    engine = LocalEngine(model, max_running_requests=rows, context_length=P + N + 16, decode_steps=8)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=N, temperature=1.0, n=G, sampling_seed=i,
                                              stop_token_ids=tuple(stop)), rid=f"p{i}") for i, p in enumerate(prompts)]  # fmt: skip

    def run_engine():
        outs = engine.generate_many(reqs)
        return sum(len(s.output_ids) for o in outs for s in o)

    static = StaticGenerator(model)
    flat = [p for p in prompts for _ in range(G)]

    def run_static():
        useful = 0
        for i in range(0, len(flat), rows):
            out = static(flat[i : i + rows], max_new_tokens=N, temperature=1.0, stop_tokens=stop,
                         rng=jax.random.key(i), prompt_bucket=P)  # fmt: skip
            useful += int(out.lengths_B.sum())
        return useful

    run_engine(), run_static()  # compile
    cont, stat = [], []
    lengths = None
    for _ in range(rounds):
        t = time.perf_counter()
        u = run_engine()
        cont.append(u / (time.perf_counter() - t))
        t = time.perf_counter()
        v = run_static()
        stat.append(v / (time.perf_counter() - t))
        lengths = (u, v)
    outs = engine.generate_many(reqs[:8])
    lens = [len(s.output_ids) for o in outs for s in o]
    engine.close()
    mc, ms = statistics.median(cont), statistics.median(stat)
    print(f"grpo    {n_prompts}x{G} samples, <= {N} new tokens (lengths p10/p50/p90 "
          f"{np.percentile(lens, 10):.0f}/{np.percentile(lens, 50):.0f}/{np.percentile(lens, 90):.0f}; useful tokens "
          f"{lengths}): continuous {mc:.0f} tok/s, static {ms:.0f} tok/s, ratio {mc / ms:.2f}x", flush=True)  # fmt: skip


def bench_prefix(cfg: ModelConfig, model, rounds: int) -> None:
    P = 512
    prompt = _prompts(cfg, 1, P, 3)[0]
    engine = LocalEngine(model, max_running_requests=8, context_length=P + 16, decode_steps=1)

    def run(n: int) -> float:
        engine.flush_cache()
        sp = SamplingParams(max_new_tokens=1, temperature=1.0, n=n, ignore_eos=True)
        return _time(lambda: engine.generate_many([GenerateRequest(prompt, sp)]))

    run(1), run(8)
    one = statistics.median(run(1) for _ in range(rounds))
    eight = statistics.median(run(8) for _ in range(rounds))
    engine.close()
    print(
        f"prefix  {P}-token prompt: n=1 {one * 1e3:.0f} ms, n=8 {eight * 1e3:.0f} ms, ratio {eight / one:.2f}x",
        flush=True,
    )


def bench_logprob(cfg: ModelConfig) -> None:
    from ptrain.models import load_hf

    with tempfile.TemporaryDirectory() as d:
        save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), d)
        for dtype in ("float32", "bfloat16"):
            model = load_hf(d, dtype=dtype)
            engine = LocalEngine(model, max_running_requests=8, context_length=256)
            prompts = _prompts(cfg, 8, 32, 4)
            outs = engine.generate_many(
                [
                    GenerateRequest(p, SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True))
                    for p in prompts
                ]
            )
            engine.close()
            graphdef, state = nnx.split(model)
            fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
            diffs = []
            for p, o in zip(prompts, outs):
                seq = np.asarray(p + list(o[0].output_ids))[None]
                logp = jax.nn.log_softmax(fwd(state, jnp.asarray(seq))[0, len(p) - 1 : -1], axis=-1)
                ref = np.asarray(logp)[np.arange(len(o[0].output_ids)), o[0].output_ids]
                diffs.append(np.abs(ref - np.asarray(o[0].logprobs)))
            diffs = np.concatenate(diffs)
            print(f"logprob {dtype}: engine vs trainer forward on the same tokens: mean |diff| {diffs.mean():.2e}, "
                  f"max {diffs.max():.2e} over {diffs.size} tokens", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=["decode", "grpo", "prefix", "logprob"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a 2-layer d128 model instead of the bench model")
    args = ap.parse_args()
    parts = args.only or ["decode", "grpo", "prefix", "logprob"]
    cfg = SMALL if args.small else DENSE
    import subprocess

    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | head -1"], capture_output=True, text=True).stdout
    gflops, gbs = matmul_rate(), memory_rate()
    print(f"{cpu.strip()}; jax {jax.__version__}; {jax.device_count()} device(s); matmul {gflops:.0f} GFLOP/s, "
          f"memory {gbs:.1f} GB/s; model {count_params(cfg) / 1e6:.1f}M params", flush=True)  # fmt: skip
    from ptrain.kernels import cpu as cpu_kernels

    # The decode path each kernel takes on this CPU (timed against XLA's once, then cached);
    # the choose() call prints it.
    if not (cpu_kernels.available() and cpu_kernels.choose()):
        print("decode path: XLA (the CPU kernels are off or could not be built)", flush=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    if "decode" in parts:
        bench_decode(cfg, model, args.rounds, gflops, gbs)
    if "grpo" in parts:
        bench_grpo(cfg, model, args.rounds)
    if "prefix" in parts:
        bench_prefix(cfg, model, args.rounds)
    if "logprob" in parts:
        bench_logprob(cfg)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
