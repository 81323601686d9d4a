"""Config of GRPO-family stages (`algo.grpo`) and of environment evaluation (`algo.eval`).
Jax-free: the CLI validates these before importing jax. The rollout engine's config is
rollout.py, the price table cost.py.

Every field is documented where declared. Three option groups are classes of their own, which
`algo.grpo` extends (the keys stay flat: `algo.grpo.clip_low`, `algo.grpo.temperature`, ...) and
which their users take whole, each checking itself once:

  PolicyLossConfig  ptrain/config/policy_loss.py  the loss: ptrain.losses.policy_loss(..., cfg=)
  SamplingConfig    ptrain/config/sampling.py     the rollouts' sampling: cfg.sampling_params()
  AdvantageConfig   ptrain/config/advantages.py   ptrain.losses.group_advantages(..., cfg=)

The rest (batch shape, updates, DAPO's data shaping, curriculum, asynchrony) is the stage's own
and checked here, with the checks that span groups (overlong_buffer < max_new_tokens). The named
algorithms are presets of these fields (recipes/ and the table below):

  GRPO      baseline mean, normalize_std, aggregation seq_mean_token_mean, kl_coef 0.04
  Dr. GRPO  baseline mean, normalize_std false, aggregation seq_mean_token_sum_norm, kl_coef 0
  DAPO      clip_high 0.28, aggregation token_mean, dynamic_sampling, overlong_filter or
            overlong_buffer, kl_coef 0, dual_clip 10
  GSPO      ratio_level sequence, clip_low 3e-4, clip_high 4e-4, aggregation seq_mean_token_mean
  CISPO     objective cispo, clip_low 1 (no lower bound), clip_high 4
  RLOO      baseline leave_one_out (normalize_std true or false)

Key order. A dataclass lists inherited fields base-most first, and the resolved config (`--cfg
job`, the pinned copies under tests/golden/recipes) lists algo.grpo's keys in the order of the
sections below: loss, rollout batch, sampling, updates, advantages, the rest. The two private
layers (_LossAndBatch, _SamplingAndUpdates) stack the groups in that order; they hold no logic.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from ptrain.config.advantages import AdvantageConfig
from ptrain.config.choices import GRPO_MODES
from ptrain.config.policy_loss import PolicyLossConfig
from ptrain.config.sampling import SamplingConfig


@dataclass
class _LossAndBatch(PolicyLossConfig):
    """Key order only (module docstring): the loss's fields, then the rollout batch's shape."""

    # --- rollouts ---
    prompts_per_step: int = 8
    """Tasks (prompts) per optimizer step's rollout batch (> 0)."""
    group_size: int = 8
    """Samples per prompt, G (>= 2: the group baseline needs two)."""


@dataclass
class _SamplingAndUpdates(SamplingConfig, _LossAndBatch):
    """Key order only (module docstring): then the sampling's fields (SamplingConfig), then the
    updates."""

    # --- updates ---
    epochs: int = 1
    """Passes over each rollout batch (>= 1). More than one makes the update off-policy and
    needs the proximal log-probs (computed before the first pass)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the rollout batch is split into this many parts (>= 1;
    must divide prompts_per_step * group_size). train.steps counts rollout batches."""
    bucket_lengths: bool = True
    """Train each rollout batch at the shortest of train.seq_len, seq_len/2, seq_len/4, ...
    (at least 128 tokens, a multiple of mesh.context) that holds its longest sample, so short
    samples are not trained at the full context's cost; a stage compiles one step per length
    it meets (at most log2(seq_len / 128) + 1). false: every batch at seq_len, one compile."""
    pack_rows: bool = False
    """Pack several samples into each row (first fit in decreasing length; attention and every
    per-sequence quantity stay within a sample), so a batch of mixed lengths trains on far fewer
    rows: worth it when a few samples run long and most stay short. The row count is rounded to
    one of a few sizes (rows x 1, 3/4, 1/2, 3/8, ...), and a stage compiles its step once per
    (row count, row length) it meets. With mini_batches > 1 the rows, not the samples, are
    split, so a mini-batch of short samples holds more of them than one of long samples."""


@dataclass
class GRPOAlgoConfig(AdvantageConfig, _SamplingAndUpdates):
    """An RL stage's options: the policy loss's (PolicyLossConfig: objective, clip_low, ...
    kl_coef, is_correction, ...), the rollout batch's shape (prompts_per_step, group_size), the
    sampling's (SamplingConfig: temperature, top_p, top_k, max_new_tokens), the updates' (epochs,
    mini_batches), the advantages' (AdvantageConfig: baseline, normalize_std,
    invalid_tool_call_advantage), and the data shaping, curriculum and asynchrony around them."""

    # --- loss: every field of PolicyLossConfig (ptrain/config/policy_loss.py), inherited ---
    is_correction: str | None = "tis"
    """Engine-vs-trainer importance weight exp(old - engine): null | tis (truncated) | mis
    (masked, IcePop / Nemotron). An RL stage corrects by default (the loss alone does not)."""

    # --- DAPO's data shaping ---
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and draw more prompts until the batch is full."""
    max_sampling_rounds: int = 3
    """Rollout rounds per step at most when dynamic_sampling is on (>= 1); a batch still short
    after them trains on what it has (counted)."""
    overlong_filter: bool = False
    """Trajectories cut by the length limit leave the loss (DAPO's overlong filtering)."""
    overlong_buffer: int = 0
    """Soft overlong penalty: the last `overlong_buffer` tokens before max_new_tokens cost
    reward linearly up to overlong_penalty (DAPO; 0: off). Counted in response tokens."""
    overlong_penalty: float = 1.0
    """Reward taken at max_new_tokens when overlong_buffer > 0 (>= 0)."""

    # --- curriculum ---
    drop_solved: bool = False
    """Skip prompts every sample of which was correct when last drawn (Nemotron 3 drops prompts
    the SFT model always solves)."""
    pass_rate_target: float | None = None
    """Gaussian pass-rate curriculum: draw prompts with weight exp(-(p - target)^2 / 2 width^2)
    over their last seen pass rate p (None: uniform)."""
    pass_rate_width: float = 0.25
    """Width of that Gaussian (> 0)."""
    pass_rate_target_end: float | None = None
    """Where the target moves, linearly over the stage's steps (prompts_per_step draws a step),
    e.g. 0.8 -> 0.2 moves from easy to hard prompts as Nemotron 3 Nano does; None: fixed."""

    # --- asynchrony ---
    mode: str = "sync"
    """sync: generate, then train, strictly on-policy. async: the next batches are generated
    while this one trains, at most max_staleness weight versions behind."""
    max_staleness: int | None = None
    """async only: a sample generated with weights more than this many versions older than the
    ones it trains is dropped and regenerated (>= 0; 0 is sync with overlap of nothing). null:
    DEFAULT_MAX_STALENESS (1). Setting it with mode=sync is an error, not a silent no-op."""
    partial_rollouts: bool = True
    """async: at a weight update, running samples continue with the new weights (their
    weight_versions record the switch); false: they finish on the old weights first."""

    # --- MoE ---
    freeze_router: bool = False
    """Keep router weights fixed (Nemotron 3's RL); with router_aux_loss_coef 0 and the
    expert-bias update on, routing still balances."""


DEFAULT_MAX_STALENESS = 1
"""algo.grpo.max_staleness of an async stage that leaves it null."""


def staleness_bound(cfg: GRPOAlgoConfig) -> int:
    """The weight versions an async sample may lag behind: algo.grpo.max_staleness, or
    DEFAULT_MAX_STALENESS when it is null."""
    return DEFAULT_MAX_STALENESS if cfg.max_staleness is None else cfg.max_staleness


@dataclass
class LmEvalConfig:
    """lm-evaluation-harness tasks an `eval` stage runs (`algo.eval.lm_eval`): the stage serves
    its model in process on a loopback port with `python -m ptrain.serve`'s routes and points
    lm-eval's `local-completions` model at it, so loglikelihood (multiple_choice) and
    generate_until tasks both run. Needs the optional extra: pip install ".[lm_eval]".

        python -m ptrain recipe=eval model=hf model.hf_path=DIR "algo.eval.lm_eval.tasks=[my_task]" \
            algo.eval.lm_eval.include_path=tasks/
    """

    tasks: list[str] = field(default_factory=list)
    """lm-eval task or group names (`lm_eval --tasks`); empty: lm-eval does not run. Most of
    lm-eval's own tasks download their data from the Hugging Face hub; tasks of your own over
    local files come from `include_path`. Metrics: `eval/lm_eval/<task>/<metric>` (a filter
    other than "none" adds `/<filter>`), also in the stage's DONE.json."""
    include_path: str | None = None
    """A folder of task YAMLs (lm-eval's --include_path), e.g. tasks over local JSONL
    (`dataset_path: json`, `dataset_kwargs.data_files`); null: lm-eval's own tasks only."""
    limit: int | None = None
    """Documents per task at most (>= 1); null: every document."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (>= 0); null: each task's own default."""
    batch_size: int = 1
    """Prompts per /v1/completions request (>= 1); the server batches the requests in flight
    either way, so this trades HTTP round trips against lm-eval's progress granularity."""


@dataclass
class EvalAlgoConfig:
    """How environments are evaluated: by `eval` stages, and every train.eval_every steps by
    RL stages. Greedy pass@1 is always reported; samples > 0 adds sampled metrics."""

    limit: int | None = None
    """Held-out tasks per environment (>= 1); null: all of each environment's eval tasks."""
    samples: int = 0
    """0: greedy decoding only. k > 0: also k samples per task at `temperature`, reported as
    the mean reward, avg@k accuracy and pass@k for every k in `pass_k` up to k."""
    temperature: float = 1.0
    """Temperature of those samples (> 0)."""
    max_new_tokens: int = 128
    """Output tokens per sample (>= 1)."""
    pass_k: list[int] = field(default_factory=lambda: [1, 4, 8])
    """The k of pass@k (each >= 1; those above `samples` are skipped)."""
    thinking_budgets: list[int] = field(default_factory=list)
    """Thinking budgets B (each >= 0) to evaluate greedily besides the unlimited run: the
    prompt states B as Nano's template does and the engine forces </think> after B
    reasoning tokens; reported as <env>/budget_B/<metric> and budget_B/pass@1."""
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """lm-evaluation-harness tasks an `eval` stage also runs (LmEvalConfig; RL stages' periodic
    evaluation does not run them)."""
    judge_calibration: str | None = None
    """A JSONL of response pairs with a known verdict, `{"messages": [...], "response_1": ..,
    "response_2": .., "better": 1 or 2}`, that an `eval` stage has its judge environment
    (kind judge, its own judge: the policy or an endpoint) compare; reported as
    judge_calibration/agreement (the share it gets right), /rows and /unparsed."""


def validate_eval(cfg: EvalAlgoConfig, check) -> None:
    """Reject impossible evaluation settings; `check(cond, key, message)` raises naming the key."""
    check(cfg.limit is None or cfg.limit >= 1, "algo.eval.limit", f"must be null or >= 1, got {cfg.limit}")
    check(cfg.samples >= 0, "algo.eval.samples", f"must be >= 0 (0: greedy only), got {cfg.samples}")
    check(cfg.temperature > 0, "algo.eval.temperature", f"must be > 0, got {cfg.temperature}")
    check(cfg.max_new_tokens >= 1, "algo.eval.max_new_tokens", f"must be >= 1, got {cfg.max_new_tokens}")
    check(all(k >= 1 for k in cfg.pass_k), "algo.eval.pass_k", f"every k must be >= 1, got {list(cfg.pass_k)}")
    check(all(b >= 0 for b in cfg.thinking_budgets), "algo.eval.thinking_budgets",
          f"every budget must be >= 0 (tokens of reasoning), got {list(cfg.thinking_budgets)}")  # fmt: skip
    validate_lm_eval(cfg.lm_eval, check)
    check(cfg.judge_calibration is None or os.path.isfile(cfg.judge_calibration), "algo.eval.judge_calibration",
          f"'{cfg.judge_calibration}' is not a file; pass a JSONL of judged pairs, or null")  # fmt: skip


def validate_lm_eval(cfg: LmEvalConfig, check) -> None:
    """Reject lm-eval settings that cannot run, before the stage loads a model."""
    key = "algo.eval.lm_eval"
    bad = [t for t in cfg.tasks if not isinstance(t, str) or not t.strip()]
    check(not bad, f"{key}.tasks", f"every task must be a non-empty name, got {list(cfg.tasks)}")
    check(
        cfg.limit is None or cfg.limit >= 1, f"{key}.limit", f"must be null (every document) or >= 1, got {cfg.limit}"
    )
    check(cfg.num_fewshot is None or cfg.num_fewshot >= 0, f"{key}.num_fewshot",
          f"must be null (the task's default) or >= 0, got {cfg.num_fewshot}")  # fmt: skip
    check(cfg.batch_size >= 1, f"{key}.batch_size", f"must be >= 1, got {cfg.batch_size}")
    check(cfg.include_path is None or os.path.isdir(cfg.include_path), f"{key}.include_path",
          f"'{cfg.include_path}' is not a folder; pass a folder of task YAMLs, or null")  # fmt: skip
    check(not cfg.tasks or importlib.util.find_spec("lm_eval") is not None, f"{key}.tasks",
          'lm-evaluation-harness is not installed; pip install "lm-eval[api]==0.4.13" (the lm_eval extra: pip '
          'install ".[lm_eval]"), or leave tasks empty')  # fmt: skip


def validate_grpo(cfg: GRPOAlgoConfig, check) -> None:
    """Reject impossible values; `check(cond, key, message)` raises naming the key. The option
    groups check themselves (sampling_problems, advantage_problems, problems); this reports
    their problems under algo.grpo.<field> and checks the stage's own fields."""
    c = check

    def report(problems: list[tuple[str, str]]) -> None:
        for key, text in problems:
            c(False, f"algo.grpo.{key}", text)

    c(cfg.prompts_per_step > 0, "algo.grpo.prompts_per_step", f"must be > 0, got {cfg.prompts_per_step}")
    c(cfg.group_size >= 2, "algo.grpo.group_size", f"must be >= 2 (the group baseline needs two), got {cfg.group_size}")
    report(cfg.sampling_problems())  # SamplingConfig
    c(cfg.epochs >= 1, "algo.grpo.epochs", f"must be >= 1, got {cfg.epochs}")
    c(cfg.mini_batches >= 1, "algo.grpo.mini_batches", f"must be >= 1, got {cfg.mini_batches}")
    rows = cfg.prompts_per_step * cfg.group_size
    c(rows % cfg.mini_batches == 0, "algo.grpo.mini_batches",
      f"{cfg.mini_batches} does not divide the {rows} samples of a step (prompts_per_step x group_size)")  # fmt: skip
    report(cfg.advantage_problems())  # AdvantageConfig
    c(cfg.mode in GRPO_MODES, "algo.grpo.mode",
      f"unknown value {cfg.mode!r}; pass one of {', '.join(map(str, GRPO_MODES))}")  # fmt: skip
    report(cfg.problems())  # the policy loss's own checks (PolicyLossConfig)
    c(cfg.max_sampling_rounds >= 1, "algo.grpo.max_sampling_rounds", f"must be >= 1, got {cfg.max_sampling_rounds}")
    c(0 <= cfg.overlong_buffer < cfg.max_new_tokens, "algo.grpo.overlong_buffer",
      f"must be in [0, max_new_tokens={cfg.max_new_tokens}), got {cfg.overlong_buffer}")  # fmt: skip
    c(cfg.overlong_penalty >= 0, "algo.grpo.overlong_penalty", f"must be >= 0, got {cfg.overlong_penalty}")
    c(cfg.pass_rate_target is None or 0 <= cfg.pass_rate_target <= 1, "algo.grpo.pass_rate_target",
      f"must be null or in [0, 1], got {cfg.pass_rate_target}")  # fmt: skip
    c(cfg.pass_rate_width > 0, "algo.grpo.pass_rate_width", f"must be > 0, got {cfg.pass_rate_width}")
    c(cfg.pass_rate_target_end is None or 0 <= cfg.pass_rate_target_end <= 1, "algo.grpo.pass_rate_target_end",
      f"must be null or in [0, 1], got {cfg.pass_rate_target_end}")  # fmt: skip
    c(cfg.pass_rate_target_end is None or cfg.pass_rate_target is not None, "algo.grpo.pass_rate_target_end",
      "a moving target needs its start: pass algo.grpo.pass_rate_target too (e.g. 0.8 -> 0.2)")  # fmt: skip
    c(cfg.max_staleness is None or cfg.max_staleness >= 0, "algo.grpo.max_staleness",
      f"must be null or >= 0, got {cfg.max_staleness}")  # fmt: skip
    c(cfg.max_staleness is None or cfg.mode == "async", "algo.grpo.max_staleness",
      f"only applies to mode=async (how many weight versions a sample may lag), but mode is {cfg.mode!r}, "
      f"where every sample is on-policy; drop algo.grpo.max_staleness={cfg.max_staleness}, or pass "
      "algo.grpo.mode=async")  # fmt: skip
