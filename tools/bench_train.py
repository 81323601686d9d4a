"""Training throughput and model FLOP utilisation of ptrain's SFT step on this machine.

    python tools/bench_train.py                 # the issue's shape: 8 layers, d 512, batch 8 x 512, float32
    python tools/bench_train.py --steps 5 --layers 2 --batch 4 --seq 256   # a quick look
    python tools/bench_train.py --lora 16      # full fine-tuning against LoRA rank 16, same shape
    python tools/bench_train.py --seq-len 1024,2048,4096,8192 --context 4   # memory against length

With `--seq-len L1,L2,...` nothing is timed: for each length the SFT step (one row of L
tokens, the stages' own placement and jit) is compiled, not run, and XLA's buffer
assignment gives its peak memory per device (arguments + outputs + temporaries) on one
device and with the sequence split over `--context N` host devices (mesh.context=N), each
in its own process with N host devices. The table prints both against L, their ratio, and
the longest length of the sweep whose one-device peak fits `--device-memory-gib`.

With `--lora R` the step is timed twice, each in its own process so that peak memory (max RSS)
is each one's own: full fine-tuning, and LoRA adapters of rank R on every linear layer of a
frozen base; the table adds the optimizer-state bytes of each.

In one process: measures this CPU's matmul peak (a large jitted float32 matmul), then times
the full train step (forward, backward, AdamW, grad clipping) of a Qwen3-style decoder, and
prints tokens/s and MFU = tokens/s * training FLOPs per token / peak. Median over the timed
steps, after one compile step and warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptrain.config import ModelConfig, OptimConfig, SFTAlgoConfig, TrainConfig
from ptrain.config.lora import LoRAConfig
from ptrain.models import Decoder, flops_per_token
from ptrain.models.lora import LoRASpec, init_adapters
from ptrain.runtime import reexec_with_malloc_tuning, tune_xla_cpu
from ptrain.train.objectives import make_sft_objective, sft_denominator
from ptrain.train.optim import make_optimizer
from ptrain.train.state import init_train_state, split_model
from ptrain.train.step import make_train_step


def matmul_peak(n: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a jitted float32 n x n matmul (best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def best_matmul_peak(n: int) -> float:
    """The larger of the peak under this process's XLA flags and under XLA's defaults.

    ptrain's CPU flags (ptrain/runtime.py) move dots off YNNPACK, which makes the step
    faster but a lone square matmul slower; MFU is against the machine's best matmul.
    """
    in_process = matmul_peak(n)
    env = dict(
        os.environ,
        PTRAIN_XLA_CPU_TUNING="0",
        XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "ynn_fusion_type" not in f),
    )
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--peak-only", "--peak-n", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return max(in_process, float(out.strip().splitlines()[-1]))


def model_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        d_ff=args.d_ff,
        max_seq_len=args.seq,
        qk_norm=True,
        tie_embeddings=False,
        dtype=args.dtype,
        remat=args.remat,
    )


def time_steps(step, state, batch, warmup: int, steps: int, usage: dict | None = None, pause_s: float = 0.0):
    """(compile seconds, median step seconds, final state, last metrics) of a jitted step.

    With `usage`, also fills in the process's user and kernel CPU seconds and minor page
    faults per timed step (getrusage): kernel time is where page faults and thread
    wake-ups show up. `pause_s` sleeps after each step (outside the timing), to see what
    back-to-back dispatch costs in memory (docs/performance.md, "Page faults")."""
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    for _ in range(warmup):
        state, m = step(state, batch)
        jax.block_until_ready(m)
        time.sleep(pause_s)
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
        time.sleep(pause_s)
    after = resource.getrusage(resource.RUSAGE_SELF)
    if usage is not None:
        usage.update(
            user_cpu_s_per_step=round((after.ru_utime - before.ru_utime) / steps, 2),
            sys_cpu_s_per_step=round((after.ru_stime - before.ru_stime) / steps, 2),
            minor_faults_per_step=(after.ru_minflt - before.ru_minflt) // steps,
            context_switches_per_step=(after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw - before.ru_nivcsw) // steps,
            max_rss_gib=round(after.ru_maxrss / 2**20, 2),
        )
    return compile_s, statistics.median(times), state, m


def bench(args, peak: float | None = None) -> dict:
    """Times the SFT step at `args`' shape; MFU against `peak` FLOP/s (None: best_matmul_peak)."""
    cfg = model_config(args)
    model_def, params, rest = split_model(Decoder(cfg, rngs=nnx.Rngs(0)))
    tx, lr = make_optimizer(OptimConfig(lr=1e-4, schedule="constant"), 1000)
    algo = SFTAlgoConfig()
    objective = make_sft_objective(model_def, algo, vocab_chunk=args.vocab_chunk)
    step = jax.jit(
        make_train_step(objective, sft_denominator(algo, 1.0), tx, lr, grad_accum=args.grad_accum), donate_argnums=(0,)
    )
    trainable = params
    if args.lora_rank:
        spec = LoRASpec.of(LoRAConfig(rank=args.lora_rank))
        trainable = init_adapters(params, spec, jax.random.key(0))
    state = init_train_state(trainable, tx, seed=0, model_state=rest)
    if args.lora_rank:
        state = state.replace(base_params=params, lora=spec)
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
    rng = np.random.default_rng(0)
    B, L = args.batch, args.seq
    ids = rng.integers(0, args.vocab, (B, L + 1)).astype(np.int32)
    batch = dict(
        input_ids=ids[:, :-1],
        target_ids=ids[:, 1:],
        loss_mask=np.ones((B, L), np.float32),
        segment_ids=np.ones((B, L), np.int32),
        positions=np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)),
    )
    usage: dict = {}
    compile_s, step_s, state, m = time_steps(
        step, state, jax.device_put(batch), args.warmup, args.steps, usage, args.pause_ms / 1000
    )
    tokens_per_s = B * L / step_s
    peak = best_matmul_peak(args.peak_n) if peak is None else peak
    fpt = flops_per_token(cfg, L)
    return {
        "params_M": round(sum(x.size for x in jax.tree.leaves(params)) / 1e6, 2),
        "trainable_M": round(sum(x.size for x in jax.tree.leaves(trainable)) / 1e6, 3),
        "lora_rank": args.lora_rank,
        "opt_state_MiB": round(opt_bytes / 2**20, 2),
        "batch": f"{B}x{L}",
        "grad_accum": args.grad_accum,
        "vocab_chunk": args.vocab_chunk,
        "dtype": args.dtype,
        "compile_s": round(compile_s, 1),
        "step_s_median": round(step_s, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "train_gflop_per_token": round(fpt / 1e9, 4),
        "achieved_gflops": round(tokens_per_s * fpt / 1e9, 1),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "mfu": round(tokens_per_s * fpt / peak, 3),
        "final_loss": round(float(m["loss"]), 4),
        "devices": str(jax.devices()[0].platform),
        **usage,
    }


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The benchmark model's shape (defaults: the issue's 8-layer Qwen3-style model)."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (a scan inside the step)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument(
        "--vocab-chunk",
        type=int,
        default=TrainConfig().vocab_chunk,
        help="train.vocab_chunk (default: the CLI's); 0 reads full logits, N > 0 walks the "
        "vocabulary N columns at a time",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-n", type=int, default=4096, help="matrix size of the peak-FLOP/s matmul")
    ap.add_argument("--pause-ms", type=float, default=0.0, help="sleep after each step, outside the timing")


def step_memory(args, context: int, lengths: list[int]) -> list[dict]:
    """Per length: the compiled SFT step's memory per device with the sequence split over
    `context` devices (this process must see exactly that many)."""
    from ptrain.config import MeshConfig, RunConfig
    from ptrain.parallel import make_mesh
    from ptrain.stages.setup import jit_step, place_state

    devices = jax.devices()
    assert len(devices) == context, f"expected {context} devices, got {len(devices)}"
    rows = []
    for L in lengths:
        args.seq = L
        cfg = model_config(args)
        run = RunConfig(model=cfg, mesh=MeshConfig(data=1, context=context))
        mesh = make_mesh(run.mesh, devices)
        tx, lr = make_optimizer(OptimConfig(lr=1e-4, schedule="constant"), 1000)
        placed = place_state(run, Decoder(cfg, rngs=nnx.Rngs(0), mesh=mesh), tx, mesh)
        algo = SFTAlgoConfig()
        objective = make_sft_objective(placed.model_def, algo, vocab_chunk=args.vocab_chunk)
        step = jit_step(make_train_step(objective, sft_denominator(algo, 1.0), tx, lr), placed)
        ids = np.zeros((1, L), np.int32)
        batch = dict(input_ids=ids, target_ids=ids, loss_mask=np.ones((1, L), np.float32), segment_ids=ids + 1,
                     positions=np.arange(L, dtype=np.int32)[None])  # fmt: skip
        t = time.perf_counter()
        mem = step.lower(placed.state, batch).compile().memory_analysis()
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
        rows.append(dict(seq_len=L, context=context, peak_mib=round(peak / 2**20, 1),
                         args_mib=round(mem.argument_size_in_bytes / 2**20, 1),
                         temp_mib=round(mem.temp_size_in_bytes / 2**20, 1),
                         compile_s=round(time.perf_counter() - t, 1)))  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def memory_against_length(argv: list[str], lengths: list[int], context: int, budget_gib: float) -> dict:
    """One device and `context` host devices, each in a fresh process (the device count is
    fixed when jax starts); prints the table and returns it."""
    rest, skip = [], False
    for a in argv:
        if skip or a.startswith(("--seq-len=", "--context=")):
            skip = False
            continue
        if a in ("--seq-len", "--context"):
            skip = True
            continue
        rest.append(a)
    base = 16 * context  # the activations' share is the growth over this shortest length
    lengths = [base, *lengths]
    out = {}
    for n in sorted({1, context}):
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}",
                   JAX_PLATFORMS="cpu")  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), *rest, "--memory-of", f"{n}:{','.join(map(str, lengths))}"]
        text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        out[n] = json.loads(text[text.index("[") :])
    print(f"peak memory per device of one SFT step (1 row), MiB; budget {budget_gib} GiB per device")
    print(f"(activations: the growth of the temporaries over length {base}, whose params-sized buffers stay)")
    head = f"{'seq_len':>8} {'peak, 1':>10} {f'peak, {context}':>10} {'ratio':>6} {'act., 1':>10} {f'act., {context}':>10} {'ratio':>6}"
    print(head)
    for one, split in zip(out[1][1:], out[context][1:]):
        a1, an = one["temp_mib"] - out[1][0]["temp_mib"], split["temp_mib"] - out[context][0]["temp_mib"]
        one["activations_mib"], split["activations_mib"] = round(a1, 1), round(an, 1)
        ratio = one["peak_mib"] / split["peak_mib"]
        act = f"{a1 / an:6.2f}" if an > 0 else f"{'-':>6}"
        print(
            f"{one['seq_len']:>8} {one['peak_mib']:>10} {split['peak_mib']:>10} {ratio:>6.2f} {a1:>10.1f} {an:>10.1f} {act}"
        )
    fits = {n: max((r["seq_len"] for r in rows if r["peak_mib"] <= budget_gib * 1024), default=None)
            for n, rows in out.items()}  # fmt: skip
    print(
        f"longest length of the sweep within the budget: {fits[1]} on one device, {fits[context]} split {context} ways"
    )
    result = {"rows": out, "longest_within_budget": fits, "budget_gib": budget_gib}
    print(json.dumps(result))
    return result


def compare_lora(argv: list[str], rank: int) -> None:
    """Full fine-tuning and LoRA of `rank` on the same shape, each in a fresh process."""
    rest = [a for i, a in enumerate(argv) if a != "--lora" and (i == 0 or argv[i - 1] != "--lora")]
    rest = [a for a in rest if not a.startswith("--lora=")]
    rows = {}
    for name, r in (("full", 0), (f"lora r={rank}", rank)):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--lora-rank", str(r)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        rows[name] = json.loads(out[out.index("{") :])
    keys = ("params_M", "trainable_M", "opt_state_MiB", "max_rss_gib", "step_s_median", "tokens_per_s", "compile_s")
    print(f"{'':14}" + "".join(f"{k:>16}" for k in keys))
    for name, row in rows.items():
        print(f"{name:14}" + "".join(f"{row.get(k, ''):>16}" for k in keys))
    print(json.dumps(rows, indent=2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument(
        "--peak-only", action="store_true", help="print the matmul peak (FLOP/s) under the current flags and exit"
    )
    ap.add_argument("--lora", type=int, default=0, help="compare full fine-tuning with LoRA of this rank")
    ap.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)  # one side of --lora
    ap.add_argument("--seq-len", default="", help="comma-separated lengths: peak memory per device against length")
    ap.add_argument("--context", type=int, default=4, help="with --seq-len: the mesh.context size compared to 1")
    ap.add_argument("--device-memory-gib", type=float, default=24.0, help="with --seq-len: memory of one device")
    ap.add_argument("--memory-of", default="", help=argparse.SUPPRESS)  # N:L1,L2 (one side of --seq-len)
    args = ap.parse_args(argv)
    if args.memory_of:
        n, lengths = args.memory_of.split(":")
        print(json.dumps(step_memory(args, int(n), [int(x) for x in lengths.split(",")])))
        return
    if args.seq_len:
        lengths = [int(x) for x in args.seq_len.split(",")]
        bad = [L for L in lengths if L % args.context]
        if bad:
            ap.error(f"--seq-len {bad} do not split over --context {args.context}; pass multiples of it")
        argv = argv if argv is not None else sys.argv[1:]
        memory_against_length(argv, lengths, args.context, args.device_memory_gib)
        return
    if args.peak_only:
        print(matmul_peak(args.peak_n))
        return
    if args.lora:
        compare_lora(argv if argv is not None else sys.argv[1:], args.lora)
        return
    tune_xla_cpu(compute_dtype=args.dtype)  # as the CLI does (PTRAIN_XLA_CPU_TUNING=0 turns it off)
    print(json.dumps(dict(bench(args), xla_flags=os.environ.get("XLA_FLAGS", "")), indent=2))


if __name__ == "__main__":
    reexec_with_malloc_tuning()  # the CLI's malloc setting (PTRAIN_MALLOC_TUNING=0 turns it off)
    main()
