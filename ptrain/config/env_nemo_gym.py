"""Options of the `nemo_gym` environment kind: ptrain plays NeMo Gym's simple agent against a
NeMo Gym resources server (shared/reference/nemo_gym.md; ptrain/envs/nemo_gym.py).

    env:
      kind: nemo_gym
      options:
        url: http://127.0.0.1:8001          # python tools/nemo_gym_servers.py NAME prints it
        rows: data/example.jsonl             # NeMo Gym rows: responses_create_params + task fields

Jax-free, like the rest of ptrain.config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ptrain.config.env_options import EnvConfigError, register_options

BAD_ROW_POLICIES = ("fail", "skip")
SEED_BODIES = ("auto", "legacy", "session")


@register_options("nemo_gym")
@dataclass
class NemoGymOptions:
    """Where the resources server is, which rows to play, and the episode's limits."""

    url: str | None = None
    """Base URL of the resources server (http://host:port, no trailing route). Its routes:
    /seed_session, one POST route per tool, /verify, /aggregate_metrics, and from NeMo Gym 0.7
    /close_session (called after each episode; a server without it answers 404 and is not
    asked again)."""
    rows: str | None = None
    """NeMo Gym JSONL rows: {"responses_create_params": {"input": [...], "tools": [...]},
    ...task fields}, e.g. a server's data/example.jsonl. The training split, and the held-out
    one too when eval_rows is null (its first n_eval rows; the rest train)."""
    eval_rows: str | None = None
    """JSONL rows of the held-out split (same format); null: from `rows` as above."""
    max_turns: int = 8
    """Model calls per episode at most (>= 1; NeMo Gym's max_steps). An episode that still
    calls tools on its last turn ends with finish_reason turn_limit (those calls are not
    sent) and is verified as it stands."""
    max_episode_tokens: int = 4096
    """Tokens of the whole episode (prompt, policy and tool turns) at most (>= 2); each turn's
    max_new_tokens is cut to what is left, and the engine's context length caps it too."""
    max_tool_calls_per_turn: int = 8
    """Tool calls sent per policy turn (>= 1); calls past it get an error observation and
    count as invalid."""
    max_tool_output_chars: int = 8000
    """Characters of one tool answer that go into the policy's context (>= 100); the verify
    request's function_call_output carries the whole answer."""
    invalid_call_penalty: float = 0.0
    """Taken from the reward of an episode with a malformed tool call or a call of a tool its
    row does not declare (>= 0; reward component invalid_tool_call). Such calls are answered
    with an error observation and never sent to the server."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3."""
    connect_timeout_s: float = 5.0
    """Seconds (> 0) to open a connection to the server before the episode fails with the URL named."""
    request_timeout_s: float = 60.0
    """Seconds (> 0) one /seed_session or tool call may take."""
    verify_timeout_s: float = 300.0
    """Seconds (> 0) one /verify may take (an LLM judge behind it can be slow)."""
    developer_as_system: bool = True
    """Render Responses `developer` messages as `system` ones: most chat templates know no
    developer role (NeMo Gym's vLLM model server has the same switch)."""
    think_tags: bool = True
    """Text in <think>...</think> of a policy turn goes into a Responses `reasoning` item, not
    the message text the verifier reads (as NeMo Gym's model servers split it)."""
    reward_components_tolerance: float = 1e-6
    """|reward - sum(reward_components)| allowed (>= 0); more is a reward_error (NeMo RL
    requires reward == the components' sum)."""
    seed_body: str = "auto"
    """What /seed_session gets: legacy (the row itself, as NeMo Gym's simple agent sends it;
    every 0.4 and 0.7 server whose seed reads row fields takes it), session (NeMo Gym 0.7's
    {resources_session_id, episode_id, task_id, task_data: the row}, which 0.7's default seed
    and servers seeded by its environment servers take), or auto: session when the server's
    OpenAPI document (/openapi.json, read once) says its seed takes that body, else legacy."""
    bad_rows: str = "fail"
    """What a malformed row does: fail (the environment refuses to start, naming the file,
    the line and the problem) or skip (counted, with line numbers, in `NemoGymEnv.bad_rows`)."""

    def validate(self, where: str) -> None:
        def check(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise EnvConfigError(f"config key '{where}.{key}': {msg}")

        check(self.url is not None, "url",
              "the resources server's base URL is required, e.g. http://127.0.0.1:8001 "
              "(python tools/nemo_gym_servers.py NAME serves one and prints it)")  # fmt: skip
        parts = urlsplit(self.url)
        try:
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
        except ValueError:
            check(False, "url", f"its port is not a number in 0..65535, got {self.url!r}")
        check(parts.scheme in ("http", "https") and bool(parts.hostname), "url",
              f"must be http://host:port or https://host:port, got {self.url!r}")  # fmt: skip
        check(parts.path in ("", "/") and not parts.query, "url",
              f"give the server's base URL without a route or query, got {self.url!r}")  # fmt: skip
        check(self.rows is not None, "rows", "a NeMo Gym JSONL file is required (e.g. a server's data/example.jsonl)")
        for key in ("rows", "eval_rows"):
            path = getattr(self, key)
            check(path is None or os.path.isfile(path), key,
                  f"no file '{path}'; pass a NeMo Gym JSONL file (one row object per line)")  # fmt: skip
        for key, lo in (("max_turns", 1), ("max_episode_tokens", 2), ("max_tool_calls_per_turn", 1),
                        ("max_tool_output_chars", 100)):  # fmt: skip
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= lo, key,
                  f"must be an integer >= {lo}, got {value!r}")  # fmt: skip
        check(self.invalid_call_penalty >= 0, "invalid_call_penalty", f"must be >= 0, got {self.invalid_call_penalty}")
        for key in ("connect_timeout_s", "request_timeout_s", "verify_timeout_s"):
            check(getattr(self, key) > 0, key, f"must be > 0 seconds, got {getattr(self, key)}")
        check(self.reward_components_tolerance >= 0, "reward_components_tolerance",
              f"must be >= 0, got {self.reward_components_tolerance}")  # fmt: skip
        check(self.seed_body in SEED_BODIES, "seed_body",
              f"must be one of {list(SEED_BODIES)}, got {self.seed_body!r}")  # fmt: skip
        check(self.bad_rows in BAD_ROW_POLICIES, "bad_rows",
              f"must be one of {list(BAD_ROW_POLICIES)}, got {self.bad_rows!r}")  # fmt: skip
