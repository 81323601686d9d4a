"""Env config and registry: kinds by name, typed options per kind with errors that name
env.<name>.options.<key> and the valid keys, the Hydra files conf/env/<kind>.yaml, make_env,
and a jax-free import path for config validation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ptrain.config.env import (
    KIND_OPTIONS,
    ArithmeticOptions,
    CountdownOptions,
    EnvConfig,
    EnvConfigError,
    register_env_configs,
    validate_env_config,
    validate_env_configs,
)
from ptrain.envs.base import Environment
from ptrain.envs.registry import ENV_CLASSES, ENV_KINDS, env_class, make_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MY_KINDS = ("arithmetic", "countdown", "reverse_text", "math", "code", "reasoning_gym")


def test_every_kind_has_options_and_a_class():
    assert set(MY_KINDS) <= set(ENV_KINDS)
    for kind in ENV_KINDS:
        assert kind in KIND_OPTIONS, kind
    for kind in MY_KINDS:
        assert callable(env_class(kind).rollout) and callable(env_class(kind).tasks)
    with pytest.raises(ValueError, match="unknown environment kind 'nope'"):
        env_class("nope")


def test_options_are_typed_and_checked():
    opts = validate_env_config(EnvConfig(kind="countdown", options={"max_numbers": 5, "format_reward": 0}))
    assert isinstance(opts, CountdownOptions) and opts.max_numbers == 5 and opts.format_reward == 0.0
    assert isinstance(validate_env_config(EnvConfig()), ArithmeticOptions)

    def bad(match, **kw):
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(**kw))

    bad(r"config key 'envs\.countdown\.options\.max_number': not an option of this kind; valid keys: min_numbers, "
        r"max_numbers", kind="countdown", options={"max_number": 5})  # fmt: skip
    bad(r"'envs\.countdown\.options\.max_numbers': must be an integer, got '4'", kind="countdown",
        options={"max_numbers": "4"})  # fmt: skip
    bad(r"'envs\.countdown\.options\.use_all_numbers': must be true or false", kind="countdown",
        options={"use_all_numbers": 1})  # fmt: skip
    bad(r"'envs\.cd\.options\.min_numbers': need 2 <= min_numbers <= max_numbers <= 8", kind="countdown", name="cd",
        options={"min_numbers": 5, "max_numbers": 4})  # fmt: skip
    bad(r"'envs\.arithmetic\.options\.ops': unknown operation\(s\) \['/'\]", options={"ops": ["+", "/"]})
    bad(r"'envs\.arithmetic\.options\.ops\[1\]': must be a string", options={"ops": ["+", 3]})
    bad(r"'envs\.math\.options\.families': unknown families \['geometry'\]", kind="math",
        options={"families": ["geometry"]})  # fmt: skip
    bad(r"'envs\.code\.options\.test_timeout_s': must be > 0", kind="code", options={"test_timeout_s": 0})
    bad(r"'envs\.x\.kind': unknown environment kind 'chess'; valid kinds: arithmetic, countdown", kind="chess",
        name="x")  # fmt: skip
    bad(r"'envs\.arithmetic\.weight': must be a finite number > 0", weight=0.0)
    bad(r"'envs\.arithmetic\.n_train': must be >= 1", n_train=0)
    bad(r"'envs\.arithmetic\.reward_timeout_s': must be > 0", reward_timeout_s=0)
    bad(r"'envs\.arithmetic\.reward_workers': must be between 1 and 256", reward_workers=0)
    bad(r"'envs\.arithmetic\.reward_workers': must be between 1 and 256 \(each is a process", reward_workers=10_000)
    bad(r"'envs\.a/b\.name'", name="a/b")
    bad(r"'envs\.all\.name'.*not 'all'", name="all")
    bad(r"'envs\.arithmetic\.max_new_tokens': must be >= 1 or null", max_new_tokens=0)


def test_infinite_numbers_are_refused_by_name():
    """inf passes every `> 0` check, yet an infinite reward timeout overflows the wait on the
    reward worker (OverflowError deep in selectors) and an infinite penalty makes the
    advantages nan: each is a config error naming the key."""

    def bad(match, **kw):
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(**kw))

    inf = float("inf")
    bad(r"'envs\.arithmetic\.reward_timeout_s': must be > 0 and at most 86400 seconds", reward_timeout_s=inf)
    bad(r"'envs\.arithmetic\.reward_timeout_s': must be > 0 and at most 86400 seconds", reward_timeout_s=1e9)
    bad(r"'envs\.arithmetic\.weight': must be a finite number > 0", weight=inf)
    bad(r"'envs\.code\.options\.test_timeout_s': must be a finite number, got inf", kind="code",
        options={"test_timeout_s": inf})  # fmt: skip
    bad(r"'envs\.tool_use\.options\.invalid_call_penalty': must be a finite number, got inf", kind="tool_use",
        options={"invalid_call_penalty": inf})  # fmt: skip
    bad(r"'envs\.countdown\.options\.correct_reward': must be a finite number, got nan", kind="countdown",
        options={"correct_reward": float("nan")})  # fmt: skip

    # Finite but past what the waits take: setitimer refused a 1e12 s test timeout inside the
    # sandbox, so every completion scored as a load error; a tool call's sandbox adds 10 s.
    bad(r"'envs\.code\.options\.test_timeout_s': must be > 0 and at most 86400 seconds", kind="code",
        options={"test_timeout_s": 1e12})  # fmt: skip
    bad(r"'envs\.tool_use\.options\.tool_timeout_s': must be > 0 and at most 86390 seconds", kind="tool_use",
        options={"tool_timeout_s": 86395.0})  # fmt: skip
    bad(r"'envs\.terminal\.options\.test_timeout_s': must be > 0 and at most 86390 seconds", kind="terminal",
        options={"test_timeout_s": 1e9})  # fmt: skip


def test_names_are_distinct_within_a_stage():
    validate_env_configs([EnvConfig(kind="countdown"), EnvConfig(kind="countdown", name="countdown_hard")])
    with pytest.raises(EnvConfigError, match="both named 'countdown'"):
        validate_env_configs([EnvConfig(kind="countdown"), EnvConfig(kind="countdown")])


@pytest.mark.parametrize("kind", MY_KINDS)
def test_hydra_files_compose_to_valid_configs(kind, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    # A primary config that picks the group option, as a recipe does.
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: {kind}\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        plain = compose(config_name="main")
        # The file's package: envs.<kind> (a stage's environments by name), or the group's.
        at = f"envs.{kind}" if "envs" in plain else "env"
        node = OmegaConf.select(compose(config_name="main", overrides=[f"{at}.n_train=7"]), at)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
        with pytest.raises(Exception, match="nonexistent_key"):
            compose(config_name="main", overrides=[f"{at}.nonexistent_key=1"])
    assert isinstance(cfg, EnvConfig) and cfg.kind == kind and cfg.n_train == 7
    validate_env_config(cfg)


def test_make_env_builds_an_environment():
    from ptrain.data.tokenizer import build_tokenizer

    tok = build_tokenizer(vocab_size=300)
    env = make_env(EnvConfig(kind="countdown", name="cd", n_train=3, n_eval=1), tokenizer=tok)
    assert isinstance(env, Environment) and env.name == "cd"
    assert [t.env for t in env.tasks("train", seed=0)] == ["cd"] * 3
    with pytest.raises(EnvConfigError, match="envs.cd.options.bogus"):
        make_env(EnvConfig(kind="countdown", name="cd", options={"bogus": 1}), tokenizer=tok)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.tasks("test", seed=0)


def test_config_validation_imports_no_jax():
    code = (
        "import sys\n"
        "from ptrain.config.env import EnvConfig, validate_env_config\n"
        "import ptrain.envs\n"
        "for kind in ('arithmetic', 'countdown', 'math', 'code'):\n"
        "    validate_env_config(EnvConfig(kind=kind))\n"
        "bad = [m for m in ('jax', 'flax', 'grain', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_registry_builds_exactly_the_kinds_the_config_validates():
    assert list(ENV_CLASSES) == list(KIND_OPTIONS)
    for kind, load in ENV_CLASSES.items():
        cls = load()
        assert cls.__module__.startswith("ptrain.envs."), (kind, cls)
