"""Environment config: which environment kind, how much of the mix it gets, and its options.

`EnvConfig` is the Hydra `env` group schema (conf/env/<kind>.yaml, one file per kind). The
fields every kind shares are typed here; what only one kind understands sits in `options`,
a plain mapping that `validate_env_config(cfg)` turns into that kind's typed dataclass
(`CountdownOptions`, `MathOptions`, ...), so a misspelt or mistyped key is refused before
any compute with a message that names `envs.<name>.options.<key>` and the valid keys.

Kinds defined in other modules register their options dataclass with the decorator

    @register_options("tool_use")
    @dataclass
    class ToolUseOptions: ...

and one import line at the bottom of this file makes them known (the kind itself is
built by ptrain/envs/registry.py; validation checks `kind` against this module's `KIND_OPTIONS`).

Jax-free: config validation imports it before any device is touched.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ptrain.config.choices import TASK_OPS
from ptrain.config.env_options import KIND_OPTIONS, MAX_TIMEOUT_S, EnvConfigError, register_options


@dataclass
class EnvConfig:
    kind: str = "arithmetic"
    """Environment kind, one of KIND_OPTIONS (arithmetic, countdown, math,
    code, reasoning_gym, ...)."""
    name: str | None = None
    """Name in metrics, audit records and task ids; null: the kind. Two environments of one
    stage need distinct names (e.g. two countdown mixes of different difficulty)."""
    weight: float = 1.0
    """Mixing weight (> 0): the share of a stage's tasks drawn from this environment is
    weight / (sum of the stage's weights)."""
    n_train: int = 1000
    """Training tasks (>= 1): generated ones, or at most this many rows of a given file."""
    n_eval: int = 100
    """Held-out tasks (>= 0), disjoint from the training ones."""
    seed: int | None = None
    """Seed of the task generator (>= 0); the same seed and options give the same tasks.
    null: derived from the run's seed (ptrain/config/seeds.py) by the stage."""
    max_new_tokens: int | None = None
    """Output tokens per sample (>= 1) for this environment's requests; null: the stage's
    sampling budget."""
    reward_timeout_s: float = 10.0
    """Wall seconds (> 0) one reward computation (a math-verify comparison, a scorer) may take;
    past it the sample scores 0 with reward_error set and the stage counts it."""
    reward_workers: int = 2
    """Worker processes (>= 1) that run this environment's reward code (ptrain.envs.safety):
    a hang is bounded by killing its worker, and a slow environment does not hold the others."""
    score_truncated: bool = False
    """Score samples that hit the token limit (finish "length") like any other. False: they
    get reward 0 and metric truncated=1 without being scored (length shaping such as DAPO's
    overlong penalty belongs to the RL stage, not here)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of the kind, checked against its dataclass below (envs.<name>.options.<key>)."""

    @property
    def env_name(self) -> str:
        """The environment's name: `name`, or the kind when name is null."""
        return self.name if self.name else self.kind


# ----------------------------------------------------------------------------- per-kind options

MAX_REWARD_WORKERS = 256
"""Upper bound of env.reward_workers: each is a worker process (sandboxed) or thread."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise EnvConfigError(f"config key '{key}': {msg}")


def _check_rewards(opts: Any, where: str) -> None:
    for name in ("format_reward", "correct_reward"):
        value = getattr(opts, name)
        _check(value >= 0, f"{where}.{name}", f"must be >= 0, got {value}")


def _check_jsonl(path: str | None, key: str) -> None:
    if path is not None:
        _check(
            os.path.isfile(path),
            key,
            f"no file '{path}'; pass a JSONL file (one JSON object per line), or null for the generated tasks",
        )


@register_options("arithmetic")
@dataclass
class ArithmeticOptions:
    """The embedded arithmetic task (ptrain.data.tasks): `What is a op b?`, graded on the
    completion's last `Answer: n` line."""

    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    """Operations drawn from, each equally likely: '+', '-' (result never negative), '*'
    (multi-digit times one digit)."""
    min_digits: int = 2
    """Fewest digits of the first operand (1 <= min_digits <= max_digits)."""
    max_digits: int = 3
    """Most digits of the first operand (and of the second for + and -), at most 9."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion that has an `Answer: n` line."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for the right answer."""

    def validate(self, where: str) -> None:
        _check(bool(self.ops), f"{where}.ops", f"pass at least one of {list(TASK_OPS)}")
        bad = [op for op in self.ops if op not in TASK_OPS]
        _check(not bad, f"{where}.ops", f"unknown operation(s) {bad}; valid ones are {list(TASK_OPS)}")
        _check(
            1 <= self.min_digits <= self.max_digits <= 9,
            f"{where}.min_digits",
            f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits} and {self.max_digits}",
        )
        _check_rewards(self, where)


@register_options("countdown")
@dataclass
class CountdownOptions:
    """Countdown (TinyZero's task): reach a target with some given numbers, + - * / and
    parentheses; the expression goes in <answer>...</answer> and is parsed, never evaluated
    as Python. Every task is built from an expression that reaches its target, so each one
    has a solution."""

    min_numbers: int = 3
    """Fewest numbers given (>= 2)."""
    max_numbers: int = 4
    """Most numbers given (>= min_numbers, <= 8)."""
    min_value: int = 1
    """Smallest number given (>= 1)."""
    max_value: int = 99
    """Largest number given (>= min_value)."""
    min_target: int = 10
    """Smallest target (>= 1)."""
    max_target: int = 100
    """Largest target (>= min_target)."""
    use_all_numbers: bool = False
    """True: the answer must use every given number exactly once. False: each at most once
    (as many times as it appears in the list)."""
    max_answer_chars: int = 256
    """Longer answers are refused unparsed (bounds the parser's work)."""
    format_reward: float = 0.1
    """Reward component `format` (>= 0) for a well-formed expression in answer tags. With
    correct_reward 0.9 the totals are TinyZero's: 0 (no answer), 0.1 (wrong), 1.0 (right)."""
    correct_reward: float = 0.9
    """Reward component `correct` (>= 0) for an expression that uses allowed numbers and
    equals the target."""

    def validate(self, where: str) -> None:
        _check(
            2 <= self.min_numbers <= self.max_numbers <= 8,
            f"{where}.min_numbers",
            f"need 2 <= min_numbers <= max_numbers <= 8, got {self.min_numbers} and {self.max_numbers}",
        )
        _check(
            1 <= self.min_value <= self.max_value,
            f"{where}.min_value",
            f"need 1 <= min_value <= max_value, got {self.min_value} and {self.max_value}",
        )
        _check(
            1 <= self.min_target <= self.max_target,
            f"{where}.min_target",
            f"need 1 <= min_target <= max_target, got {self.min_target} and {self.max_target}",
        )
        _check(self.max_answer_chars >= 16, f"{where}.max_answer_chars", f"must be >= 16, got {self.max_answer_chars}")
        _check_rewards(self, where)


REVERSE_TEXT_MAX_CHARS = 1000
"""Longest text a reverse_text task may ask to reverse (options.max_chars)."""
REVERSE_TEXT_MAX_WORD_CHARS = 8
"""Longest word of reverse_text's word list (ptrain/envs/reverse_text.py): the least max_chars,
so that some text fits."""


@register_options("reverse_text")
@dataclass
class ReverseTextOptions:
    """Reverse a text character by character (prime-rl's reverse-text example): the texts are
    lowercase words from a built-in list joined by spaces, generated from the seed; the answer
    goes in <reversed_text>...</reversed_text> and scores its difflib.SequenceMatcher ratio
    against the reversed text (dense: 1.0 only for the exact reversal)."""

    min_chars: int = 20
    """Shortest text (>= 1 character)."""
    max_chars: int = 60
    """Longest text (>= min_chars, >= 8 so that any word fits, <= 1000)."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion with a non-empty
    <reversed_text>...</reversed_text>."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0): correct_reward times the similarity ratio in [0, 1]
    of the answer to the reversed text. An episode counts as correct (pass rate, eval accuracy)
    only when that component reaches 1, the exact reversal with correct_reward 1."""

    def validate(self, where: str) -> None:
        _check(
            1 <= self.min_chars <= self.max_chars,
            f"{where}.min_chars",
            f"need 1 <= min_chars <= max_chars, got {self.min_chars} and {self.max_chars}; "
            "lower min_chars or raise max_chars",
        )
        _check(
            REVERSE_TEXT_MAX_WORD_CHARS <= self.max_chars <= REVERSE_TEXT_MAX_CHARS,
            f"{where}.max_chars",
            f"need {REVERSE_TEXT_MAX_WORD_CHARS} <= max_chars <= {REVERSE_TEXT_MAX_CHARS} (the longest word must "
            f"fit), got {self.max_chars}",
        )
        _check_rewards(self, where)


MATH_FAMILIES = ("linear", "fractions", "word")
"""Generated math task families: linear equations, fraction arithmetic, word problems."""
MATH_ANSWER_FORMATS = ("boxed", "answer_tag", "think_answer")


@register_options("math")
@dataclass
class MathOptions:
    """Math with a final answer, checked for equivalence by math-verify (bounded by
    env.reward_timeout_s in a worker process)."""

    families: list[str] = field(default_factory=lambda: list(MATH_FAMILIES))
    """Generated families drawn from, equally: linear (solve a x + b = c), fractions (p/q op
    r/s in lowest terms), word (arithmetic word problems from templates). Unused with path."""
    path: str | None = None
    """JSONL rows {"question": str, "answer": str} (optional "id") instead of generated
    tasks: the training split, and the held-out one too when eval_path is null (its first
    n_eval rows, the rest train)."""
    eval_path: str | None = None
    """JSONL rows of the held-out split (same fields); null: from path as above."""
    answer_format: str = "boxed"
    """What the prompt asks for: boxed (\\boxed{...}), answer_tag (<answer>...</answer>), or
    think_answer (DeepSeek-R1's template: the reasoning in <think>...</think>, then the answer
    in <answer>...</answer>, and nothing else). Any extractable answer is graded for
    correctness; with think_answer, only a completion of exactly that shape counts as
    formatted (so a chat template that opens <think> in the generation prompt itself, as R1's
    distilled models' do, never earns it: use answer_tag there)."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a formatted completion: one with an extractable
    final answer, and with answer_format think_answer one of R1's shape."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for an answer equivalent to the reference."""

    def validate(self, where: str) -> None:
        bad = [f for f in self.families if f not in MATH_FAMILIES]
        _check(not bad, f"{where}.families", f"unknown families {bad}; valid ones are {list(MATH_FAMILIES)}")
        _check(
            bool(self.families) or self.path is not None,
            f"{where}.families",
            f"pass at least one of {list(MATH_FAMILIES)}, or a path",
        )
        _check(
            self.answer_format in MATH_ANSWER_FORMATS,
            f"{where}.answer_format",
            f"pass one of {list(MATH_ANSWER_FORMATS)}, got {self.answer_format!r}",
        )
        _check_jsonl(self.path, f"{where}.path")
        _check_jsonl(self.eval_path, f"{where}.eval_path")
        _check(
            self.eval_path is None or self.path is not None,
            f"{where}.eval_path",
            "eval_path needs path (the training rows) as well",
        )
        _check_rewards(self, where)


CODE_FAMILIES = (
    "filter_divisible", "count_char", "rotate_list", "running", "dedupe", "kth_largest",
    "run_length", "digit_sum", "caesar", "merge_sorted", "max_window_sum", "fizzbuzz",
)  # fmt: skip
"""Generated function-writing families (ptrain/envs/code.py): each has a reference
implementation that produces the hidden tests, and a parameter that varies between tasks."""


@register_options("code")
@dataclass
class CodeOptions:
    """Write a Python function; hidden unit tests run in the sandbox (ptrain.sandbox),
    all in one process with one result line per test; reward = fraction passed."""

    families: list[str] = field(default_factory=lambda: list(CODE_FAMILIES))
    """Generated families drawn from, equally (ptrain/envs/code.py lists them). Unused with path."""
    path: str | None = None
    """JSONL rows {"prompt": str, "tests": [str, ...] or str} (optional "id") instead of
    generated tasks: each test is Python source (usually one assert) run after the
    completion's code; a string holds one test per top-level statement. Held out as for math."""
    eval_path: str | None = None
    """JSONL rows of the held-out split (same fields); null: the first n_eval rows of path."""
    tests_per_task: int = 8
    """Hidden tests of a generated task (>= 1)."""
    test_timeout_s: float = 2.0
    """Wall seconds (> 0) one test may run inside the sandbox before it counts as failed
    (the sandbox's own timeout bounds the whole run)."""
    max_concurrent_runs: int = 8
    """Sandboxed test runs of this environment at once (>= 1)."""
    require_code_block: bool = True
    """Take the code from the completion's last ```python block (no block: reward 0,
    formatted=0, nothing runs). False: the whole completion when it has no block."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion with a code block."""
    correct_reward: float = 1.0
    """Reward component `tests`: correct_reward times the fraction of tests passed."""

    def validate(self, where: str) -> None:
        bad = [f for f in self.families if f not in CODE_FAMILIES]
        _check(not bad, f"{where}.families", f"unknown families {bad}; valid ones are {list(CODE_FAMILIES)}")
        _check(
            bool(self.families) or self.path is not None,
            f"{where}.families",
            f"pass at least one of {list(CODE_FAMILIES)}, or a path",
        )
        _check(self.tests_per_task >= 1, f"{where}.tests_per_task", f"must be >= 1, got {self.tests_per_task}")
        _check(
            0 < self.test_timeout_s <= MAX_TIMEOUT_S,
            f"{where}.test_timeout_s",
            f"must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (one day), got {self.test_timeout_s}",
        )
        _check(
            self.max_concurrent_runs >= 1,
            f"{where}.max_concurrent_runs",
            f"must be >= 1, got {self.max_concurrent_runs}",
        )
        _check_jsonl(self.path, f"{where}.path")
        _check_jsonl(self.eval_path, f"{where}.eval_path")
        _check(
            self.eval_path is None or self.path is not None,
            f"{where}.eval_path",
            "eval_path needs path (the training rows) as well",
        )
        _check_rewards(self, where)


@register_options("reasoning_gym")
@dataclass
class ReasoningGymOptions:
    """Any procedural dataset of the `reasoning-gym` package, generated locally (no download)
    and scored by the dataset's own `score_answer` on the completion's <answer> tag."""

    datasets: list[str] = field(default_factory=lambda: ["leg_counting"])
    """reasoning-gym dataset names (reasoning_gym.factory.DATASETS), drawn by dataset_weights."""
    dataset_configs: dict[str, Any] = field(default_factory=dict)
    """Per dataset name, keyword arguments of its config dataclass (e.g. {"leg_counting":
    {"min_animals": 2}}); size and seed are set by the environment."""
    dataset_weights: dict[str, Any] = field(default_factory=dict)
    """Per dataset name, its share of the tasks (> 0); missing names weigh 1."""
    instruction: str = "Give your final answer inside <answer></answer> tags."
    """Appended to every question: the answer format the scorer reads."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion with an <answer> tag."""
    correct_reward: float = 1.0
    """Reward component `correct`: correct_reward times the dataset's score in [0, 1]."""

    def validate(self, where: str) -> None:
        _check(bool(self.datasets), f"{where}.datasets", "pass at least one reasoning-gym dataset name")
        _check(len(set(self.datasets)) == len(self.datasets), f"{where}.datasets", f"names repeat in {self.datasets}")
        try:
            from reasoning_gym.factory import DATASETS
        except ImportError:
            raise EnvConfigError(
                f"config key '{where}.datasets': the reasoning-gym package is not installed; pip install reasoning-gym"
            ) from None
        bad = [d for d in self.datasets if d not in DATASETS]
        _check(
            not bad, f"{where}.datasets", f"unknown reasoning-gym dataset(s) {bad}; valid ones are {sorted(DATASETS)}"
        )
        for key, mapping in (("dataset_configs", self.dataset_configs), ("dataset_weights", self.dataset_weights)):
            extra = sorted(set(mapping) - set(self.datasets))
            _check(not extra, f"{where}.{key}", f"names {extra} are not in datasets {self.datasets}")
        for name, conf in self.dataset_configs.items():
            _check(isinstance(conf, Mapping), f"{where}.dataset_configs.{name}", f"must be a mapping, got {conf!r}")
            _, config_cls = DATASETS[name]
            valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
            bad = sorted(k for k in conf if k not in valid)
            _check(
                not bad,
                f"{where}.dataset_configs.{name}",
                f"unknown key(s) {bad} for {config_cls.__name__}; valid keys: {', '.join(valid)}",
            )
        for name in self.datasets:
            # The dataset's own checks (asserts in its config's validate()), here rather than
            # as a traceback when the stage builds the tasks.
            _, config_cls = DATASETS[name]
            try:
                config = config_cls(**self.dataset_configs.get(name, {}), size=1, seed=0)
                if hasattr(config, "validate"):
                    config.validate()
            except Exception as e:
                raise EnvConfigError(
                    f"config key '{where}.dataset_configs.{name}': {config_cls.__name__} refuses it: "
                    f"{type(e).__name__}: {e}"
                ) from None
        for name, w in self.dataset_weights.items():
            _check(
                isinstance(w, int | float) and not isinstance(w, bool) and w > 0,
                f"{where}.dataset_weights.{name}",
                f"must be a number > 0, got {w!r}",
            )
        _check_rewards(self, where)


# ----------------------------------------------------------------------------- validation


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as the declared type `tp` (int, float, bool, str, list[X], dict[str, X], X | None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return _coerce(value, others[0], key)
    if tp is Any:
        return value
    if tp is bool:
        _check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        _check(isinstance(value, int | float) and not isinstance(value, bool), key, f"must be a number, got {value!r}")
        # No option means anything at inf or nan: an infinite timeout overflows the waits
        # that use it, an infinite reward or penalty turns every advantage into nan.
        _check(math.isfinite(value), key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        # Any sequence or mapping: plain containers, or OmegaConf's ListConfig / DictConfig.
        _check(isinstance(value, Sequence) and not isinstance(value, str), key, f"must be a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(tp) or (str, Any)
        _check(isinstance(value, Mapping), key, f"must be a mapping, got {value!r}")
        for k in value:
            _check(isinstance(k, str), key, f"keys must be strings, got {k!r}")
        return {k: _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    raise TypeError(f"{key}: options field type {_type_name(tp)} is not supported by validate_env_config")


def build_options(cls: type, options: Mapping[str, Any] | None, where: str) -> Any:
    """An instance of options dataclass `cls` from a mapping; EnvConfigError names the bad key
    (`<where>.<key>`) and lists the valid keys, or names a value of the wrong type."""
    options = dict(options or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in options if k not in fields)
    if unknown:
        raise EnvConfigError(
            f"config key '{where}.{unknown[0]}': not an option of this kind; valid keys: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in options.items()}
    opts = cls(**values)
    if hasattr(opts, "validate"):
        opts.validate(where)
    return opts


def validate_env_config(cfg: EnvConfig) -> Any:
    """Check an EnvConfig and return its typed options (the kind's dataclass).

    Raises EnvConfigError naming `envs.<name>.<field>` or `envs.<name>.options.<key>` and what
    to pass (the valid kinds, the valid option keys, the allowed range).
    """
    name = cfg.env_name
    where = f"envs.{name}"
    _check(
        isinstance(cfg.kind, str) and cfg.kind in KIND_OPTIONS,
        f"{where}.kind",
        f"unknown environment kind {cfg.kind!r}; valid kinds: {', '.join(KIND_OPTIONS)}",
    )
    _check(
        isinstance(name, str) and name.strip() == name and "/" not in name and name not in (".", "..", "all"),
        f"{where}.name",
        f"must be a non-empty name without '/' or surrounding spaces, and not 'all' (the metrics of "
        f"every environment together), got {name!r}",
    )
    _check(
        0 < cfg.weight < math.inf,
        f"{where}.weight",
        f"must be a finite number > 0 (a share of the mix), got {cfg.weight}",
    )
    _check(cfg.n_train >= 1, f"{where}.n_train", f"must be >= 1, got {cfg.n_train}")
    _check(cfg.n_eval >= 0, f"{where}.n_eval", f"must be >= 0, got {cfg.n_eval}")
    _check(cfg.seed is None or cfg.seed >= 0, f"{where}.seed", f"must be >= 0 or null, got {cfg.seed}")
    _check(
        cfg.max_new_tokens is None or cfg.max_new_tokens >= 1,
        f"{where}.max_new_tokens",
        f"must be >= 1 or null (the stage's budget), got {cfg.max_new_tokens}",
    )
    _check(
        0 < cfg.reward_timeout_s <= MAX_TIMEOUT_S,
        f"{where}.reward_timeout_s",
        f"must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (one day), got {cfg.reward_timeout_s}",
    )
    _check(
        1 <= cfg.reward_workers <= MAX_REWARD_WORKERS,
        f"{where}.reward_workers",
        f"must be between 1 and {MAX_REWARD_WORKERS} (each is a process or a thread), got {cfg.reward_workers}",
    )
    _check(isinstance(cfg.options, Mapping), f"{where}.options", f"must be a mapping, got {cfg.options!r}")
    cls = KIND_OPTIONS.get(cfg.kind)
    _check(
        cls is not None,
        f"{where}.kind",
        f"kind {cfg.kind!r} has no options dataclass; decorate one with "
        "ptrain.config.env.register_options and import its module in ptrain/config/env.py",
    )
    return build_options(cls, cfg.options, f"{where}.options")


def validate_env_configs(cfgs: list[EnvConfig]) -> list[Any]:
    """validate_env_config for each environment of a stage, plus distinct names."""
    seen: dict[str, int] = {}
    for i, cfg in enumerate(cfgs):
        name = cfg.env_name
        _check(
            name not in seen,
            f"envs.{name}.name",
            f"environments {seen.get(name)} and {i} are both named {name!r}; give one a distinct name",
        )
        seen[name] = i
    return [validate_env_config(cfg) for cfg in cfgs]


def register_env_configs() -> None:
    """Register `env/schema` (EnvConfig) in Hydra's ConfigStore, which conf/env/*.yaml extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="env", name="schema", node=EnvConfig)


# Options of kinds defined in other modules (each registers itself on import), one line each:
import ptrain.config.env_judge  # noqa: E402, F401  (judge)
import ptrain.config.env_multi_turn  # noqa: E402, F401  (tool_use, long_horizon, terminal)
import ptrain.config.env_nemo_gym  # noqa: E402, F401  (nemo_gym)
import ptrain.config.env_verifiable  # noqa: E402, F401  (mcqa, instruction_following, structured_output, long_context)
import ptrain.config.env_verifiers  # noqa: E402, F401  (verifiers)
