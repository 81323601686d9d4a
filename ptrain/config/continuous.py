"""Options of continuous post-training (`continuous`): the inbox of environments, what starts
a round, the promotion gate and its tripwires, and where a promoted model is pushed.
Jax-free; ptrain/continuous/ runs the loop (`python -m ptrain recipe=continuous
continuous.inbox=INBOX`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

IMPROVE_RULES = ("any", "all", "none")


@dataclass
class TripwireConfig:
    """Reward-hacking tripwires: limits on how far the challenger may move from the champion
    on the held-out episodes (each measured per environment; null turns one off). A round
    that trips one is rejected with that reason, whatever its scores."""

    invalid_tool_calls: float | None = 0.05
    """Rise in malformed or unknown tool calls per episode (environments with tools)."""
    hallucinated_tool_calls: float | None = 0.05
    """Rise in the share of episodes that call a tool where none is offered."""
    abstentions: float | None = 0.05
    """Rise in the share of episodes that give no answer or decline (ptrain.stages.env_metrics
    `abstained`: an empty final answer, "I don't know", a clarifying question back)."""
    format_errors: float | None = 0.05
    """Rise in the share of answers the environment could not parse (1 - `formatted`)."""
    length_ratio: float | None = 1.5
    """Challenger's mean response length over the champion's (> 1)."""
    kl: float | None = 0.1
    """KL to the champion (k3 estimate per token, mean of the round's last quarter of training
    steps; measured only while the KL anchor is on)."""


@dataclass
class TriggerConfig:
    """A round on a live pass-rate drop: a production system appends `{"env": NAME, "correct":
    0 or 1}` lines to `path`; when an environment's pass rate over its last `window` lines
    falls `drop` or more below the champion's held-out score, a round starts."""

    path: str | None = None
    """The JSONL of live outcomes; null: no live trigger."""
    window: int = 50
    """Lines per environment the live pass rate is taken over (>= 1)."""
    drop: float = 0.1
    """How far below the champion's held-out score (in (0, 1]) starts a round."""


@dataclass
class ContinuousConfig:
    """The loop: watch `inbox`, run a round when something arrives, promote only what the
    gate passes. Each field is one knob of ptrain/continuous/loop.py's docstring."""

    enabled: bool = False
    """Run the loop instead of the recipe's stages once (the continuous recipe sets it)."""
    inbox: str | None = None
    """The folder a user or a production system drops environments into: one YAML file per
    environment, with the keys of `envs.<name>` (`kind:` and its options), named by its file
    name. A file that does not validate moves to INBOX/rejected/ with a .error beside it."""
    max_rounds: int | None = None
    """Training rounds to run in this launch at most (>= 1); null: no bound."""
    until_idle: bool = False
    """Stop when the inbox has nothing new and no timer or live trigger is due."""
    every_s: float | None = None
    """Also run a round this many seconds after the previous one ended (> 0); null: only on
    arrivals (and the live trigger)."""
    poll_s: float = 5.0
    """Seconds between looks at the inbox and the live trigger (> 0)."""
    replay: float = 0.5
    """Share of a round's training tasks drawn from the environments known before the round
    (in [0, 1)); the new ones share the rest. Rounds with nothing new use the weights as set."""
    kl_anchor: float = 0.02
    """kl_coef of each round's GRPO, toward the champion the round starts from (>= 0; 0 turns
    the anchor off and the kl tripwire with it)."""
    margin: float = 0.05
    """Non-inferiority margin (>= 0): an environment regresses when its confidence interval's
    lower end falls below -margin."""
    confidence: float = 0.95
    """Two-sided level of the paired bootstrap intervals (in (0, 1))."""
    bootstrap_samples: int = 2000
    """Resamples of the paired bootstrap (>= 100)."""
    improve: str = "any"
    """Which target environments (the round's new ones; all when none is new) must improve
    (interval above 0): any, all, or none (promote whatever is non-inferior everywhere and
    trips nothing: a refresh that only has to do no harm)."""
    tripwires: TripwireConfig = field(default_factory=TripwireConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    serve_urls: list[str] = field(default_factory=list)
    """ptrain.serve (or SGLang) servers that get each promoted model (and a rollback) as a
    versioned, verified weight push."""
    judge_calibration: str | None = None
    """A JSONL of response pairs with known verdicts (algo.eval.judge_calibration's format)
    that the run's judge environment (`kind: judge`, from the recipe or the inbox) re-scores
    every round, in each eval stage that scores it; promotion is blocked when the judge's
    agreement falls more than `judge_drop` below its agreement when the champion was scored."""
    judge_drop: float = 0.05
    """Largest fall in the judge's calibration agreement that still promotes (in [0, 1])."""

    def problems(self) -> list[tuple[str, str]]:
        """(key, message) for each impossible value; config/run.py raises the first."""
        out: list[tuple[str, str]] = []

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                out.append((f"continuous.{key}", msg))

        need(not self.enabled or bool(self.inbox), "inbox",
             "the loop watches a folder for new environments; pass continuous.inbox=DIR")  # fmt: skip
        need(
            self.max_rounds is None or self.max_rounds >= 1,
            "max_rounds",
            f"must be >= 1 or null, got {self.max_rounds}",
        )
        need(self.every_s is None or 0 < self.every_s < math.inf, "every_s", f"must be > 0 or null, got {self.every_s}")
        need(0 < self.poll_s < math.inf, "poll_s", f"must be > 0, got {self.poll_s}")
        need(0 <= self.replay < 1, "replay", f"must be in [0, 1) (the old environments' share), got {self.replay}")
        need(0 <= self.kl_anchor < math.inf, "kl_anchor", f"must be >= 0 (0: no anchor), got {self.kl_anchor}")
        need(0 <= self.margin < math.inf, "margin", f"must be >= 0, got {self.margin}")
        need(0 < self.confidence < 1, "confidence", f"must be in (0, 1), e.g. 0.95, got {self.confidence}")
        need(self.bootstrap_samples >= 100, "bootstrap_samples", f"must be >= 100, got {self.bootstrap_samples}")
        need(0 <= self.judge_drop <= 1, "judge_drop", f"must be in [0, 1], got {self.judge_drop}")
        need(self.judge_calibration is None or os.path.isfile(self.judge_calibration), "judge_calibration",
             f"'{self.judge_calibration}' is not a file; pass a JSONL of judged pairs, or null")  # fmt: skip
        need(self.improve in IMPROVE_RULES, "improve", f"pass one of {list(IMPROVE_RULES)}, got {self.improve!r}")
        for name in ("invalid_tool_calls", "hallucinated_tool_calls", "abstentions", "format_errors", "kl"):
            v = getattr(self.tripwires, name)
            need(v is None or 0 <= v < math.inf, f"tripwires.{name}", f"must be >= 0 or null (off), got {v}")
        lr = self.tripwires.length_ratio
        need(lr is None or 1 < lr < math.inf, "tripwires.length_ratio", f"must be > 1 or null (off), got {lr}")
        t = self.trigger
        need(t.window >= 1, "trigger.window", f"must be >= 1, got {t.window}")
        need(0 < t.drop <= 1, "trigger.drop", f"must be in (0, 1], got {t.drop}")
        for i, url in enumerate(self.serve_urls):
            need(isinstance(url, str) and url.startswith(("http://", "https://")), f"serve_urls[{i}]",
                 f"must be http://host:port of a ptrain.serve or SGLang server, got {url!r}")  # fmt: skip
        need(
            len(set(self.serve_urls)) == len(self.serve_urls), "serve_urls", f"lists a server twice: {self.serve_urls}"
        )
        return out
