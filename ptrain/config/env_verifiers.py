"""Options of the `verifiers` environment kind: a verifiers 0.4 taskset (Prime Intellect's
environment library) played by the stage's own engine (ptrain/envs/verifiers_env.py).

    env:
      kind: verifiers
      options:
        taskset: reverse-text            # an installed taskset package, by its verifiers id
        taskset_path: null               # or a folder to import it from (a local module)

Needs `pip install ".[verifiers]"` (verifiers and uv). Jax-free, like the rest of ptrain.config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ptrain.config.env_options import MAX_TIMEOUT_S, EnvConfigError, register_options


@register_options("verifiers")
@dataclass
class VerifiersOptions:
    """Which verifiers taskset to play and how verifiers runs its agent."""

    taskset: str | None = None
    """The taskset's verifiers id (required): the name of an installed package exporting a
    `vf.Taskset` subclass in `__all__` (`reverse-text` imports `reverse_text`), or a hub id
    `owner/name` of one installed with `prime env install`."""
    taskset_path: str | None = None
    """A folder put on the import path first, for a taskset module that is not installed
    (a local `my_taskset.py`); null: installed packages only."""
    taskset_args: dict[str, Any] = field(default_factory=dict)
    """Further fields of the taskset's config (its TasksetConfig subclass), as `vf-eval`'s
    `--env.taskset.<field>` would give them."""
    harness: str = "null"
    """verifiers harness id: `null` is its plain chat loop (what single- and multi-turn chat
    tasksets need); the others (bash, codex, ...) run agent programs."""
    runtime: str = "subprocess"
    """verifiers runtime the harness runs in: `subprocess` (this machine), or docker, prime,
    modal, e2b (verifiers' own default is Prime's remote sandbox, which needs a login)."""
    renderer: dict[str, Any] | None = None
    """verifiers' TrainClientConfig renderer (how the chat becomes token ids); null: picked by
    the model's name, `default` (the tokenizer's chat template) for a local folder. Tool
    tasksets on a model verifiers does not know need e.g. {"name": "default", "tool_parser": "qwen3"}."""
    episode_timeout_s: float = 600.0
    """Wall seconds (> 0) one episode may take before it counts as an environment error."""

    def validate(self, where: str) -> None:
        def check(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise EnvConfigError(f"config key '{where}.{key}': {msg}")

        check(
            isinstance(self.taskset, str) and bool(self.taskset.strip()),
            "taskset",
            "required: the verifiers taskset id, e.g. reverse-text (an installed package exporting a vf.Taskset)",
        )
        if self.taskset_path is not None:
            check(
                os.path.isdir(self.taskset_path),
                "taskset_path",
                f"{self.taskset_path!r} is not a folder; give the folder that holds the taskset module, or null",
            )
        check(isinstance(self.taskset_args, dict), "taskset_args", "must be a mapping of taskset config fields")
        for key in ("id",):
            check(key not in self.taskset_args, f"taskset_args.{key}", "set the taskset id with options.taskset")
        check(bool(self.harness), "harness", "give a verifiers harness id, e.g. null")
        check(bool(self.runtime), "runtime", "give a verifiers runtime type, e.g. subprocess")
        check(
            self.renderer is None or isinstance(self.renderer, dict),
            "renderer",
            'a mapping like {"name": "default"}, or null',
        )
        check(
            0 < self.episode_timeout_s <= MAX_TIMEOUT_S,
            "episode_timeout_s",
            f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {self.episode_timeout_s}",
        )
