"""Environment kinds by name, and `make_env`, which builds one from its config.

    env = make_env(EnvConfig(kind="countdown", n_train=512), tokenizer=tok)
    env = make_env(EnvConfig(kind="code"), tokenizer=tok, sandbox=Sandbox(cfg))

`ENV_CLASSES` is the one table of kinds: 'module:Class', imported only when an environment
of that kind is built, so config validation (which checks `envs.<name>.kind` against
`ENV_KINDS`) never imports an environment's dependencies. A new kind is one module under
ptrain/envs/, one options dataclass (ptrain/config/env.py) and one line here.

An environment class is called as `cls(cfg, options, *, tokenizer, sandbox=None)`: its
EnvConfig, the typed options `validate_env_config` built from `cfg.options`, the policy's
tokenizer (chat template, decoding), and the stage's code sandbox, which kinds that run
model-written code use (they build a default one when it is None).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptrain.config.env import EnvConfig
    from ptrain.envs.base import Environment

ENV_CLASSES: dict[str, str] = {
    "arithmetic": "ptrain.envs.arithmetic_env:ArithmeticEnv",
    "countdown": "ptrain.envs.countdown:CountdownEnv",
    "math": "ptrain.envs.math:MathEnv",
    "code": "ptrain.envs.code:CodeEnv",
    "reasoning_gym": "ptrain.envs.reasoning_gym:ReasoningGymEnv",
    "tool_use": "ptrain.envs.tool_use:ToolUseEnv",
    "long_horizon": "ptrain.envs.long_horizon:LongHorizonEnv",
    "terminal": "ptrain.envs.terminal:TerminalEnv",
    "nemo_gym": "ptrain.envs.nemo_gym:NemoGymEnv",
}
"""Environment kind -> 'module:Class' of its Environment."""

ENV_KINDS: tuple[str, ...] = tuple(ENV_CLASSES)
"""The kinds `envs.<name>.kind` may name (jax-free: config validation reads it)."""


def env_class(kind: str) -> type:
    """The Environment class of `kind`, imported on first use."""
    if kind not in ENV_CLASSES:
        raise ValueError(f"unknown environment kind {kind!r}; valid kinds: {', '.join(ENV_CLASSES)}")
    module, _, name = ENV_CLASSES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_env(cfg: EnvConfig, *, tokenizer: Any, sandbox: Any = None) -> Environment:
    """Validate `cfg` (EnvConfigError names a bad key) and build its environment.

    tokenizer: the policy's Hugging Face tokenizer (its chat template renders the prompts).
    sandbox: a `ptrain.envs.sandbox.Sandbox` for kinds that run model-written code, or a
    SandboxConfig to build one from; None builds one with the default SandboxConfig. Where
    nothing isolates, that raises SandboxUnavailableError (saying what to install).
    """
    from ptrain.config.env import validate_env_config

    options = validate_env_config(cfg)
    return env_class(cfg.kind)(cfg, options, tokenizer=tokenizer, sandbox=sandbox)


def close_envs(envs: dict[str, Any]) -> None:
    """Stop the reward workers and threads of a stage's environments, so that they do not
    outlive the stage into the next one of a recipe. A kind whose close is a coroutine (the
    NeMo Gym client) closes per episode, and is left alone here."""
    import inspect

    for env in envs.values():
        close = getattr(env, "close", None)
        if callable(close) and not inspect.iscoroutinefunction(close):
            close()
