"""Environment kinds by name, and `make_env`, which builds one from its config.

    env = make_env(EnvConfig(kind="countdown", n_train=512), tokenizer=tok)
    env = make_env(EnvConfig(kind="code"), tokenizer=tok, sandbox=Sandbox(cfg))

`ENV_CLASSES` maps each kind to a function that imports its class, so that only an
environment of that kind being built loads its dependencies. Config validation checks
`envs.<name>.kind` against the kinds with options in ptrain/config/env.py and never imports
this package. A new kind is one module under ptrain/envs/, one options dataclass
(ptrain/config/env.py) and one entry here.

An environment class is called as `cls(cfg, options, *, tokenizer, sandbox=None)`: its
EnvConfig, the typed options `validate_env_config` built from `cfg.options`, the policy's
tokenizer (chat template, decoding), and the stage's code sandbox, which kinds that run
model-written code use (they build a default one when it is None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptrain.config.env import EnvConfig
    from ptrain.envs.base import Environment


def _arithmetic() -> type:
    from ptrain.envs.arithmetic_env import ArithmeticEnv

    return ArithmeticEnv


def _countdown() -> type:
    from ptrain.envs.countdown import CountdownEnv

    return CountdownEnv


def _reverse_text() -> type:
    from ptrain.envs.reverse_text import ReverseTextEnv

    return ReverseTextEnv


def _math() -> type:
    from ptrain.envs.math import MathEnv

    return MathEnv


def _code() -> type:
    from ptrain.envs.code import CodeEnv

    return CodeEnv


def _reasoning_gym() -> type:
    from ptrain.envs.reasoning_gym import ReasoningGymEnv

    return ReasoningGymEnv


def _judge() -> type:
    from ptrain.envs.judge import JudgeEnv

    return JudgeEnv


def _tool_use() -> type:
    from ptrain.envs.tool_use import ToolUseEnv

    return ToolUseEnv


def _long_horizon() -> type:
    from ptrain.envs.long_horizon import LongHorizonEnv

    return LongHorizonEnv


def _terminal() -> type:
    from ptrain.envs.terminal import TerminalEnv

    return TerminalEnv


def _nemo_gym() -> type:
    from ptrain.envs.nemo_gym import NemoGymEnv

    return NemoGymEnv


def _mcqa() -> type:
    from ptrain.envs.mcqa import McqaEnv

    return McqaEnv


def _instruction_following() -> type:
    from ptrain.envs.instruction_following import InstructionFollowingEnv

    return InstructionFollowingEnv


def _structured_output() -> type:
    from ptrain.envs.structured_output import StructuredOutputEnv

    return StructuredOutputEnv


def _long_context() -> type:
    from ptrain.envs.long_context import LongContextEnv

    return LongContextEnv


def _verifiers() -> type:
    from ptrain.envs.verifiers_env import VerifiersEnv

    return VerifiersEnv


ENV_CLASSES: dict[str, Callable[[], type]] = {
    "arithmetic": _arithmetic,
    "countdown": _countdown,
    "reverse_text": _reverse_text,
    "math": _math,
    "code": _code,
    "reasoning_gym": _reasoning_gym,
    "judge": _judge,
    "tool_use": _tool_use,
    "long_horizon": _long_horizon,
    "terminal": _terminal,
    "nemo_gym": _nemo_gym,
    "mcqa": _mcqa,
    "instruction_following": _instruction_following,
    "structured_output": _structured_output,
    "long_context": _long_context,
    "verifiers": _verifiers,
}
"""Environment kind -> a function that imports and returns its Environment class. The
kinds are those with an options dataclass in ptrain.config.env (a test keeps them equal)."""

ENV_KINDS: tuple[str, ...] = tuple(ENV_CLASSES)


def env_class(kind: str) -> type:
    """The Environment class of `kind`, imported on first use."""
    if kind not in ENV_CLASSES:
        raise ValueError(f"unknown environment kind {kind!r}; valid kinds: {', '.join(ENV_CLASSES)}")
    return ENV_CLASSES[kind]()


def make_env(cfg: EnvConfig, *, tokenizer: Any, sandbox: Any = None) -> Environment:
    """Validate `cfg` (EnvConfigError names a bad key) and build its environment.

    tokenizer: the policy's Hugging Face tokenizer (its chat template renders the prompts).
    sandbox: a `ptrain.sandbox.Sandbox` for kinds that run model-written code, or a
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
