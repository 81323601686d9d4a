"""The promotion gate: the challenger against the champion on every environment's frozen
held-out tasks, plus reward-hacking tripwires. Pure functions of numbers (numpy only).

Per environment the two models' per-task scores are paired by task id; the gate reads the
mean difference and a paired bootstrap confidence interval over tasks (percentile method:
resample the tasks with replacement, take the mean difference, read its quantiles).

    improved(env)      ci_low > 0
    non_inferior(env)  ci_low >= -margin
    promote            (any | all | none) target environments improved, every environment is
                       non-inferior, no tripwire tripped, and the judge in the loop (if any)
                       agrees with its calibration set as well as before
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One environment's held-out score of both models."""

    env: str
    champion: float
    challenger: float
    delta: float
    ci_low: float
    ci_high: float
    n: int

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "env"}


def paired_bootstrap(
    champion: Mapping[str, float],
    challenger: Mapping[str, float],
    *,
    env: str = "",
    confidence: float = 0.95,
    samples: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Compare per-task scores {task id: score} of the same held-out tasks. Raises ValueError
    when the task sets differ (a held-out split that moved measures nothing)."""
    if set(champion) != set(challenger):
        only = sorted(set(champion) ^ set(challenger))[:5]
        raise ValueError(
            f"environment {env!r}: the champion and the challenger were scored on different held-out tasks "
            f"(e.g. {only}); both must see the environment's frozen eval split"
        )
    if not champion:
        raise ValueError(f"environment {env!r}: no held-out tasks were scored (envs.{env}.n_eval must be >= 1)")
    ids = sorted(champion)
    a = np.asarray([champion[i] for i in ids], np.float64)
    b = np.asarray([challenger[i] for i in ids], np.float64)
    d = b - a
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(samples, len(d)))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return Comparison(env, float(a.mean()), float(b.mean()), float(d.mean()), float(lo), float(hi), len(d))


@dataclasses.dataclass(frozen=True)
class Tripwire:
    """One tripwire's reading: `value` against `limit` (a rise over the champion, a ratio, or
    an absolute KL, as the name says)."""

    name: str
    env: str | None
    value: float
    limit: float
    tripped: bool

    def reason(self) -> str:
        where = f" on {self.env}" if self.env else ""
        return f"tripwire {self.name}{where}: {self.value:.4g} beyond the limit {self.limit:.4g}"


RISES = {
    # tripwire name -> (per-environment metric of ptrain.stages.env_metrics, sign): the rise of
    # sign * metric from champion to challenger is compared with the limit.
    "invalid_tool_calls": ("invalid_tool_calls", 1.0),
    "hallucinated_tool_calls": ("hallucinated_tool_calls", 1.0),
    "abstentions": ("abstained", 1.0),
    "format_errors": ("formatted", -1.0),
}


def tripwires(
    champion: Mapping[str, Mapping[str, float]],
    challenger: Mapping[str, Mapping[str, float]],
    limits,
    *,
    kl: float | None = None,
) -> list[Tripwire]:
    """Readings of every tripwire that applies. `champion` / `challenger`: per environment,
    its held-out metrics ({"formatted": .., "response_length": .., ...}); `limits` a
    TripwireConfig (null limits are off); `kl` the challenger's KL to the champion (None: not
    measured)."""
    out: list[Tripwire] = []
    for env in sorted(set(champion) & set(challenger)):
        old, new = champion[env], challenger[env]
        for name, (metric, sign) in RISES.items():
            limit = getattr(limits, name)
            if limit is None or metric not in old or metric not in new:
                continue
            rise = sign * (float(new[metric]) - float(old[metric]))
            out.append(Tripwire(name, env, rise, float(limit), rise > limit))
        ratio_limit = limits.length_ratio
        if ratio_limit is not None and "response_length" in old and "response_length" in new:
            ratio = float(new["response_length"]) / max(float(old["response_length"]), 1.0)
            out.append(Tripwire("length_ratio", env, ratio, float(ratio_limit), ratio > ratio_limit))
    if limits.kl is not None and kl is not None:
        out.append(Tripwire("kl", None, float(kl), float(limits.kl), float(kl) > limits.kl))
    return out


def decide(
    comparisons: Sequence[Comparison],
    targets: Sequence[str],
    readings: Sequence[Tripwire],
    *,
    margin: float,
    improve: str = "any",
    judge_drop: float | None = None,
    judge_limit: float = 0.05,
) -> tuple[str, list[str]]:
    """("promoted" | "rejected", reasons). Reasons say why a round was rejected, or what a
    promotion rests on. judge_drop: how far the judge's calibration agreement fell this round
    (None: no judge in the loop), refused past judge_limit."""
    by_env = {c.env: c for c in comparisons}
    missing = [t for t in targets if t not in by_env]
    if missing:
        raise ValueError(f"target environments {missing} were not evaluated; evaluated: {sorted(by_env)}")
    reasons: list[str] = []
    regressed = [c for c in comparisons if c.ci_low < -margin]
    for c in regressed:
        reasons.append(
            f"{c.env} regressed: {c.champion:.3f} -> {c.challenger:.3f}, interval [{c.ci_low:.3f}, {c.ci_high:.3f}] "
            f"reaches below -margin ({-margin:g})"
        )
    improved = [t for t in targets if by_env[t].ci_low > 0]
    enough = {"any": bool(improved), "all": len(improved) == len(targets), "none": True}[improve]
    if not enough:
        flat = ", ".join(
            f"{t} {by_env[t].delta:+.3f} [{by_env[t].ci_low:.3f}, {by_env[t].ci_high:.3f}]" for t in targets
        )
        reasons.append(f"no improvement on the targets ({improve} must have an interval above 0): {flat}")
    reasons.extend(t.reason() for t in readings if t.tripped)
    if judge_drop is not None and judge_drop > judge_limit:
        reasons.append(f"the judge's calibration agreement fell by {judge_drop:.3f} (more than {judge_limit:g})")
    if reasons:
        return "rejected", reasons
    why = [f"{t} improved {by_env[t].delta:+.3f} [{by_env[t].ci_low:.3f}, {by_env[t].ci_high:.3f}]" for t in improved]
    return "promoted", why or [f"non-inferior on every environment within {margin:g}, no tripwire tripped"]


def live_drop(rows: Sequence[Mapping], held_out: Mapping[str, float], *, window: int, drop: float) -> str | None:
    """Why a round should start on live outcomes, or None. rows: `{"env": name, "correct": 0|1}`
    lines not yet looked at; held_out: the champion's held-out score per environment. An
    environment triggers when its last `window` lines pass at `drop` or more below that score."""
    by_env: dict[str, list[float]] = {}
    for r in rows:
        if isinstance(r, Mapping) and r.get("env") in held_out and isinstance(r.get("correct"), int | float):
            by_env.setdefault(str(r["env"]), []).append(float(r["correct"]))
    for env, xs in sorted(by_env.items()):
        if len(xs) < window:
            continue
        live = sum(xs[-window:]) / window
        if live <= held_out[env] - drop:
            return f"live pass rate of {env}: {live:.3f} over its last {window} outcomes, champion's held-out {held_out[env]:.3f}"
    return None
