"""What the loop writes and reads back: its state, the champion pointer, each round's cost, the
leaderboard and its figure. No JAX; every write is atomic (a kill at any moment leaves the
old file or the whole new one).

    R/continuous.json        the loop's state (envs taken in, champion, the round under way)
    R/champion               symlink to the champion's Hugging Face folder
    R/envs/<name>.yaml       each environment as taken in (frozen)
    R/rounds/<k>/            manifest.json, decision.json, config.yaml, stages/
    R/leaderboard.jsonl      one line per decided round (rebuilt from the decision files)
    R/leaderboard.png        held-out score per environment by round, promotions marked,
                             and held-out gain per dollar
    R/rollbacks.jsonl        one line per rollback
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from ptrain.checkpoint import write_json_atomic

STATE = "continuous.json"
CHAMPION = "champion"
LEADERBOARD = "leaderboard.jsonl"
ROLLBACKS = "rollbacks.jsonl"


def round_dir(run_dir: str, k: int) -> str:
    return os.path.join(run_dir, "rounds", str(k))


def load_state(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, STATE)
    if not os.path.isfile(path):
        return {"envs": {}, "champion": None, "champion_round": None, "champion_evals": [], "current": None,
                "next_round": 0, "last_round_end": None, "trigger_lines": 0}  # fmt: skip
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise ValueError(
                f"{path} cannot be read ({e}); it is the continuous loop's state: restore it from a backup, or "
                "start a new run_dir"
            ) from None


def save_state(run_dir: str, state: Mapping[str, Any]) -> None:
    write_json_atomic(os.path.join(run_dir, STATE), dict(state))


def set_champion(run_dir: str, export: str) -> None:
    """Point R/champion at `export` in one rename (readers see the old or the new one)."""
    link = os.path.join(run_dir, CHAMPION)
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(os.path.abspath(export), os.path.abspath(run_dir)), tmp)
    os.replace(tmp, link)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last line
                continue
    return out


def stage_seconds(metrics_path: str) -> dict[str, float]:
    """An RL stage's time split from its metrics.jsonl: sample (generation, or the trainer's
    wait for it when asynchronous), train (the rest of each step), and its token counts."""
    out = {"sample_s": 0.0, "train_s": 0.0, "prompt_uncached": 0.0, "prompt_cached": 0.0, "output": 0.0}
    for rec in read_jsonl(metrics_path):
        if "train/time/rl_step_s" not in rec:
            continue
        sample = float(rec.get("train/time/generate_s", rec.get("train/time/rollout_wait_s", 0.0)))
        out["sample_s"] += sample
        out["train_s"] += max(float(rec["train/time/rl_step_s"]) - sample, 0.0)
        out["prompt_uncached"] += float(rec.get("train/tokens/prompt_uncached", 0.0))
        out["prompt_cached"] += float(rec.get("train/tokens/prompt_cached", 0.0))
        out["output"] += float(rec.get("train/tokens/output", 0.0))
    return out


def eval_tokens(summary: Mapping[str, Any]) -> dict[str, float]:
    """Token counts of an eval stage's DONE.json (every decoding of every environment)."""
    out = {"prompt_uncached": 0.0, "prompt_cached": 0.0, "output": 0.0}
    for key, value in summary.items():
        for name, field in (("prompt_uncached", "tokens_prompt_uncached"), ("prompt_cached", "tokens_prompt_cached"),
                            ("output", "tokens_output")):  # fmt: skip
            if key.endswith("/" + field):
                out[name] += float(value)
    return out


def round_cost(cost_cfg, hour_usd: float, rl: Mapping[str, float], evals: list[Mapping[str, Any]]) -> dict:
    """The round's ledger: dollars split into sample, train, eval and judge, and its tokens.
    rl: stage_seconds of the round's RL stage; evals: the DONE.json of its eval stages. The
    judge's share is the judge calls an environment makes inside sampling (0 where none)."""
    per_s = hour_usd / 3600
    ev = {"prompt_uncached": 0.0, "prompt_cached": 0.0, "output": 0.0}
    eval_s = 0.0
    for summary in evals:
        eval_s += float(summary.get("wall_time_s", 0.0))
        for k, v in eval_tokens(summary).items():
            ev[k] += v
    sample = rl["sample_s"] * per_s + cost_cfg.tokens_usd(rl["prompt_uncached"], rl["prompt_cached"], rl["output"])
    cost = {
        "sample": sample,
        "train": rl["train_s"] * per_s,
        "eval": eval_s * per_s + cost_cfg.tokens_usd(ev["prompt_uncached"], ev["prompt_cached"], ev["output"]),
        "judge": 0.0,
    }
    cost["total"] = sum(cost.values())
    tokens = {
        "input": int(rl["prompt_uncached"] + ev["prompt_uncached"]),
        "cached_input": int(rl["prompt_cached"] + ev["prompt_cached"]),
        "output": int(rl["output"] + ev["output"]),
    }
    return {"cost_usd": cost, "tokens": tokens, "hour_usd": hour_usd}


def decisions(run_dir: str) -> list[dict]:
    """Every decided round's decision.json, by round."""
    rows = []
    for path in glob.glob(os.path.join(run_dir, "rounds", "*", "decision.json")):
        with open(path) as f:
            rows.append(json.load(f))
    return sorted(rows, key=lambda r: r["round"])


def write_leaderboard(run_dir: str) -> list[dict]:
    """Rebuild R/leaderboard.jsonl from the decision files (idempotent: a re-launch after a
    kill between a decision and this write writes the same lines)."""
    rows, total = [], 0.0
    for d in decisions(run_dir):
        total += float(d["cost_usd"]["total"])
        rows.append({**d, "cum_cost_usd": total})
    path = os.path.join(run_dir, LEADERBOARD)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return rows


def log_rollback(run_dir: str, record: Mapping[str, Any]) -> None:
    with open(os.path.join(run_dir, ROLLBACKS), "a") as f:
        f.write(json.dumps({"time": time.time(), **record}, default=float) + "\n")


def plot_leaderboard(run_dir: str, out: str | None = None) -> str | None:
    """Draw R/leaderboard.png (or `out`): each environment's held-out score by round (the
    champion after the round's decision), promotions marked, and the round's held-out gain per
    dollar. None when there is nothing to draw yet."""
    rows = read_jsonl(os.path.join(run_dir, LEADERBOARD))
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({e for r in rows for e in r["envs"]})
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for env in envs:
        seen = [r for r in rows if env in r["envs"]]
        # Where an environment arrives, its line starts at the champion's score before the round.
        first = seen[0]
        pts = [(first["round"] - 0.5, first["envs"][env]["champion"])] if first["round"] > 0 else []
        pts += [(r["round"], r["envs"][env]["champion_after"]) for r in seen]
        xs, ys = zip(*pts)
        (line,) = ax.plot(xs, ys, marker="o", label=env)
        if first["round"] > 0:
            ax.plot(xs[:1], ys[:1], marker="o", mfc="white", color=line.get_color())
    for r in rows:
        if r["round"] > 0:
            color = "tab:green" if r["decision"] == "promoted" else "tab:red"
            ax.axvline(r["round"], color=color, alpha=0.25, lw=6)
    ax.set_ylabel("held-out score (champion)")
    ax.set_title("champion's held-out score by round (o: before an arrival); green promoted, red rejected", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    xs = [r["round"] for r in rows if r["round"] > 0]
    ax2.bar(xs, [r["reward_gain_per_usd"] for r in rows if r["round"] > 0], color="tab:blue", width=0.5)
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("held-out gain per $")
    ax2.set_xlabel("round")
    ax2.grid(alpha=0.3)
    path = out or os.path.join(run_dir, "leaderboard.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path
