"""Seconds per DPO step of ptrain on this machine (policy + frozen reference in the step).

    python tools/bench_dpo.py                      # 8 pairs x 512 tokens, the 8-layer d 512 model
    python tools/bench_dpo.py --precompute         # reference log-probs given (precomputed pass)

The reference model is recomputed inside every step (as TRL's DPOTrainer does without
precomputation), unless --precompute. Median over the timed steps after compile and warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptrain.config import DPOAlgoConfig, OptimConfig  # noqa: E402
from ptrain.models import Decoder  # noqa: E402
from ptrain.runtime import reexec_with_malloc_tuning, tune_xla_cpu
from ptrain.train.objectives import dpo_denominator, make_dpo_objective  # noqa: E402
from ptrain.train.optim import make_optimizer  # noqa: E402
from ptrain.train.state import init_train_state, split_model  # noqa: E402
from ptrain.train.step import make_train_step  # noqa: E402
from tools.bench_train import add_model_args, model_config, time_steps  # noqa: E402


def preference_batch(pairs: int, seq: int, vocab: int, prompt: int) -> dict:
    rng = np.random.default_rng(0)
    out = {"pair_index": np.arange(pairs, dtype=np.int32)}
    for side in ("chosen", "rejected"):
        ids = rng.integers(0, vocab, (pairs, seq + 1)).astype(np.int32)
        mask = np.zeros((pairs, seq), np.float32)
        mask[:, prompt:] = 1.0
        out.update(
            {
                f"{side}_input_ids": ids[:, :-1],
                f"{side}_target_ids": ids[:, 1:],
                f"{side}_loss_mask": mask,
                f"{side}_segment_ids": np.ones((pairs, seq), np.int32),
                f"{side}_positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (pairs, seq)).copy(),
            }
        )
    return out


def bench(args) -> dict:
    cfg = model_config(args)
    model_def, params, rest = split_model(Decoder(cfg, rngs=nnx.Rngs(0)))
    tx, lr = make_optimizer(OptimConfig(lr=1e-6, schedule="constant"), 1000)
    objective = make_dpo_objective(model_def, DPOAlgoConfig(kind="sigmoid", beta=0.1), vocab_chunk=args.vocab_chunk)
    step = jax.jit(make_train_step(objective, dpo_denominator, tx, lr, grad_accum=args.grad_accum), donate_argnums=(0,))
    batch = preference_batch(args.batch, args.seq, args.vocab, args.seq // 4)
    if args.precompute:
        batch.update(
            ref_chosen_logps=np.full(args.batch, -900.0, np.float32),
            ref_rejected_logps=np.full(args.batch, -900.0, np.float32),
        )
        state = init_train_state(params, tx, seed=0, model_state=rest)
    else:
        state = init_train_state(params, tx, seed=0, model_state=rest, ref_params=jax.tree.map(np.array, params))
    usage: dict = {}
    compile_s, step_s, _, m = time_steps(
        step, state, jax.device_put(batch), args.warmup, args.steps, usage, args.pause_ms / 1000
    )
    return {
        "pairs": args.batch,
        "grad_accum": args.grad_accum,
        "seq": args.seq,
        "reference": "precomputed" if args.precompute else "in step",
        "compile_s": round(compile_s, 1),
        "step_s_median": round(step_s, 3),
        "tokens_per_s": round(2 * args.batch * args.seq / step_s, 1),
        "loss": round(float(m["loss"]), 4),
        **usage,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--precompute", action="store_true", help="reference log-probs given in the batch")
    ap.set_defaults(steps=5)
    args = ap.parse_args(argv)
    tune_xla_cpu(compute_dtype=args.dtype)  # as the CLI does (PTRAIN_XLA_CPU_TUNING=0 turns it off)
    print(json.dumps(dict(bench(args), xla_flags=os.environ.get("XLA_FLAGS", "")), indent=2))


if __name__ == "__main__":
    reexec_with_malloc_tuning()  # the CLI's malloc setting (PTRAIN_MALLOC_TUNING=0 turns it off)
    main()
