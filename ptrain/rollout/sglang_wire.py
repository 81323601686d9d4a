"""SGLang's native HTTP wire format, translated to and from the rollout protocol.

Pure functions shared by the HTTP server (`python -m ptrain.serve`) and the fleet client:

    parse_generate(body, tokenize=...)     `/generate` JSON -> ParsedGenerate (GenerateRequests, one a prompt)
    generate_item(sample, ...)             one Sample -> one response object {text, output_ids, meta_info}
    order_items(items_per_prompt, ...)     the response body: a dict, or a list in prompt-major order
    sample_from_item(item, prompt_ids)     a response object -> Sample (what a client reads back)

Facts this module encodes (SGLang 0.5.23, `srt/managers/io_struct.py` GenerateReqInput and
`srt/managers/tokenizer_manager.py`):
- a request has `text` or `input_ids`, one prompt or a batch (a list of them);
- `sampling_params` is one object or one a prompt; `n` must be equal across a batch; with
  n > 1 the answer is a list where index i*n + j is sample j of prompt i (a single prompt with
  n > 1 also answers with a list); per-prompt lists of `return_logprob` or
  `logprob_start_len` are refused with n > 1, as SGLang refuses them;
- a batch's string `rid` names prompt i `f"{rid}_{i}"`; a list gives one rid a prompt;
- `logprob_start_len` -1 (the default) returns output log-probs only; k >= 0 also returns
  `input_token_logprobs` for prompt tokens k.., the first of them with log-prob null;
- log-prob entries are `[logprob, token_id, text | null]` triples; with return_logprob,
  `top_logprobs_num` k >= 1 adds `output_top_logprobs` (a list of k entries a token) and, with
  `logprob_start_len` >= 0, `input_top_logprobs` (null for the first prompt token);
- unknown top-level keys are ignored (SGLang's schema says so); unknown `sampling_params`
  keys are refused (`SamplingParams.from_dict`);
- `lora_path` names a loaded LoRA adapter (by its name, not a folder): one for every prompt,
  or a list with one a prompt (null: the base model); with n > 1 each prompt's samples share
  its adapter;
- a thinking budget is `max_thinking_tokens` (a non-negative integer) or
  `sampling_params.custom_params.thinking_budget`, which SGLang's tokenizer manager sets from
  it; SGLang enforces either only with --enable-strict-thinking (or its
  ThinkingBudgetLogitProcessor), this engine always.
Fields SGLang has that this engine cannot honour are refused unless they hold SGLang's
default, so nothing a client asks for is silently dropped (`DEFAULT_ONLY_FIELDS`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ptrain.rollout.protocol import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    GenerateRequest,
    RequestError,
    Sample,
    SamplingParams,
    WeightSpan,
)

# GenerateReqInput fields this server reads (their SGLang defaults).
IMPLEMENTED_FIELDS: dict[str, Any] = {
    "rid": None,
    "text": None,
    "input_ids": None,
    "sampling_params": None,
    "return_logprob": None,
    "logprob_start_len": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "return_prompt_token_ids": False,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "max_thinking_tokens": None,
    "lora_path": None,
}
# Fields that route, label, log or partition the cache; they cannot change what is
# sampled, so they are accepted and have no effect on one engine.
NO_EFFECT_FIELDS: dict[str, Any] = {
    "session_id": None,
    "log_metrics": True,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
    "routing_key": None,
    "conversation_id": None,
    "http_worker_ipc": None,
    "priority": None,
    "extra_key": None,
    "cache_salt": None,
    "no_logs": False,
    "custom_labels": None,
    "received_time": None,
    "external_trace_header": None,
    "kv_hints": None,
}
# Fields for features this engine lacks (multimodal input, hidden states, PD disaggregation,
# sessions, ...), and `lora_id` (SGLang's tokenizer manager fills it in from `lora_path`; a
# client never sends it): refused unless they hold SGLang's default.
DEFAULT_ONLY_FIELDS: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "watermark": None,
    "return_sampling_mask": None,
    "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "background": False,
    "require_reasoning": False,
    "return_bytes": False,
    "return_entropy": False,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
}
# What to use instead of a refused field, where there is something.
INSTEAD: dict[str, str] = {
    "custom_logit_processor": "; for a thinking budget send max_thinking_tokens or "
    "sampling_params.custom_params.thinking_budget, which this server enforces without a logit processor",
    "lora_id": "; it is the id SGLang assigns a loaded adapter internally: name the adapter in lora_path",
}
# Sampling keys the server implements itself on top of the engine (detokenisation).
SERVER_SAMPLING_KEYS: dict[str, Any] = {"skip_special_tokens": True}

# `/update_weights_from_disk` (UpdateWeightFromDiskReqInput) and the control bodies, with SGLang's
# defaults; `rid` and `http_worker_ipc` come from SGLang's BaseReq and have no effect here.
BASE_REQ_FIELDS: dict[str, Any] = {"rid": None, "http_worker_ipc": None}
UPDATE_WEIGHTS_FIELDS: dict[str, Any] = {
    **BASE_REQ_FIELDS,
    "model_path": None,
    "load_format": None,
    "abort_all_requests": False,
    "weight_version": None,
    "is_async": False,
    "torch_empty_cache": False,
    "keep_pause": False,
    "recapture_cuda_graph": False,
    "token_step": 0,
    "flush_cache": True,
    "manifest": None,
}
LOAD_FORMATS = (None, "auto", "safetensors")
PAUSE_FIELDS: dict[str, Any] = {**BASE_REQ_FIELDS, "mode": "abort"}
PAUSE_MODES = ("abort", "retract", "in_place")
CONTINUE_FIELDS: dict[str, Any] = {**BASE_REQ_FIELDS, "torch_empty_cache": True}
# `/load_lora_adapter` and `/unload_lora_adapter` (LoadLoRAAdapterReqInput,
# UnloadLoRAAdapterReqInput); `lora_id` is assigned by the server, never sent by a client.
LOAD_LORA_FIELDS: dict[str, Any] = {
    **BASE_REQ_FIELDS,
    "lora_name": None,
    "lora_path": None,
    "pinned": False,
    "lora_id": None,
}
UNLOAD_LORA_FIELDS: dict[str, Any] = {**BASE_REQ_FIELDS, "lora_name": None, "lora_id": None}
ABORT_FIELDS: dict[str, Any] = {
    **BASE_REQ_FIELDS,
    "rid": "",
    "abort_all": False,
    "finished_reason": None,
    "abort_message": None,
    "weight_versions": None,
}


def is_default(value: Any, default: Any) -> bool:
    """True when `value` means SGLang's default: equal to it, null, or empty where the default is falsy."""
    if value is None or value == default:
        return True
    return not default and isinstance(value, (list, dict, str)) and not value


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def type_name(x: Any) -> str:
    """A JSON type name for error messages."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, int):
        return "an integer"
    if isinstance(x, float):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "a list"
    if isinstance(x, dict):
        return "an object"
    return type(x).__name__


def expect_bool(body: dict, key: str, default: bool) -> bool:
    """body[key] as a bool (null: default); RequestError names the key otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key}: must be true or false, got {type_name(v)}")
    return v


def check_fields(body: dict, where: str, known: dict[str, Any], *, unknown: str = "refuse") -> None:
    """RequestError for keys of `body` not in `known` (unknown="refuse"); "ignore" lets them pass."""
    if unknown == "refuse":
        extra = sorted(k for k in body if k not in known)
        if extra:
            raise RequestError(f"{where}: unknown field(s) {extra}; valid fields are {sorted(known)}")


@dataclass(frozen=True)
class ParsedGenerate:
    """A `/generate` body, validated and split into one engine request a prompt."""

    requests: tuple[GenerateRequest, ...]
    """One a prompt, in prompt order; each carries the prompt's n."""
    single: bool
    """One prompt given as a prompt (not a batch of one) and n == 1: the answer is one object."""
    n: int
    stream: bool
    return_logprob: tuple[bool, ...]
    """Per prompt."""
    logprob_start_len: tuple[int, ...]
    """Per prompt; -1 for output log-probs only."""
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    skip_special_tokens: tuple[bool, ...]
    """Per prompt: detokenise without special tokens (SGLang's default)."""
    ignored_fields: tuple[str, ...] = field(default=())
    """Top-level keys SGLang does not know (ignored, as SGLang ignores them)."""


def _per_prompt(body: dict, key: str, count: int, default: Any, check: Callable[[Any, str], Any], n: int) -> list:
    """A field that is one value for every prompt or a list with one a prompt."""
    v = body.get(key)
    if v is None:
        return [default] * count
    if isinstance(v, list):
        if n > 1:
            raise RequestError(f"{key}: a per-prompt list cannot be combined with sampling_params.n > 1 (SGLang)")
        if len(v) != count:
            raise RequestError(f"{key}: has {len(v)} entries for {count} prompts; give one a prompt or a single value")
        return [default if x is None else check(x, f"{key}[{i}]") for i, x in enumerate(v)]
    return [check(v, key)] * count


def lora_paths_of(value: Any, count: int, where: str = "lora_path") -> list[str | None]:
    """SGLang's `lora_path`: one adapter name for every prompt, or a list with one a prompt
    (null: the base model) -> one name (or None) a prompt."""
    if value is None or value == [] or value == "":  # SGLang: no adapter (`if not obj.lora_path`)
        return [None] * count
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{where}: has {len(value)} entries for {count} prompts; give one a prompt "
                               "(null for the base model) or a single adapter name")  # fmt: skip
        return [_lora_name(x, f"{where}[{i}]") for i, x in enumerate(value)]
    return [_lora_name(value, where)] * count


def _lora_name(x: Any, where: str) -> str | None:
    if x is None:
        return None
    if not isinstance(x, str) or not x:
        raise RequestError(f"{where}: must be the name of a loaded LoRA adapter (a non-empty string) or null, "
                           f"got {type_name(x) if not isinstance(x, str) else 'an empty string'}")  # fmt: skip
    return x


def _check_bool(x: Any, where: str) -> bool:
    if not isinstance(x, bool):
        raise RequestError(f"{where}: must be true or false, got {type_name(x)}")
    return x


def _check_int(x: Any, where: str) -> int:
    if not _is_int(x):
        raise RequestError(f"{where}: must be an integer, got {type_name(x)}")
    return x


def _check_top_logprobs_num(x: Any, where: str) -> int:
    if not _is_int(x) or not 0 <= x <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"{where}: must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per position), got {x!r}"
        )
    return x


def _token_ids(x: Any, where: str) -> list[int]:
    if not isinstance(x, list) or not all(_is_int(t) for t in x):
        raise RequestError(f"{where}: must be a list of integer token ids, got {type_name(x)}")
    if not x:
        raise RequestError(f"{where}: is empty; a prompt needs at least one token")
    return x


def prompts_of(body: dict, tokenize: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether one prompt was given as a prompt (not a batch)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' (a string or a list of strings) or 'input_ids'")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise RequestError(
                f"input_ids: must be a list of token ids or a list of such lists, got {type_name(input_ids)}"
            )
        if not input_ids:
            raise RequestError("input_ids: is empty; a prompt needs at least one token")
        if all(_is_int(t) for t in input_ids):
            return [list(input_ids)], True
        if all(isinstance(p, list) for p in input_ids):
            return [_token_ids(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)], False
        raise RequestError("input_ids: must be a list of integer token ids or a list of such lists (a batch)")
    if tokenize is None:
        raise RequestError(
            "text: this server has no tokenizer (started with --skip-tokenizer-init); send input_ids instead"
        )
    if isinstance(text, str):
        texts, single = [text], True
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        texts, single = text, False
    else:
        raise RequestError(f"text: must be a string or a non-empty list of strings, got {type_name(text)}")
    prompts = []
    for i, t in enumerate(texts):
        ids = tokenize(t)
        if not ids:
            where = "text" if single else f"text[{i}]"
            raise RequestError(f"{where}: tokenises to no tokens; a prompt needs at least one")
        prompts.append(ids)
    return prompts, single


def _rids(body: dict, count: int, single: bool) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        if not rid:
            raise RequestError("rid: is empty; leave it out for a generated id")
        return [rid] if single else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        if len(rid) != count:
            raise RequestError(f"rid: has {len(rid)} ids for {count} prompts; give one a prompt")
        if len(set(rid)) != len(rid):
            raise RequestError(f"rid: duplicate request ids {sorted({r for r in rid if rid.count(r) > 1})}")
        return list(rid)
    raise RequestError(f"rid: must be a non-empty string or a list of them, got {type_name(rid)}")


def parse_sampling(d: Any, where: str = "sampling_params") -> tuple[SamplingParams, dict[str, Any]]:
    """One `sampling_params` object -> (engine SamplingParams, server-side options); RequestError names the key."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise RequestError(f"{where}: must be an object, got {type_name(d)}")
    d = dict(d)
    server = {k: d.pop(k) for k in list(d) if k in SERVER_SAMPLING_KEYS}
    for k, v in server.items():
        if v is None:
            server[k] = SERVER_SAMPLING_KEYS[k]
        elif not isinstance(v, bool):
            raise RequestError(f"{where}.{k}: must be true or false, got {type_name(v)}")
    try:
        params = SamplingParams.from_dict(d)
    except RequestError as e:
        msg = str(e)
        raise RequestError(msg.replace("sampling_params", where, 1) if where != "sampling_params" else msg) from None
    return params, {**SERVER_SAMPLING_KEYS, **server}


def with_max_thinking_tokens(
    value: Any, parsed: list[tuple[SamplingParams, dict[str, Any]]]
) -> list[tuple[SamplingParams, dict[str, Any]]]:
    """Each prompt's sampling with GenerateReqInput's `max_thinking_tokens` as its thinking
    budget (SGLang copies it into custom_params.thinking_budget); RequestError when the two disagree."""
    if value is None:
        return parsed
    if not _is_int(value) or value < 0:
        raise RequestError(
            f"max_thinking_tokens: must be an integer >= 0 (reasoning tokens at most), got {value!r}; "
            "leave it out for no limit"
        )
    out = []
    for params, server in parsed:
        if params.thinking_budget not in (None, value):
            raise RequestError(
                f"max_thinking_tokens={value} and sampling_params.custom_params.thinking_budget="
                f"{params.thinking_budget} disagree; give the thinking budget once"
            )
        out.append((replace(params, thinking_budget=value), server))
    return out


def parse_generate(body: Any, *, tokenize: Callable[[str], list[int]] | None = None) -> ParsedGenerate:
    """A `/generate` JSON body -> ParsedGenerate; RequestError (HTTP 400) names the field and the fix."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object (GenerateReqInput), got {type_name(body)}")
    for key, default in DEFAULT_ONLY_FIELDS.items():
        if key in body and not is_default(body[key], default):
            raise RequestError(
                f"{key}: this server does not implement it; leave it out (SGLang's default is {default!r})"
                + INSTEAD.get(key, "")
            )
    v = body.get("token_ids_logprob")
    if v not in (None, []) and not (isinstance(v, list) and all(x in ([], None) for x in v)):
        raise RequestError(
            "token_ids_logprob: chosen-token log-probs are not implemented; leave it out (top_logprobs_num "
            "gives the most likely tokens' log-probs, return_logprob the sampled tokens')"
        )
    prompts, single = prompts_of(body, tokenize)
    count = len(prompts)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != count:
            raise RequestError(f"sampling_params: has {len(sp)} entries for {count} prompts; give one a prompt")
        parsed = [parse_sampling(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        parsed = [parse_sampling(sp)] * count
    parsed = with_max_thinking_tokens(body.get("max_thinking_tokens"), parsed)
    ns = {p.n for p, _ in parsed}
    if len(ns) > 1:
        raise RequestError(f"sampling_params: n must be equal for every prompt of a batch, got {sorted(ns)}")
    n = ns.pop()
    stream = expect_bool(body, "stream", False)
    return_logprob = _per_prompt(body, "return_logprob", count, False, _check_bool, n)
    start = _per_prompt(body, "logprob_start_len", count, -1, _check_int, n)
    top = _per_prompt(body, "top_logprobs_num", count, 0, _check_top_logprobs_num, n)
    rids = _rids(body, count, single)
    loras = lora_paths_of(body.get("lora_path"), count)
    requests = []
    for i, (ids, (params, _), k, want, n_top) in enumerate(zip(prompts, parsed, start, return_logprob, top)):
        where = "logprob_start_len" if single else f"logprob_start_len[{i}]"
        if k < -1:
            raise RequestError(f"{where}: must be -1 (output log-probs only) or a prompt position >= 0, got {k}")
        if want and k >= len(ids):
            raise RequestError(f"{where}: {k} is not below the prompt's {len(ids)} tokens; use a smaller value or -1")
        requests.append(
            GenerateRequest(
                input_ids=tuple(ids),
                sampling=params,
                rid=rids[i],
                return_prompt_logprobs_from=k if want and k >= 0 else None,
                lora_path=loras[i],
                top_logprobs_num=n_top if want else 0,  # SGLang returns top log-probs with return_logprob only
            )
        )
    known = {**IMPLEMENTED_FIELDS, **NO_EFFECT_FIELDS, **DEFAULT_ONLY_FIELDS}
    return ParsedGenerate(
        requests=tuple(requests),
        single=single and n == 1,
        n=n,
        stream=stream,
        return_logprob=tuple(return_logprob),
        logprob_start_len=tuple(start),
        return_text_in_logprobs=expect_bool(body, "return_text_in_logprobs", False),
        return_prompt_token_ids=expect_bool(body, "return_prompt_token_ids", False),
        skip_special_tokens=tuple(s["skip_special_tokens"] for _, s in parsed),
        ignored_fields=tuple(sorted(k for k in body if k not in known)),
    )


def finite_or_none(x: float) -> float | None:
    """JSON has no infinities or NaN; SGLang's schema allows a null log-prob."""
    return x if math.isfinite(x) else None


def logprob_entries(
    logprobs: Sequence[float | None], token_ids: Sequence[int], texts: Sequence[str] | None
) -> list[list]:
    """SGLang's `[logprob, token_id, text | null]` triples."""
    if texts is None:
        return [[None if lp is None else finite_or_none(lp), t, None] for lp, t in zip(logprobs, token_ids)]
    return [[None if lp is None else finite_or_none(lp), t, s] for lp, t, s in zip(logprobs, token_ids, texts)]


def top_entries(
    alternatives: Sequence[tuple[int, float]], token_texts: Callable[[Sequence[int]], list[str]] | None
) -> list[list]:
    """One position's top log-probs as SGLang's `[logprob, token_id, text | null]` triples."""
    ids = [t for t, _ in alternatives]
    return logprob_entries([lp for _, lp in alternatives], ids, token_texts(ids) if token_texts else None)


def _top_of(entries: Any) -> tuple[tuple[int, float], ...] | None:
    """SGLang's triples of one position -> (token id, log-prob) pairs; None stays None."""
    if entries is None:
        return None
    return tuple((int(e[1]), math.nan if e[0] is None else float(e[0])) for e in entries)


def meta_info(sample: Sample) -> dict[str, Any]:
    """SGLang's `meta_info` for a sample (no log-prob lists), with its weight-version spans."""
    meta = sample.meta_info()
    meta["e2e_latency"] = float(sample.e2e_latency_s)
    if sample.weight_versions:
        end = len(sample.output_ids)
        spans = [s for s in sample.weight_versions if s.start < end or s.start == 0]
        meta["weight_versions"] = [{"version": s.version, "start": s.start, "end": min(s.end, end)} for s in spans]
    return meta


def generate_item(
    sample: Sample,
    *,
    text: str | None,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    token_texts: Callable[[Sequence[int]], list[str]] | None = None,
    return_prompt_token_ids: bool = False,
    index: int | None = None,
) -> dict[str, Any]:
    """One SGLang response object for `sample`: text (None: left out, as SGLang does without a
    tokenizer), output_ids, meta_info (with log-prob triples when asked), index (streamed batches)."""
    meta = meta_info(sample)
    if return_logprob:
        out_texts = token_texts(sample.output_ids) if token_texts else None
        meta["output_token_logprobs"] = logprob_entries(sample.logprobs, sample.output_ids, out_texts)
        meta["output_token_logprobs_length"] = len(sample.output_ids)
        if sample.top_logprobs is not None:
            meta["output_top_logprobs"] = [top_entries(t, token_texts) for t in sample.top_logprobs]
        if logprob_start_len >= 0 and sample.prompt_logprobs is not None:
            # SGLang answers tokens k.. with a null first log-prob: the values of tokens k+1..
            # are the last len(ids) - 1 the engine returned (an engine may also give token k's).
            ids = sample.prompt_ids[logprob_start_len:]
            tail = sample.prompt_logprobs[len(sample.prompt_logprobs) - (len(ids) - 1) :] if len(ids) > 1 else ()
            values = [None, *tail]
            meta["input_token_logprobs"] = logprob_entries(values, ids, token_texts(ids) if token_texts else None)
            if sample.prompt_top_logprobs is not None:
                tops = sample.prompt_top_logprobs
                tops = tops[len(tops) - (len(ids) - 1) :] if len(ids) > 1 else ()
                meta["input_top_logprobs"] = [None, *(top_entries(t, token_texts) for t in tops)]
        else:
            meta["input_token_logprobs"] = []
    item: dict[str, Any] = {}
    if text is not None:
        item["text"] = text
    item["output_ids"] = list(sample.output_ids)
    item["meta_info"] = meta
    if return_prompt_token_ids:
        item["prompt_token_ids"] = list(sample.prompt_ids)
    if index is not None:
        item["index"] = index
    return item


def order_items(items_per_prompt: Sequence[Sequence[dict]], single: bool) -> dict | list[dict]:
    """The `/generate` body: one object for a single prompt with n == 1, else a list where
    index i*n + j is sample j of prompt i."""
    flat = [item for items in items_per_prompt for item in items]
    return flat[0] if single else flat


def finish_reason_from(d: dict | None) -> FinishReason | None:
    """SGLang's `finish_reason` object -> FinishReason (None while a streamed sample runs)."""
    if d is None:
        return None
    kind = d.get("type")
    if kind == "stop":
        matched = d.get("matched")
        return FinishReason("stop", matched=matched if _is_int(matched) else None)
    if kind == "length":
        return FinishReason("length", length=d.get("length"))
    if kind == "abort":
        return FinishReason("abort", message=d.get("message"))
    raise ValueError(f"finish_reason: unknown type {kind!r} in {d}")


def sample_from_item(item: dict, prompt_ids: Sequence[int], *, index: int = 0) -> Sample:
    """A response object (requested with return_logprob) -> Sample. SGLang reports one log-prob
    a token, so `sampling_logprobs` equals `logprobs` here."""
    meta = item["meta_info"]
    ids = tuple(item["output_ids"])
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("the response has no output_token_logprobs; send return_logprob: true")
    if [e[1] for e in entries] != list(ids):
        raise ValueError("output_token_logprobs do not match output_ids")
    logprobs = tuple(math.nan if e[0] is None else float(e[0]) for e in entries)
    spans = tuple(WeightSpan(s["version"], s["start"], s["end"]) for s in meta.get("weight_versions") or ())
    inputs = meta.get("input_token_logprobs") or []
    tops = meta.get("output_top_logprobs")
    input_tops = meta.get("input_top_logprobs")
    rid = meta.get("id", "")
    return Sample(
        rid=rid,
        index=index,
        prompt_ids=tuple(prompt_ids),
        output_ids=ids,
        logprobs=logprobs,
        sampling_logprobs=logprobs,
        finish_reason=finish_reason_from(meta.get("finish_reason")),
        weight_version=meta.get("weight_version") or "",
        weight_versions=spans,
        cached_tokens=meta.get("cached_tokens", 0),
        prompt_logprobs=tuple(float(e[0]) for e in inputs[1:]) if inputs else None,
        top_logprobs=None if tops is None else tuple(_top_of(t) or () for t in tops),
        prompt_top_logprobs=None if not input_tops else tuple(_top_of(t) or () for t in input_tops[1:]),
        e2e_latency_s=meta.get("e2e_latency") or 0.0,
    )
