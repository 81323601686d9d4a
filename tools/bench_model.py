"""Model benchmark: ptrain (JAX) vs transformers (torch, 2 threads) on the same architecture.

    python tools/bench_model.py                      # everything below, one run
    python tools/bench_model.py --only decode --steps 3

Measures, in one process so both sides see the same machine load:
  train_dense  training step (forward + backward + AdamW) tokens/s, Qwen3 of 8 layers,
               d_model 512, 8/4 heads of dim 64, FFN 1536, vocab 4096, batch 8 x 512, float32
  train_moe    the same for its MoE sibling: 4 layers, 16 experts, top-4, expert FFN 256
  decode       sampled generation output tokens/s with a KV cache: batch 16, 64-token
               prompts, 128 new tokens, temperature 1.0 (no top-k / top-p), dense model
Timings are medians over --steps repetitions after one warm-up (compile) run. The
ptrain side uses float32 throughout (matmul precision "default" on CPU is float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, generate, save_hf

DENSE = ModelConfig(
    family="qwen3",
    vocab_size=4096,
    d_model=512,
    n_layers=8,
    n_heads=8,
    n_kv_heads=4,
    head_dim=64,
    d_ff=1536,
    max_seq_len=1024,
    tie_embeddings=False,
)
MOE = ModelConfig(
    family="qwen3_moe",
    vocab_size=4096,
    d_model=512,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=64,
    d_ff=1536,
    n_experts=16,
    top_k=4,
    d_ff_expert=256,
    norm_topk_prob=True,
    max_seq_len=1024,
    tie_embeddings=False,
)


def _median_time(fn, steps: int) -> float:
    fn()  # warm-up: compile / first-call allocations
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _batch(cfg: ModelConfig, B: int, L: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, L)).astype(np.int32)


# ----------------------------------------------------------------------------- ptrain


def jax_train_step_time(cfg: ModelConfig, B: int, L: int, steps: int) -> float:
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-4)
    opt = tx.init(params)
    ids = jnp.asarray(_batch(cfg, B, L))

    def loss_fn(p, ids):
        logits, aux = nnx.merge(graphdef, p, rest)(ids, return_aux=True)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        nll = -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))
        return nll + 0.001 * aux.lb_loss

    @jax.jit
    def step(p, o, ids):
        loss, g = jax.value_and_grad(loss_fn)(p, ids)
        upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o, loss

    state = {"p": params, "o": opt}

    def run():
        state["p"], state["o"], loss = step(state["p"], state["o"], ids)
        loss.block_until_ready()

    return _median_time(run, steps)


def jax_decode_time(cfg: ModelConfig, B: int, P: int, N: int, steps: int) -> float:
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompts = _batch(cfg, B, P, seed=1).tolist()
    keys = iter(jax.random.split(jax.random.key(0), steps + 1))
    return _median_time(
        lambda: generate(model, prompts, max_new_tokens=N, temperature=1.0, rng=next(keys), prompt_bucket=P), steps
    )


# ----------------------------------------------------------------------------- transformers


def _torch_model(cfg: ModelConfig):
    import torch
    import transformers

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)  # the same architecture (and weights) through our exporter
        tm = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").float()
    return tm


def torch_train_step_time(cfg: ModelConfig, B: int, L: int, steps: int) -> float:
    import torch

    tm = _torch_model(cfg).train()
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    ids = torch.tensor(_batch(cfg, B, L), dtype=torch.long)

    def run():
        opt.zero_grad(set_to_none=True)
        out = tm(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()

    return _median_time(run, steps)


def torch_decode_time(cfg: ModelConfig, B: int, P: int, N: int, steps: int) -> float:
    import torch

    tm = _torch_model(cfg).eval()
    ids = torch.tensor(_batch(cfg, B, P, seed=1), dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            tm.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=N,
                min_new_tokens=N,
                use_cache=True,
                pad_token_id=0,
            )

    return _median_time(run, steps)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        choices=["train_dense", "train_moe", "decode"],
        action="append",
        help="run only these benchmarks (repeatable); default: all",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers side")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    which = args.only or ["train_dense", "train_moe", "decode"]
    B, L = 8, 512
    DB, DP, DN = 16, 64, 128
    results = {"jax": jax.__version__, "devices": str(jax.devices()), "cpus": os.cpu_count()}
    rows = []
    for name in which:
        if name == "decode":
            unit, work = "output tokens/s", DB * DN
            ours = jax_decode_time(DENSE, DB, DP, DN, args.steps)
            ref = None if args.no_torch else torch_decode_time(DENSE, DB, DP, DN, args.steps)
        else:
            cfg = DENSE if name == "train_dense" else MOE
            unit, work = "tokens/s", B * L
            ours = jax_train_step_time(cfg, B, L, args.steps)
            ref = None if args.no_torch else torch_train_step_time(cfg, B, L, args.steps)
        r = {"ptrain": work / ours, "transformers": None if ref is None else work / ref}
        r["speedup"] = None if ref is None else ref / ours
        results[name] = r
        rows.append((name, unit, r))
        print(json.dumps({name: r}), flush=True)
    print("\n| benchmark | unit | ptrain | transformers | ptrain / transformers |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, unit, r in rows:
        t = "-" if r["transformers"] is None else f"{r['transformers']:.0f}"
        s = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"| {name} | {unit} | {r['ptrain']:.0f} | {t} | {s} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
