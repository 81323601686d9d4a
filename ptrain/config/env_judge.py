"""Options of the `judge` environment kind: RLHF rewards from a generative reward model (GenRM)
that compares the policy's responses two at a time, as Nemotron 3 Nano's RLHF stage does
(arXiv 2512.20848 §3.3; NeMo Gym's genrm_compare), or from a Bradley-Terry reward model that
scores each response (judge: reward_model, e.g. the export of an earlier stage of kind rm).
The kind lives in ptrain/envs/judge.py, whose docstring states the judge's answer format, the
aggregation and the length control.

    envs:
      judge:
        kind: judge
        options:
          judge: openai                              # or policy: the rollout's own engine judges
          judge_url: http://127.0.0.1:8000           # any OpenAI-compatible server (python -m ptrain.serve)
          judge_model: genrm
          reasoning_length_penalty: 0.1              # Nano ships every length knob at 0
      rm_judged:
        kind: judge
        options: {judge: reward_model, reward_model_path: "${run_dir}/stages/rm/export"}

The length-control coefficients are in units of the `judge` reward component: with `rescale`
(the default) the judge's 1-5 score maps to [0, 1], so a coefficient of 0.1 is a tenth of the
judge's range; NeMo Gym's knobs act on the raw 1-5 scores (four times larger units).

Jax-free, like the rest of ptrain.config.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ptrain.config.env_options import MAX_TIMEOUT_S, EnvConfigError, register_options

JUDGE_BACKENDS = ("policy", "openai", "reward_model")
"""Who judges: `policy`, the engine the rollout got (the policy judges itself, or whatever model
that engine serves); `openai`, an OpenAI-compatible /v1/chat/completions endpoint;
`reward_model`, a Bradley-Terry reward model folder (a stage of kind rm exports one) that
scores each response on its own."""

JUDGE_FAMILIES = ("explain", "describe", "advice", "compare", "question", "rewrite")
"""Generated open-ended request families (ptrain/envs/judge.py draws them from the seed):
explain a term, write about a topic, give practical tips, tell two things apart, answer a
simple question, rewrite a clumsy sentence. Each is varied by audience and length."""

MAX_JUDGE_RETRIES = 10
"""Most retries of one judge call (each waits for its timeout before the next)."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise EnvConfigError(f"config key '{key}': {msg}")


@register_options("judge")
@dataclass
class JudgeOptions:
    """Chat prompts whose n responses a GenRM compares circularly, (0,1), (1,2) ... (n-1,0);
    reward = the aggregated judge score plus group-relative length control
    (ptrain/envs/judge.py)."""

    families: list[str] = field(default_factory=lambda: list(JUDGE_FAMILIES))
    """Generated request families drawn from, each equally likely (JUDGE_FAMILIES). Unused with path."""
    path: str | None = None
    """JSONL rows {"messages": [{"role", "content"}, ...]} (ending with a user turn) or
    {"prompt": str} (one user turn) instead of generated prompts: the training split, and the
    held-out one too when eval_path is null (its first n_eval rows; the rest train)."""
    eval_path: str | None = None
    """JSONL rows of the held-out split (same fields); null: from path as above."""

    judge: str = "policy"
    """Who judges (JUDGE_BACKENDS): policy (the rollout's engine, prompt rendered by the policy
    tokenizer's chat template), openai (judge_url + judge_model) or reward_model
    (reward_model_path: one score per response, no comparisons)."""
    reward_model_path: str | None = None
    """With judge reward_model: a Hugging Face sequence-classification folder with one label
    that shares the policy's tokenizer, e.g. ${run_dir}/stages/rm/export after a stage of kind
    rm. Read when the environment is built (by the stages that sample it), so an earlier stage
    of the same run may write it."""
    reward_model_max_tokens: int = 2048
    """With judge reward_model: tokens (>= 16; at most the model's positions) of prompt and
    response the model reads; a longer conversation is cut at the end and counted in the
    environment's reward_model_cut stat."""
    judge_url: str | None = None
    """With judge openai: the server's base URL, http(s)://host:port with an optional path
    prefix (a trailing /v1 may be given or not); requests go to <url>/v1/chat/completions."""
    judge_model: str | None = None
    """With judge openai: the `model` field of each request (the served model's name)."""
    judge_api_key_env: str | None = None
    """With judge openai: the name of an environment variable that holds the endpoint's API key,
    sent as `Authorization: Bearer`; null: no key. The key itself never goes into a config."""
    judge_temperature: float = 0.6
    """Judge sampling temperature (>= 0; Nano's GenRM 0.6)."""
    judge_top_p: float = 0.95
    """Judge nucleus mass in (0, 1] (Nano's GenRM 0.95)."""
    judge_max_new_tokens: int = 512
    """Tokens the judge may write per comparison (>= 1). A verdict cut off before its JSON does
    not parse and counts as a tie. Nano's GenRM, which reasons first, gets 16384."""
    judge_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables of the judge's prompt (e.g. {enable_thinking: false}):
    passed to the policy tokenizer's template, or as `chat_template_kwargs` to the endpoint."""
    judge_max_response_chars: int = 8000
    """Characters of each response's answer shown to the judge (>= 100); a longer one is cut
    and marked as cut. Bounds the judge's prompt; lengths for length control are uncut."""
    judge_connect_timeout_s: float = 5.0
    """With judge openai: seconds (> 0) to open a connection to the endpoint."""
    judge_timeout_s: float = 120.0
    """With judge openai: seconds (> 0) one judge call may take to answer."""
    judge_retries: int = 2
    """With judge openai: retries of a call that could not connect, timed out, or got status
    429 or 5xx (0 to 10), after 0.5 s, 1 s, 2 s, ...; a call that still fails makes its two
    responses env errors."""
    judge_concurrency: int = 32
    """Judge calls of this environment in flight at once (>= 1), across all its rollouts."""

    tie_break: float = 0.5
    """Score points (>= 0) a decisive ranking moves between two responses whose 1-5 scores tie
    (simple_tiebreaker): ranking r moves tie_break * (3.5 - r) / 2.5 from response 2 to
    response 1, so 1 gives +tie_break / -tie_break and 3 gives +0.2 tie_break / -0.2 tie_break.
    NeMo Gym's genrm_compare moves 3.5 - r, which is tie_break 2.5."""
    rescale: bool = True
    """Map the judge's 1-5 score to [0, 1] as (score - 1) / 4 (a tie-break can move it past
    either end by at most tie_break / 4), and a reward model's score through the logistic
    function, in line with the other kinds' rewards. False: the raw score, as Nano's rewards are."""
    reasoning_length_penalty: float = 0.0
    """Coefficient (>= 0) of the zero-centred group-relative penalty on reasoning length
    (characters inside <think>...</think>); Nano's group_reasoning_length_penalty_coeff."""
    answer_length_penalty: float = 0.0
    """Coefficient (>= 0) of the same penalty on answer length (characters after </think>);
    Nano's group_answer_length_penalty_coeff."""
    reasoning_bonus: float = 0.0
    """Bonus (>= 0) for the shortest non-empty reasoning among the group's top-quality responses."""
    answer_bonus: float = 0.0
    """Bonus (>= 0) for the shortest non-empty answer among the group's top-quality responses."""
    top_percentile: float = 0.2
    """Share of the group (in (0, 1]) that sets the quality gate of the bonuses: responses whose
    judge score is at least the k-th best, k = max(1, floor(top_percentile * responses))."""

    def validate(self, where: str) -> None:
        bad = [f for f in self.families if f not in JUDGE_FAMILIES]
        _check(not bad, f"{where}.families", f"unknown families {bad}; valid ones are {list(JUDGE_FAMILIES)}")
        _check(
            len(set(self.families)) == len(self.families),
            f"{where}.families",
            f"names repeat in {self.families}; list each once",
        )
        _check(
            bool(self.families) or self.path is not None,
            f"{where}.families",
            f"pass at least one of {list(JUDGE_FAMILIES)}, or a path",
        )
        for key in ("path", "eval_path"):
            path = getattr(self, key)
            _check(
                path is None or os.path.isfile(path),
                f"{where}.{key}",
                f'no file \'{path}\'; pass a JSONL file of {{"messages": [...]}} or {{"prompt": str}} rows, or '
                "null for the generated prompts",
            )
        _check(
            self.eval_path is None or self.path is not None,
            f"{where}.eval_path",
            "eval_path needs path (the training rows) as well",
        )
        self._validate_judge(where)
        _check(self.tie_break >= 0, f"{where}.tie_break", f"must be >= 0 score points, got {self.tie_break}")
        for key in ("reasoning_length_penalty", "answer_length_penalty", "reasoning_bonus", "answer_bonus"):
            value = getattr(self, key)
            _check(value >= 0, f"{where}.{key}", f"must be >= 0 (0 turns it off), got {value}")
        _check(
            0 < self.top_percentile <= 1,
            f"{where}.top_percentile",
            f"must be in (0, 1] (a share of the group), got {self.top_percentile}",
        )

    def _validate_judge(self, where: str) -> None:
        _check(
            self.judge in JUDGE_BACKENDS,
            f"{where}.judge",
            f"must be one of {list(JUDGE_BACKENDS)}, got {self.judge!r}",
        )
        if self.judge == "openai":
            _check(
                self.judge_url is not None,
                f"{where}.judge_url",
                "judge openai needs the endpoint's base URL, e.g. http://127.0.0.1:8000 (python -m ptrain.serve)",
            )
            parts = urlsplit(self.judge_url)
            try:
                parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
            except ValueError:
                _check(False, f"{where}.judge_url", f"its port is not a number in 0..65535, got {self.judge_url!r}")
            _check(
                parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.query and not parts.fragment,
                f"{where}.judge_url",
                f"must be http(s)://host[:port][/prefix] without a query, got {self.judge_url!r}",
            )
            _check(
                not parts.path.rstrip("/").endswith("/chat/completions"),
                f"{where}.judge_url",
                f"give the base URL; /v1/chat/completions is appended, got {self.judge_url!r}",
            )
            _check(
                bool(self.judge_model and self.judge_model.strip()),
                f"{where}.judge_model",
                "judge openai needs the served model's name (the requests' `model` field)",
            )
            key_env = self.judge_api_key_env
            _check(
                key_env is None or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env) is not None,
                f"{where}.judge_api_key_env",
                f"must be the name of an environment variable (not the key itself), got {key_env!r}",
            )
        if self.judge == "reward_model":
            _check(
                bool(self.reward_model_path and str(self.reward_model_path).strip()),
                f"{where}.reward_model_path",
                "judge reward_model needs a reward-model folder, e.g. ${run_dir}/stages/rm/export after a stage "
                "of kind rm",
            )
            _check(
                self.reward_model_max_tokens >= 16,
                f"{where}.reward_model_max_tokens",
                f"must be >= 16, got {self.reward_model_max_tokens}",
            )
        else:
            _check(
                self.reward_model_path is None,
                f"{where}.reward_model_path",
                f"is read only with judge reward_model (judge is {self.judge!r}); leave it null or set "
                "judge: reward_model",
            )
        if self.judge != "openai":
            for key in ("judge_url", "judge_model", "judge_api_key_env"):
                _check(
                    getattr(self, key) is None,
                    f"{where}.{key}",
                    f"is read only with judge openai (judge is {self.judge!r}); leave it null or set judge: openai",
                )
        _check(
            self.judge_temperature >= 0,
            f"{where}.judge_temperature",
            f"must be >= 0, got {self.judge_temperature}",
        )
        _check(0 < self.judge_top_p <= 1, f"{where}.judge_top_p", f"must be in (0, 1], got {self.judge_top_p}")
        _check(
            self.judge_max_new_tokens >= 1,
            f"{where}.judge_max_new_tokens",
            f"must be >= 1, got {self.judge_max_new_tokens}",
        )
        _check(
            self.judge_max_response_chars >= 100,
            f"{where}.judge_max_response_chars",
            f"must be >= 100, got {self.judge_max_response_chars}",
        )
        for key in ("judge_connect_timeout_s", "judge_timeout_s"):
            value = getattr(self, key)
            _check(
                0 < value <= MAX_TIMEOUT_S,
                f"{where}.{key}",
                f"must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (one day), got {value}",
            )
        _check(
            0 <= self.judge_retries <= MAX_JUDGE_RETRIES,
            f"{where}.judge_retries",
            f"must be between 0 and {MAX_JUDGE_RETRIES}, got {self.judge_retries}",
        )
        _check(
            self.judge_concurrency >= 1,
            f"{where}.judge_concurrency",
            f"must be >= 1, got {self.judge_concurrency}",
        )
