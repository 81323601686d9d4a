"""Turn a run's metrics.jsonl files into PNG curves.

    python tools/plot_run.py runs/sft_arithmetic            # every stage of a run
    python tools/plot_run.py runs/x/stages/sft/metrics.jsonl --keys train/loss eval/exact_match
    python tools/plot_run.py runs/continuous                # a continuous run: leaderboard.png too

Writes one PNG per metric next to each metrics.jsonl (or into --out), train and eval
series of the same name on one figure; for RL stages also `rewards_by_env.png`, every
environment's training reward (train/reward/<env>/mean) and held-out reward
(eval/<env>/reward) on one figure. A continuous run's folder (leaderboard.jsonl) also gets
leaderboard.png: each environment's held-out score by round, promotions marked, and the held-out
gain per dollar (ptrain/continuous/ledger.py draws it; the loop redraws it after every round).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict


def read_series(path: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{n}: skipping a line that is not JSON (cut by a kill?)", file=sys.stderr)
                continue
            for k, v in rec.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    series[k].append((rec["step"], float(v)))
    return series


def plot(path: str, out_dir: str, keys: list[str] | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_series(path)
    by_name: dict[str, dict[str, list]] = defaultdict(dict)
    for key, pts in series.items():
        if keys and key not in keys:
            continue
        prefix, _, name = key.partition("/")
        by_name[name or prefix][prefix] = pts
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, groups in sorted(by_name.items()):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for prefix, pts in sorted(groups.items()):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=prefix)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        target = os.path.join(out_dir, name.replace("/", "_") + ".png")
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    per_env = {k: v for k, v in series.items() if _env_reward(k)}
    if per_env and not keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, pts in sorted(per_env.items()):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=_env_reward(key))
        ax.set_xlabel("step")
        ax.set_title("reward per environment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        target = os.path.join(out_dir, "rewards_by_env.png")
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


def _env_reward(key: str) -> str | None:
    """'<env> train' for train/reward/<env>/mean, '<env> held-out' for eval/<env>/reward and
    '<env> held-out, sampled' for eval/<env>/sampled/reward (eval/sampled/reward is the mean
    over environments, left out)."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "train" and parts[1] == "reward" and parts[3] == "mean":
        return f"{parts[2]} train"
    if len(parts) == 3 and parts[0] == "eval" and parts[2] == "reward" and parts[1] != "sampled":
        return f"{parts[1]} held-out"
    if len(parts) == 4 and parts[0] == "eval" and parts[2:] == ["sampled", "reward"]:
        return f"{parts[1]} held-out, sampled"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a run directory, a stage directory or a metrics.jsonl file")
    ap.add_argument("--keys", nargs="*", help="only these metrics (e.g. train/loss eval/exact_match)")
    ap.add_argument("--out", help="output folder (default: <stage>/plots)")
    args = ap.parse_args(argv)
    if os.path.isfile(os.path.join(args.path, "leaderboard.jsonl")):
        from ptrain.continuous.ledger import plot_leaderboard

        print(plot_leaderboard(args.path, os.path.join(args.out, "leaderboard.png") if args.out else None))
    if os.path.isfile(args.path):
        files = [args.path]
    else:
        files = sorted(glob.glob(os.path.join(args.path, "**", "metrics.jsonl"), recursive=True))
    if not files:
        print(f"no metrics.jsonl under '{args.path}'; pass a run directory of ptrain", file=sys.stderr)
        return 2
    for f in files:
        out = args.out or os.path.join(os.path.dirname(f), "plots")
        for w in plot(f, out, args.keys):
            print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
