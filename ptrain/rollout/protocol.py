"""The rollout-engine protocol: token ids in; token ids, log-probs and accounting out.

Every sampler in ptrain speaks it: the in-process `LocalEngine`, the SGLang fleet client,
and the `replay` engine of the environments. Requests and samples use SGLang's names
(`shared/reference/sglang_api.md`), so the HTTP server (`python -m ptrain.serve`) is a
thin translation and a fleet client reads SGLang's answers field for field.

    engine.submit(GenerateRequest(input_ids=[...], sampling=SamplingParams(n=8), rid="p0"))
        -> concurrent.futures.Future[list[Sample]]       (n samples, in order)
    await engine.generate(request)                          same, from asyncio
    engine.generate_many([request, ...])                    blocking, for stage drivers
    engine.abort("p0") / engine.abort()                     partial tokens, finish "abort"

Log-probs. `Sample.logprobs[i]` is log p(output_ids[i]) under the tempered full-vocabulary
softmax, softmax(logits / temperature) (temperature 0: the untempered softmax), which is
what the trainer's policy loss computes for the same tokens. Top-k / top-p / min-p change
which tokens can be drawn, not this number: the log-prob under the truncated distribution
actually sampled from is `Sample.sampling_logprobs`. Putting the truncated one into an
importance ratio would add log(kept mass) to every token's ratio.

Thinking budget. Reasoning models write `<think>...</think>` and then the answer; a budget
of B (`SamplingParams.thinking_budget`) lets a sample generate B tokens of reasoning, and if
it has not closed the reasoning itself by then, the engine forces the end-of-thinking token
sequence (`think_end_ids`, the tokenizer's `</think>`) and sampling goes on with the answer,
as Nemotron 3 Nano's budget control does (NVIDIA, arXiv 2512.20856 §2.7). On the wire it is
SGLang's `custom_params.thinking_budget` (what its strict-thinking grammar and its
ThinkingBudgetLogitProcessor read); a forced token's log-probs are under "Thinking budget"
in `ptrain.rollout.local`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FINISH_TYPES = ("stop", "length", "abort")

# SGLang's sampling-parameter names this engine implements, and the ones SGLang accepts
# that it does not: a request that sets one of those to a non-default value is refused
# (never silently ignored); an unknown key is refused as SGLang refuses it.
SAMPLING_KEYS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "n", "sampling_seed",
    "ignore_eos", "custom_params",
)  # fmt: skip
SGLANG_ONLY_KEYS: dict[str, Any] = {
    "stop": None, "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "stream_interval": None, "logit_bias": {},
    "beam_width": None, "watermark": None, "choice": [],
}  # fmt: skip
# `custom_params` is SGLang's free-form object for logit processors and its reasoning grammar;
# this engine reads these keys of it (SGLang's spellings) and refuses any other.
THINKING_BUDGET_KEY = "thinking_budget"
THINK_END_IDS_KEY = "__sglang_reasoning_end_token_ids"
"""SGLang's key for a request's own reasoning terminator (SGLang honours it only for the
terminators its reasoning parser lists; this engine takes any)."""
CUSTOM_PARAMS_KEYS = (THINKING_BUDGET_KEY, THINK_END_IDS_KEY)
MAX_THINK_END_IDS = 32
"""Longest end-of-thinking sequence (SGLang's limit on a request's reasoning terminator)."""
THINK_END_TEXT = "</think>"
"""The end-of-thinking text whose token ids the HTTP server forces (its tokenizer's encoding)."""
TOP_K_OFF = 1 << 30
"""SGLang's top_k default ("all tokens"); any top_k <= 0 or >= the vocabulary is also off."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a position's top log-probs may list (`GenerateRequest.top_logprobs_num`):
the cap of OpenAI's chat `top_logprobs` and vLLM's default `max_logprobs`."""


class EngineUnavailable(RuntimeError):
    """The engine cannot sample at all (no healthy worker of a fleet for its timeout). A stage
    that meets it saves a resumable checkpoint and stops with this message; resuming later
    re-syncs the engine first."""


class RequestError(ValueError):
    """A request that cannot be served as given; the message names the field and the fix.
    The HTTP server answers it with 400."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with SGLang's names and defaults."""

    max_new_tokens: int = 128
    """Tokens to generate at most (>= 0); the context length caps it further."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps every token."""
    top_k: int = TOP_K_OFF
    """Keep the k most likely tokens; <= 0 or >= vocabulary size keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (the stop token is part of the output)."""
    n: int = 1
    """Samples of this prompt (>= 1). They share one prefill (a GRPO group)."""
    sampling_seed: int | None = None
    """Seed of this request's samples: with it, sample j's tokens depend only on the seed,
    j, the prompt and the weights, not on what else the engine is running."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence ids (stop_token_ids still stop)."""
    thinking_budget: int | None = None
    """Reasoning tokens at most (>= 0; None: no limit). When the sample has generated this
    many tokens and they do not contain `think_end_ids`, the engine forces the rest of
    `think_end_ids` next, then samples the answer. Only generated tokens count: a prompt that
    already closed the reasoning (a reasoning-off template ending in `<think></think>`) needs
    no budget, and one sent with it would force `</think>` into the answer (the HTTP server
    drops the budget for such prompts). Wire: `custom_params.thinking_budget`."""
    think_end_ids: tuple[int, ...] = ()
    """The end-of-thinking token sequence (1 to MAX_THINK_END_IDS ids): the tokenizer's
    encoding of `</think>`, one special token for Qwen3 and several for a byte-level BPE
    without one. Needed with a thinking_budget; the HTTP server fills it from its tokenizer.
    Wire: `custom_params.__sglang_reasoning_end_token_ids`."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """From an SGLang `sampling_params` object; RequestError names a bad key or value."""
        d = dict(d or {})
        unknown = sorted(k for k in d if k not in SAMPLING_KEYS and k not in SGLANG_ONLY_KEYS)
        if unknown:
            raise RequestError(
                f"sampling_params: unknown key(s) {unknown}; valid keys are {sorted(SAMPLING_KEYS)} "
                "(and SGLang's others at their defaults)"
            )
        unsupported = sorted(k for k, default in SGLANG_ONLY_KEYS.items() if k in d and d[k] != default)
        if unsupported:
            raise RequestError(
                f"sampling_params: {unsupported} are SGLang options this engine does not implement; "
                f"leave them at their defaults, or use {sorted(SAMPLING_KEYS)}"
            )
        kw: dict[str, Any] = _custom_params(d.pop("custom_params", None))
        for k in SAMPLING_KEYS:
            if k in d and d[k] is not None:
                kw[k] = d[k]
        for k in ("max_new_tokens", "top_k", "n"):
            if k in kw and (isinstance(kw[k], bool) or not isinstance(kw[k], int)):
                raise RequestError(f"sampling_params.{k}: must be an integer, got {kw[k]!r}")
        for k in ("temperature", "top_p", "min_p"):
            if k in kw and (isinstance(kw[k], bool) or not isinstance(kw[k], (int, float))):
                raise RequestError(f"sampling_params.{k}: must be a number, got {kw[k]!r}")
            if k in kw:
                kw[k] = float(kw[k])
        if "sampling_seed" in kw and (
            isinstance(kw["sampling_seed"], bool) or not isinstance(kw["sampling_seed"], int)
        ):
            raise RequestError(f"sampling_params.sampling_seed: must be an integer, got {kw['sampling_seed']!r}")
        if "ignore_eos" in kw and not isinstance(kw["ignore_eos"], bool):
            raise RequestError(f"sampling_params.ignore_eos: must be true or false, got {kw['ignore_eos']!r}")
        if "stop_token_ids" in kw:
            ids = kw["stop_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise RequestError(f"sampling_params.stop_token_ids: must be a list of integers, got {ids!r}")
            kw["stop_token_ids"] = tuple(ids)
        params = cls(**kw)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """RequestError for values no engine can honour (and ids outside the vocabulary)."""
        if self.max_new_tokens < 0:
            raise RequestError(f"sampling_params.max_new_tokens: must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestError(f"sampling_params.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"sampling_params.min_p: must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise RequestError(f"sampling_params.n: must be >= 1, got {self.n}")
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed < 2**63:
            # A PRNG key takes a 64-bit seed; a larger one would fail inside the engine's thread.
            raise RequestError(f"sampling_params.sampling_seed: must fit in 64 bits (signed), got {self.sampling_seed}")
        budget = self.thinking_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise RequestError(
                f"sampling_params.custom_params.{THINKING_BUDGET_KEY} (SamplingParams.thinking_budget): must be an "
                f"integer >= 0, got {budget!r}; leave it out for no limit"
            )
        if len(self.think_end_ids) > MAX_THINK_END_IDS:
            raise RequestError(
                f"sampling_params.custom_params.{THINK_END_IDS_KEY} (SamplingParams.think_end_ids): at most "
                f"{MAX_THINK_END_IDS} ids, got {len(self.think_end_ids)}"
            )
        if vocab_size is not None:
            bad = [i for i in self.stop_token_ids if not 0 <= i < vocab_size]
            if bad:
                raise RequestError(f"sampling_params.stop_token_ids: {bad} outside the vocabulary [0, {vocab_size})")
            bad = [i for i in self.think_end_ids if not 0 <= i < vocab_size]
            if bad:
                raise RequestError(
                    f"sampling_params.custom_params.{THINK_END_IDS_KEY} (SamplingParams.think_end_ids): {bad} outside "
                    f"the vocabulary [0, {vocab_size})"
                )

    def to_dict(self) -> dict[str, Any]:
        """The SGLang `sampling_params` object (only fields that differ from the defaults; the
        thinking budget and its end ids go into `custom_params`, as `from_dict` reads them)."""
        out: dict[str, Any] = {}
        custom: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v == f.default:
                continue
            v = list(v) if isinstance(v, tuple) else v
            if f.name == "thinking_budget":
                custom[THINKING_BUDGET_KEY] = v
            elif f.name == "think_end_ids":
                custom[THINK_END_IDS_KEY] = v
            else:
                out[f.name] = v
        if custom:
            out["custom_params"] = custom
        return out


def _custom_params(cp: Any) -> dict[str, Any]:
    """SamplingParams keywords from SGLang's `custom_params` object; RequestError names a bad key."""
    if cp is None:
        return {}
    if not isinstance(cp, dict):
        raise RequestError(f"sampling_params.custom_params: must be an object, got {type(cp).__name__}")
    unknown = sorted(k for k in cp if k not in CUSTOM_PARAMS_KEYS)
    if unknown:
        raise RequestError(
            f"sampling_params.custom_params: key(s) {unknown} are not implemented by this engine; it reads only "
            f"{list(CUSTOM_PARAMS_KEYS)}"
        )
    kw: dict[str, Any] = {}
    budget = cp.get(THINKING_BUDGET_KEY)
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise RequestError(
                f"sampling_params.custom_params.{THINKING_BUDGET_KEY}: must be an integer (reasoning tokens at "
                f"most), got {budget!r}"
            )
        if budget < 0:
            raise RequestError(
                f"sampling_params.custom_params.{THINKING_BUDGET_KEY}: must be >= 0, got {budget}; leave it out "
                "(or null) for no limit"
            )
        kw["thinking_budget"] = budget
    ids = cp.get(THINK_END_IDS_KEY)
    if ids is not None:
        if (
            not isinstance(ids, (list, tuple))
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise RequestError(
                f"sampling_params.custom_params.{THINK_END_IDS_KEY}: must be a non-empty list of token ids "
                f"(the tokenizer's encoding of {THINK_END_TEXT!r}), got {ids!r}"
            )
        kw["think_end_ids"] = tuple(ids)
    return kw


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt, as token ids, and how to sample it."""

    input_ids: tuple[int, ...]
    """Prompt token ids (non-empty), used exactly as given (never re-tokenised)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""
    """Request id, unique among requests in flight (the engine makes one when empty);
    sample j of a request with n > 1 answers to `rid` and to `f"{rid}-{j}"` in abort."""
    return_prompt_logprobs_from: int | None = None
    """None: no prompt log-probs. k >= 0 (SGLang's logprob_start_len): log-probs of prompt
    tokens max(k, 1) .. L-1, each given the tokens before it, under the same tempered softmax
    as the output log-probs (the first token has none). Such a request is prefilled in full
    (no prefix-cache reuse)."""
    lora_path: str | None = None
    """The LoRA adapter to sample with, by the name it was loaded under (SGLang's `lora_path`);
    None: the base model."""
    top_logprobs_num: int = 0
    """0: no top log-probs. k in [1, MAX_TOP_LOGPROBS] (SGLang's top_logprobs_num): also the k
    most likely tokens and their log-probs, under the same tempered softmax as `logprobs`, at
    every output position and, with return_prompt_logprobs_from, every prompt position that
    has a log-prob. A scorer needs them to tell whether a continuation is the greedy one
    (lm-evaluation-harness's is_greedy); they cost a top-k over the vocabulary per position."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(self.input_ids))


@dataclass(frozen=True)
class FinishReason:
    """Why a sample ended: "stop" (matched: the stop token id), "length" (length: tokens
    generated), or "abort" (message)."""

    type: Literal["stop", "length", "abort"]
    matched: int | None = None
    length: int | None = None
    message: str | None = None

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's `meta_info.finish_reason` object."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message or "aborted"}


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens [start, end) were sampled with weight version `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class Sample:
    """One sampled continuation of a request's prompt (sample `index` of its n)."""

    rid: str
    index: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """log p(token) under the tempered full-vocabulary softmax (module docstring)."""
    sampling_logprobs: tuple[float, ...]
    """log p(token) under the truncated (top-k / top-p / min-p) distribution sampled from;
    equal to `logprobs` when nothing was truncated."""
    finish_reason: FinishReason | None
    """None only in the partial samples handed to `on_update` while the sample runs."""
    weight_version: str
    """Weight version of the last token (of the prompt when no token was generated)."""
    weight_versions: tuple[WeightSpan, ...] = ()
    """Versions over the output when the weights changed mid-sample (else one span)."""
    cached_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache (not recomputed)."""
    prompt_logprobs: tuple[float, ...] | None = None
    """With GenerateRequest.return_prompt_logprobs_from = k: log-probs of prompt tokens
    max(k, 1) .. L-1 (k = 0 or 1: all but the first)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """With GenerateRequest.top_logprobs_num = N: per output token, the N most likely tokens
    at its position as (token id, log-prob), most likely first."""
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """With top_logprobs_num = N and prompt log-probs asked: the same for each prompt token of
    `prompt_logprobs`, aligned with it."""
    queue_time_s: float = 0.0
    """Seconds from submission to admission (prefill start)."""
    first_token_time_s: float = 0.0
    """Seconds from submission to the first output token."""
    e2e_latency_s: float = 0.0
    """Seconds from submission to the end of the sample."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self) -> dict[str, Any]:
        """SGLang's `meta_info` for this sample (without log-prob lists)."""
        return {
            "id": self.rid if self.index == 0 else f"{self.rid}-{self.index}",
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_sglang(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": self.e2e_latency_s,
        }


@runtime_checkable
class RolloutEngine(Protocol):
    """What stages, environments and the HTTP server need of a sampler."""

    @property
    def weight_version(self) -> str: ...

    def submit(
        self, request: GenerateRequest, on_update: Callable[[list[Sample]], None] | None = None
    ) -> concurrent.futures.Future[list[Sample]]:
        """Queue a request; the future holds its n samples (index order) when all end.
        `on_update`, if given, is called from the engine's thread with the n samples as
        they stand (finish_reason None while a sample runs) whenever tokens were added;
        it must be cheap and must not block."""
        ...

    def abort(self, rid: str | None = None) -> int:
        """End the named request (or sample `rid-j`), or every request when None, with
        finish_reason abort and the tokens produced so far. Returns how many samples."""
        ...

    def close(self) -> None: ...


SWAP_MODES = ("drain", "abort", "in_place")
"""What a weight update does to the requests in flight: drain (they finish on the old
weights, then the swap), abort (they end now with their partial tokens), in_place (the
swap happens between two decode steps and they go on with the new weights; each sample's
weight_versions record the switch)."""


@runtime_checkable
class WeightSyncedEngine(RolloutEngine, Protocol):
    """A sampler an RL stage trains against: it also takes the trainer's new weights.
    LocalEngine swaps them in place; FleetEngine exports a versioned folder and has every
    worker load it (ptrain.rollout.weight_sync)."""

    def update_weights(
        self, params: Any, model_state: Any = None, *, weight_version: str | None = None, mode: str = "drain"
    ) -> str:
        """Serve `params` (the trainer's pure-dict params, and its non-trainable model state)
        from now on, as version `weight_version` (default: the next integer), handling the
        requests in flight as `mode` (one of SWAP_MODES) says. Blocks until every sampler
        serves them; returns the version. Raises on weights of another shape or dtype,
        leaving the old ones serving."""
        ...


class EngineBase:
    """Conveniences every engine gets from `submit`."""

    def submit(self, request, on_update=None):  # pragma: no cover - abstract
        raise NotImplementedError

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        return await asyncio.wrap_future(self.submit(request))

    def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[Sample]]:
        """Submit all, wait for all; results in request order (blocking)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - engines override
        pass
