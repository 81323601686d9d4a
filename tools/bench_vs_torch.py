"""ptrain's SFT step against the plain torch loop, in interleaved rounds, with the ratio per round.

    python tools/bench_vs_torch.py                       # 6 rounds, 4 micro-batches, the issue's model
    python tools/bench_vs_torch.py --rounds 3 --grad-accum 4 2
    python tools/bench_vs_torch.py --untuned           # also each split with PTRAIN_XLA_CPU_TUNING=0

This machine's speed drifts by 10-30% within minutes (docs/performance.md), so a ratio is
only worth something between runs taken in the same minutes, and one pair says little. Each
round runs, in fresh processes one after another, `tools/bench_train.py` once per
`--grad-accum` value and then `tools/bench_train_torch.py` on the same model and batch. Every
round is printed as it finishes; the last line is a JSON summary with the median ratio
(torch's step time over ours: above 1 means ptrain is faster) for each split.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
# The flags both benchmarks take: the model and batch, and the warm-up and timed
# steps used for every interleaved figure in docs/performance.md.
SHARED_FLAGS = {
    "layers": 8,
    "d-model": 512,
    "heads": 8,
    "kv-heads": 4,
    "head-dim": 64,
    "d-ff": 1536,
    "vocab": 4096,
    "batch": 8,
    "seq": 512,
    "warmup": 3,
    "steps": 5,
}


def run_json(argv: list[str], extra_env: dict | None = None) -> dict:
    """Run one benchmark in a fresh process and return the JSON object it prints."""
    # Each benchmark restarts itself with its own malloc setting; a tunable inherited from
    # this process would override that choice for one side only.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    text = out.stdout
    return json.loads(text[text.index("{") :])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--grad-accum",
        type=int,
        nargs="+",
        default=[4],
        help="micro-batch splits of ptrain's step to time in every round",
    )
    ap.add_argument("--peak-n", type=int, default=4096, help="bench_train.py's matmul size for the MFU peak")
    ap.add_argument(
        "--untuned",
        action="store_true",
        help="also time each split without ptrain's XLA:CPU flag (PTRAIN_XLA_CPU_TUNING=0), "
        "reported as gaN_untuned: the flag's worth on this CPU, in the same rounds",
    )
    for name, default in SHARED_FLAGS.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    shared = [f for name in SHARED_FLAGS for f in (f"--{name}", str(getattr(args, name.replace("-", "_"))))]
    # (label, extra environment) of each ptrain run in a round.
    runs = [(f"ga{ga}", ga, {}) for ga in args.grad_accum]
    if args.untuned:
        runs += [(f"ga{ga}_untuned", ga, {"PTRAIN_XLA_CPU_TUNING": "0"}) for ga in args.grad_accum]
    rounds = []
    for r in range(1, args.rounds + 1):
        row: dict = {"round": r, "started": time.strftime("%H:%M:%S")}
        for label, ga, extra_env in runs:
            res = run_json(
                [os.path.join(TOOLS, "bench_train.py"), *shared, "--grad-accum", str(ga), "--peak-n", str(args.peak_n)],
                extra_env,
            )
            row[f"ptrain_{label}"] = {
                k: res[k] for k in ("step_s_median", "tokens_per_s", "mfu", "max_rss_gib") if k in res
            }
        torch_res = run_json([os.path.join(TOOLS, "bench_train_torch.py"), *shared])
        row["torch"] = {k: torch_res[k] for k in ("step_s_median", "tokens_per_s")}
        for label, _, _ in runs:
            row[f"ratio_{label}"] = round(torch_res["step_s_median"] / row[f"ptrain_{label}"]["step_s_median"], 3)
        rounds.append(row)
        cells = "  ".join(
            f"{label} {row[f'ptrain_{label}']['step_s_median']:.3f} s ({row[f'ratio_{label}']:.2f}x)"
            for label, _, _ in runs
        )
        print(f"round {r} ({row['started']}): {cells}  torch {torch_res['step_s_median']:.3f} s", flush=True)
    summary = {
        f"median_ratio_{label}": round(statistics.median(row[f"ratio_{label}"] for row in rounds), 3)
        for label, _, _ in runs
    }
    print(json.dumps({**summary, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
