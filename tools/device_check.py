"""The first look at an accelerator: one table of four numbers against their goals, in under 10 minutes.

    python tools/device_check.py                      # one GPU (H100/H200) or a TPU VM
    python tools/device_check.py --json out.json      # also write the table
    python tools/device_check.py --only sft --only decode   # some rows only (a rerun)
    python tools/device_check.py --dry-run            # every row on CPU at toy shapes (seconds each)

Rows, each measured by the benchmark tool that owns it (imported, not copied):

  grouped matmul   Pallas grouped matmul (pallas_gpu / pallas_tpu) at 8 experts against a dense
                   bf16 GEMM of the same FLOPs, forward + backward and forward
                   (tools/device_check_moe.py's bench_speed: its shapes and tilings).
                   Goal: >= 70% of the dense GEMM's TFLOP/s.
  SFT step MFU     the real SFT train step (forward, backward, AdamW) of a 0.9B dense model in
                   bf16 (tools/bench_train.py's bench): tokens/s x training FLOPs per token
                   (ptrain.models.flops_per_token) / the device's peak, measured as the best
                   bf16 matmul rate; the datasheet peak is printed beside it. Goal: >= 45%.
  engine decode    LocalEngine's decode tokens/s (prefill left out: a run of N new tokens less
                   a run of one) against the memory-bandwidth floor: each decode step reads the
                   weights once plus every row's keys and values, so at most
                   batch x bandwidth / bytes per step tokens/s. Bandwidth: a large read,
                   measured (tools/bench_engine.py's memory_rate); the datasheet figure beside.
  GRPO step        one synchronous GRPO step of the real stage, split into generation,
                   reward, batch building, train step and weight sync (tools/bench_grpo.py's
                   run_mode) at a small shape.

Everything runs in this one process (a second process cannot open a TPU this one holds).
Shapes come from one dict per mode (SHAPES); --dry-run takes the toy one and runs on CPU,
so the same code paths run in the tests and the script cannot rot. There the goals read
"n/a on cpu". Each row runs on its own: one that fails is reported and the others still run;
the exit code is 1 when a row could not be measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ROWS = ("gmm", "sft", "decode", "grpo")

# The 1B dense model of the SFT and decode rows on an accelerator; the GRPO row uses the
# 8-layer d512 benchmark model of tools/bench_model.py in bf16 (its own vocabulary).
SHAPES = {
    "accelerator": {
        "model": dict(layers=16, d_model=2048, heads=16, kv_heads=8, head_dim=128, d_ff=5632, vocab=32000, seq=2048),
        "gmm": dict(rows=65536, d_model=2048, d_ff=1024),
        "sft": dict(batch=4, warmup=2, steps=5),  # ~45 GB with AdamW in float32: fits an 80 GB H100
        "peak": dict(bf16_matmul_n=8192, read_mib=4096),
        "decode": dict(batch=64, prompt=128, new_tokens=256, decode_steps=8, rounds=3),
        "grpo": dict(
            model=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=1536, dtype="bfloat16"),
            prompts=8,
            group=8,
            new_tokens=64,
            warmup=1,
            steps=3,
        ),
    },
    "dry_run": {
        "model": dict(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16, d_ff=128, vocab=256, seq=64),
        "gmm": dict(rows=256, d_model=64, d_ff=32),
        "sft": dict(batch=2, warmup=1, steps=2),
        "peak": dict(bf16_matmul_n=256, read_mib=16),
        "decode": dict(batch=4, prompt=16, new_tokens=16, decode_steps=4, rounds=1),
        "grpo": dict(model=dict(dtype="bfloat16"), prompts=2, group=2, new_tokens=8, warmup=0, steps=1),
    },
}

GOALS = {
    "gmm": ("% of dense", 70.0, ">= 70% of dense bf16 GEMM"),
    "sft": ("% MFU", 45.0, ">= 45% MFU"),
    "decode": ("% of floor", None, "none set (recorded)"),
    "grpo": ("s/step", None, "none set (recorded)"),
}
"""Per row: unit of the value, the goal's threshold (value >= it passes; None: no goal yet), its words."""

# Datasheet dense bf16 FLOP/s and memory bandwidth (bytes/s), matched in order against
# jax's device_kind (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200", "TPU v5 lite").
DATASHEET = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.0e12),
    ("TPU v6 lite", 918e12, 1.64e12),
    ("TPU v5 lite", 197e12, 0.819e12),
    ("TPU v5", 459e12, 2.765e12),
    ("TPU v4", 275e12, 1.2e12),
)


def datasheet(device_kind: str) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, bytes/s) of the device from its datasheet, or (None, None) when unknown."""
    for name, flops, bandwidth in DATASHEET:
        if name.lower() in device_kind.lower():
            return flops, bandwidth
    return None, None


# ----------------------------------------------------------------------------- the device's rates


def bf16_matmul_peak(n: int) -> float:
    """FLOP/s of a jitted bf16 n x n matmul (float32 accumulation), median of
    tools/device_check_moe.py's timing: the peak the SFT row's MFU divides by."""
    import jax
    import jax.numpy as jnp

    from tools.device_check_moe import _bench

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / _bench(f, a, b)


# ----------------------------------------------------------------------------- rows


def row_grouped_matmul(shape: dict, platform: str, device_kind: str) -> dict:
    """Pallas grouped matmul at 8 experts against the dense bf16 GEMM, best tiling."""
    from tools.device_check_moe import bench_speed

    impl = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "pallas_gpu_interpret")
    results: list[dict] = []
    bench_speed(impl, results, **shape["gmm"], experts=(8,))
    at8 = next(r for r in results if r["experts"] == 8)
    value = min(at8["fwdbwd_pct_dense"], at8["fwd_pct_dense"])
    detail = (
        f"{impl}, tiling {at8['tiling']}: fwd+bwd {at8['fwdbwd_tflops']:.3g} TFLOP/s = "
        f"{at8['fwdbwd_pct_dense']:.0f}% of dense, fwd {at8['fwd_tflops']:.3g} = {at8['fwd_pct_dense']:.0f}% "
        f"(value: the lower); {shape['gmm']['rows']} rows x {shape['gmm']['d_model']} x {shape['gmm']['d_ff']}"
    )
    return dict(value=value, detail=detail, data=dict(implementation=impl, results=results))


def sft_args(shape: dict) -> argparse.Namespace:
    """tools/bench_train.py's arguments (its defaults) at this mode's model and batch, bf16."""
    from tools.bench_train import add_model_args

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    args = ap.parse_args([])
    vars(args).update(shape["model"], dtype="bfloat16", remat="none", lora_rank=0)
    sft = shape["sft"]
    args.batch, args.warmup, args.steps = sft["batch"], sft["warmup"], sft["steps"]
    return args


def row_sft_mfu(shape: dict, platform: str, device_kind: str) -> dict:
    """MFU of the real SFT step against the measured bf16 matmul peak (datasheet beside it)."""
    from ptrain.models import flops_per_token
    from tools import bench_train

    args = sft_args(shape)
    peak = bf16_matmul_peak(shape["peak"]["bf16_matmul_n"])
    # bench()'s own peak is a float32 matmul timed here and again in a child process (which
    # cannot open a TPU this process holds, and contends for a GPU's memory): the bf16 peak.
    result = bench_train.bench(args, peak=peak)
    achieved = result["tokens_per_s"] * flops_per_token(bench_train.model_config(args), args.seq)
    sheet, _ = datasheet(device_kind)
    vs_sheet = f", {100 * achieved / sheet:.1f}% of the datasheet {sheet / 1e12:.0f} TFLOP/s" if sheet else ""
    detail = (
        f"{result['params_M']:.1f}M params, batch {result['batch']}: {result['tokens_per_s']:.0f} tok/s, "
        f"{achieved / 1e12:.3g} TFLOP/s / measured bf16 peak {peak / 1e12:.3g} TFLOP/s{vs_sheet}; "
        f"step {result['step_s_median']} s, compile {result['compile_s']} s"
    )
    data = dict(result, bf16_peak_tflops=peak / 1e12, achieved_tflops=achieved / 1e12, datasheet_bf16_flops=sheet)
    return dict(value=100 * achieved / peak, detail=detail, data=data)


def decode_floor(cfg, param_itemsize: int, kv_bytes_per_token: float, batch: int, context: float, bandwidth: float):
    """(bytes read per decode step, tokens/s at most): the weights once (every matmul, the
    output head included; the embedding is a gather) plus every row's keys and values."""
    from ptrain.models import count_params

    weight_bytes = (count_params(cfg, embedding=False) + cfg.vocab_size * cfg.d_model) * param_itemsize
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    return step_bytes, batch * bandwidth / step_bytes


def row_engine_decode(shape: dict, platform: str, device_kind: str) -> dict:
    """LocalEngine's decode tokens/s (bf16 weights) as a fraction of the bandwidth floor."""
    import numpy as np
    from flax import nnx

    from ptrain.models import Decoder
    from ptrain.rollout.local import LocalEngine
    from ptrain.rollout.protocol import GenerateRequest, SamplingParams
    from tools.bench_engine import memory_rate
    from tools.bench_train import model_config

    d = shape["decode"]
    B, P, N = d["batch"], d["prompt"], d["new_tokens"]
    # Served weights in bf16: what each decode step reads.
    cfg = dataclasses.replace(
        model_config(argparse.Namespace(**shape["model"], dtype="bfloat16", remat="none")), param_dtype="bfloat16"
    )
    engine = LocalEngine(Decoder(cfg, rngs=nnx.Rngs(0)), max_running_requests=B, context_length=P + N + 16,
                         decode_steps=d["decode_steps"])  # fmt: skip
    prompts = np.random.default_rng(1).integers(5, cfg.vocab_size, (B, P)).tolist()

    def run(new_tokens: int) -> float:
        """Seconds to generate new_tokens per row for all rows, prefix cache flushed first."""
        engine.flush_cache()
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
        t = time.perf_counter()
        outs = engine.generate_many([GenerateRequest(p, sp) for p in prompts])
        elapsed = time.perf_counter() - t
        assert all(len(o[0].output_ids) == new_tokens for o in outs)
        return elapsed

    try:
        run(N), run(1)  # compile
        full = statistics.median(run(N) for _ in range(d["rounds"]))
        prefill = statistics.median(run(1) for _ in range(d["rounds"]))
        kv_bytes_per_token = engine.kv_cache_bytes / (B * engine.context_length)
    finally:
        engine.close()
    tokens_per_s = B * (N - 1) / max(full - prefill, 1e-9)
    measured = memory_rate(shape["peak"]["read_mib"]) * 1e9
    step_bytes, floor = decode_floor(cfg, 2, kv_bytes_per_token, B, P + N / 2, measured)
    _, sheet = datasheet(device_kind)
    vs_sheet = ""
    if sheet:
        vs_sheet = f"; datasheet {sheet / 1e9:.0f} GB/s: {100 * tokens_per_s / (B * sheet / step_bytes):.0f}%"
    detail = (
        f"batch {B}, prompt {P}, {N} new tokens: {tokens_per_s:.0f} tok/s; floor {floor:.0f} tok/s "
        f"({step_bytes / 1e6:.4g} MB per step at a measured {measured / 1e9:.4g} GB/s read){vs_sheet}"
    )
    data = dict(tokens_per_s=tokens_per_s, floor_tokens_per_s=floor, bytes_per_step=step_bytes,
                measured_bandwidth=measured, datasheet_bandwidth=sheet, run_s=full, prefill_only_s=prefill)  # fmt: skip
    return dict(value=100 * tokens_per_s / floor, detail=detail, data=data)


def grpo_args(shape: dict) -> argparse.Namespace:
    """tools/bench_grpo.py's arguments for one sync step at this mode's shape.

    small=True takes its 2-layer model as the base (this mode's overrides reshape it) and its
    in-process rate probes: its floor is not used here, and a second process probing the
    device would contend with this one."""
    g = shape["grpo"]
    return argparse.Namespace(
        small=True, tokenizer=None, warmup=g["warmup"], steps=g["steps"], grad_accum=1, prompts=g["prompts"],
        group=g["group"], new_tokens=g["new_tokens"], decode_steps=8,
        override=[f"model.{k}={v}" for k, v in g["model"].items()],
    )  # fmt: skip


def row_grpo_split(shape: dict, platform: str, device_kind: str) -> dict:
    """Median seconds of a sync GRPO step and its split, as the trainer's thread sees it."""
    from tools.bench_grpo import run_mode

    r = run_mode(grpo_args(shape), "sync")
    m = r["median"]
    parts = ("generate_s", "reward_s", "batch_s", "train_s", "sync_s")
    split = ", ".join(f"{k[:-2]} {m[k]:.3f}" for k in parts)
    g = shape["grpo"]
    detail = (
        f"{g['prompts']} prompts x {g['group']} samples, <= {g['new_tokens']} new tokens: {split} s "
        f"(batch: advantages and rows; no reference model at kl 0; old log-probs only with several "
        f"epochs or mini-batches); {m['output_tokens'] / max(m['generate_s'], 1e-9):.0f} tok/s generating"
    )
    return dict(value=m["step_s"], detail=detail, data={k: r[k] for k in ("median", "seq_len", "steps_timed")})


RUNNERS = {
    "gmm": ("grouped matmul, E=8, vs dense bf16", row_grouped_matmul),
    "sft": ("SFT step MFU, dense bf16", row_sft_mfu),
    "decode": ("engine decode vs bandwidth floor", row_engine_decode),
    "grpo": ("GRPO step time split", row_grpo_split),
}


# ----------------------------------------------------------------------------- table


def judge(key: str, value: float | None, on_cpu: bool) -> tuple[str, str]:
    """(goal, pass) cells of a row."""
    _, threshold, words = GOALS[key]
    if on_cpu:
        return "n/a on cpu", "-"
    if value is None:
        return words, "error"
    if threshold is None:
        return words, "-"
    return words, "yes" if value >= threshold else "NO"


def format_table(rows: list[dict]) -> str:
    lines = ["| check | value | goal | pass | detail |", "|---|---|---|---|---|"]
    for r in rows:
        value = "error" if r["value"] is None else f"{r['value']:.3g} {r['unit']}"
        lines.append(f"| {r['check']} | {value} | {r['goal']} | {r['pass']} | {r['detail']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every row on CPU at toy shapes")
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--only", action="append", choices=ROWS, help="run this row (repeatable; default: all)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    platform = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    if platform == "cpu" and not args.dry_run:
        print("no GPU or TPU here: the accelerator shapes would take hours on CPU; pass --dry-run", file=sys.stderr)
        return 2
    mode = "dry_run" if args.dry_run else "accelerator"
    shape = SHAPES[mode]
    print(f"jax {jax.__version__} on {platform}: {device_kind} x{jax.device_count()}; shapes: {mode}", flush=True)
    t_start = time.perf_counter()
    rows = []
    for key in args.only or ROWS:
        check, runner = RUNNERS[key]
        t = time.perf_counter()
        try:
            out = runner(shape, platform, device_kind)
        except Exception as e:  # report and carry on: one broken row must not hide the others
            traceback.print_exc()
            out = dict(value=None, detail=f"{type(e).__name__}: {str(e)[:300]}", data={})
        goal, passed = judge(key, out["value"], platform == "cpu")
        row = dict(key=key, check=check, value=out["value"], unit=GOALS[key][0], goal=goal, detail=out["detail"])
        row.update({"pass": passed, "seconds": round(time.perf_counter() - t, 1), "data": out["data"]})
        rows.append(row)
        print(f"[{key}] {row['seconds']} s: {out['value']} {row['unit']}; {out['detail']}", flush=True)
    total = time.perf_counter() - t_start
    print(f"\n{device_kind} ({platform}), {mode} shapes, {total:.0f} s\n")
    print(format_table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(platform=platform, device_kind=device_kind, mode=mode, shapes=shape, seconds=total,
                           rows=rows), f, indent=1, default=str)  # fmt: skip
    return 1 if any(r["value"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
