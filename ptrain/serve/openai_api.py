"""OpenAI-compatible routes of `python -m ptrain.serve`: /v1/models, /v1/completions, /v1/chat/completions.

Shapes and defaults follow SGLang 0.5.23's OpenAI adapter (`srt/entrypoints/openai/protocol.py`
and `serving_*.py`), so agent harnesses and environment libraries that speak OpenAI work
unchanged:
- completions: `prompt` is a string, a list of strings, token ids or a list of token-id
  lists; choice i*n + j is sample j of prompt i; `logprobs: 0` returns the sampled tokens'
  log-probs (`echo` with it also the prompt's); `logprobs: N` (1 to 20) also `top_logprobs`, one
  `{token text: log-prob}` object a token with the N most likely tokens at its position (and the
  token itself, as OpenAI and vLLM add it), the first prompt token's null; `echo` with
  `max_tokens: 0` scores a prompt without sampling (what lm-evaluation-harness's loglikelihood
  requests need); `text_offset` is each token's character offset in the choice's text (by the
  token texts); `return_token_ids` adds `token_ids` and `prompt_token_ids` to each choice;
- chat: the model folder's chat template (or --chat-template) renders `messages` and `tools`;
  Qwen 2.5 / Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks in the output that
  name a declared tool become `message.tool_calls` (ids `call_...`, arguments a JSON string;
  finish_reason "tool_calls"), streamed as OpenAI streams them (`delta.tool_calls`: index, id,
  type and name, then the arguments) once each block closes; a block that is not such a call
  stays in the content as written. `tool_choice` "auto" (the default with tools) and "none"
  (tools not rendered) as OpenAI's; "required" and a named function start the reply with the
  call's opening (`<tool_call>`, or the call up to its arguments), which the model completes:
  no grammar holds the arguments to the tool's schema (a tool's `strict` is accepted, not
  enforced). `parallel_tool_calls: false` keeps the first call. `tool` messages and assistant
  messages with `tool_calls` render back through the template (arguments as objects);
  `logprobs: true` gives
  `choices[].logprobs.content`; `return_token_ids` adds `prompt_token_ids` and
  `response_token_ids`;
- sampling the request leaves out comes from the model's generation_config.json, then
  OpenAI's defaults; `stop` strings and `stop_token_ids` end a sample;
- unknown fields are ignored, as SGLang's pydantic models ignore them; fields for features
  this engine lacks (penalties, logit_bias, grammars, chat top log-probs, ...) are a 400 unless they
  hold the default;
- a thinking budget (reasoning tokens at most, then the server forces `</think>`) is the
  integer `thinking_budget`, our extension of OpenAI's schema, or SGLang's
  `custom_params.thinking_budget`; for chat also `chat_template_kwargs.reasoning_budget`,
  the variable Nemotron 3 Nano's template states the budget with, which is enforced as well
  (it still reaches the template); two of them that disagree are a 400;
- `stream: true` answers with SSE chunks ending in `data: [DONE]`; `stream_options.include_usage`
  adds a usage chunk;
- LoRA: `model` naming a loaded adapter, or SGLang's `<served-model>:<adapter>` (any
  `<base>:<adapter>`, as SGLang splits it), samples with that adapter; else the request's
  `lora_path` (an adapter name, or one a prompt) does. Any other `model` is the base model, as
  it is without LoRA; `/v1/models` lists the adapters with `parent` the served model.
Errors use SGLang's OpenAI ErrorResponse: `{"object": "error", "message", "type", "param", "code"}`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import MAX_TOP_LOGPROBS, GenerateRequest, RequestError
from ptrain.serve.server import (
    Frontend,
    HTTPError,
    Job,
    SampleView,
    held_back,
    json_response,
    parse_stops,
    read_json,
    until_done_or_gone,
)

OWNED_BY = "ptrain"
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
# Request fields (both routes) for features the engine lacks: refused unless at these defaults.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "min_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "stop_regex": None,
    "response_format": None,
    "suffix": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "session_params": None,
    "custom_logit_processor": None,
    "watermark": None,
    "images_config": None,
    "video_config": None,
    "mm_processor_kwargs": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "return_sampling_mask": False,
    "return_flat_raw_output_top_logprobs": False,
    "reasoning_effort": None,
    "thinking": None,
    "task": None,
}
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")


def openai_error(status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> Response:
    """SGLang's OpenAI-route error body."""
    return json_response(
        {"object": "error", "message": message, "type": err_type, "param": param, "code": status}, status
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _front(request: Request) -> Frontend:
    return request.app.state.front


def _check_json_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise HTTPError(400, "Unsupported Media Type: Only 'application/json' is allowed (set Content-Type)")


def _refuse_unsupported(body: dict) -> None:
    for key, default in UNSUPPORTED_FIELDS.items():
        if key in body and not wire.is_default(body[key], default):
            instead = " (for a thinking budget send thinking_budget)" if key == "custom_logit_processor" else ""
            raise RequestError(f"{key}: not implemented by this server; leave it out (default {default!r}){instead}")


def _int_field(body: dict, key: str, default: Any, *, minimum: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{key}: must be an integer, got {wire.type_name(v)}")
    if minimum is not None and v < minimum:
        raise RequestError(f"{key}: must be >= {minimum}, got {v}")
    return v


def _number_field(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{key}: must be a number, got {wire.type_name(v)}")
    return float(v)


def _thinking_budget(body: dict, *, chat: bool) -> int | None:
    """The request's thinking budget (module docstring): thinking_budget, custom_params.thinking_budget
    or, for chat, chat_template_kwargs.reasoning_budget; RequestError names a bad or disagreeing one."""
    given: dict[str, int] = {}
    v = _int_field(body, "thinking_budget", None, minimum=0)
    if v is not None:
        given["thinking_budget"] = v
    custom = body.get("custom_params")
    if isinstance(custom, dict) and custom.get("thinking_budget") is not None:
        v = custom["thinking_budget"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RequestError(f"custom_params.thinking_budget: must be an integer >= 0, got {v!r}")
        given["custom_params.thinking_budget"] = v
    kwargs = body.get("chat_template_kwargs")
    if chat and isinstance(kwargs, dict) and kwargs.get("reasoning_budget") is not None:
        v = kwargs["reasoning_budget"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RequestError(
                f"chat_template_kwargs.reasoning_budget: must be an integer >= 0 (reasoning tokens at most), "
                f"got {v!r}; leave it out for no limit"
            )
        given["chat_template_kwargs.reasoning_budget"] = v
    if len(set(given.values())) > 1:
        raise RequestError(f"thinking budgets disagree ({given}); give the budget once")
    return next(iter(given.values()), None)


def sampling_of(
    body: dict, front: Frontend, max_new_tokens: int, *, openai_defaults: dict, chat: bool = False
) -> dict[str, Any]:
    """An OpenAI request's sampling fields as an SGLang `sampling_params` object: the request's
    value, else the model's generation_config.json, else `openai_defaults`. `chat`: the
    template's reasoning_budget is a thinking budget too."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for key in ("temperature", "top_p", "min_p"):
        v = _number_field(body, key)
        if v is None:
            v = front.sampling_defaults.get(key, openai_defaults.get(key))
        if v is not None:
            sp[key] = v
    top_k = _int_field(body, "top_k", None)
    if top_k is None:
        top_k = front.sampling_defaults.get("top_k", openai_defaults.get("top_k"))
    if top_k is not None and top_k > 0:
        sp["top_k"] = top_k
    sp["n"] = _int_field(body, "n", 1)
    seed = _int_field(body, "seed", None)
    if seed is not None:
        sp["sampling_seed"] = seed
    for key in ("stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if body.get(key) is not None:
            sp[key] = body[key]
    custom = body.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise RequestError(f"custom_params: must be an object, got {wire.type_name(custom)}")
    budget = _thinking_budget(body, chat=chat)
    if budget is not None:
        custom = {**(custom or {}), "thinking_budget": budget}
    if custom:
        sp["custom_params"] = custom
    return sp


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"stream_options: must be an object, got {wire.type_name(options)}")
    return bool(options.get("include_usage"))


def _usage(views: Sequence[SampleView], n: int) -> dict[str, Any]:
    prompt = sum(views[i].sample.prompt_tokens for i in range(0, len(views), n))
    cached = sum(views[i].sample.cached_tokens for i in range(0, len(views), n))
    completion = sum(v.sample.completion_tokens for v in views)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "reasoning_tokens": 0,
    }


def _metadata(views: Sequence[SampleView]) -> dict[str, Any]:
    meta = wire.meta_info(views[0].sample)
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def _rids(body: dict, prefix: str, count: int) -> tuple[str, list[str]]:
    """(the response id, one engine request id a prompt): the request's `rid` or a new one."""
    rid = body.get("rid")
    if rid is None:
        rid = f"{prefix}{uuid.uuid4().hex}"
    if isinstance(rid, str) and rid:
        return rid, [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) and r for r in rid):
        return rid[0], list(rid)
    raise RequestError(f"rid: must be a non-empty string or one a prompt, got {wire.type_name(rid)}")


def adapter_of_model(front: Frontend, model: Any) -> str | None:
    """The LoRA adapter an OpenAI `model` names: a loaded adapter's own name, or the adapter
    of SGLang's `<base>:<adapter>` (the served name is matched whole first, since it may hold a
    colon itself); None for the served model and any other name (the base model, as without
    LoRA). Only a server that serves LoRA reads adapters out of model names."""
    if not front.lora_enabled or not isinstance(model, str) or model == front.served_model_name:
        return None
    if model in front.loaded_adapters():
        return model
    if ":" not in model:
        return None
    if model.startswith(front.served_model_name + ":"):
        adapter = model[len(front.served_model_name) + 1 :]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or None


def lora_of(front: Frontend, body: dict, count: int) -> tuple[list[str | None], str]:
    """(each prompt's adapter, the field that named it): `model`'s adapter first, as SGLang
    resolves it, else `lora_path`."""
    adapter = adapter_of_model(front, body.get("model"))
    if adapter is not None:
        return [adapter] * count, "model"
    return wire.lora_paths_of(body.get("lora_path"), count), "lora_path"


def _submit(
    front: Frontend,
    prompts: list[list[int]],
    sampling: dict,
    rids: list[str],
    *,
    prompt_logprobs: bool,
    watch: bool,
    loras: list[str | None],
    lora_field: str,
    top_logprobs: int = 0,
) -> Job:
    """Validate `sampling` (SGLang names) and submit one engine request a prompt, request i
    with adapter loras[i] (None: the base model) named by the request's `lora_field`."""
    try:
        rest, stops, no_trim = parse_stops(sampling, "sampling", front.detok is not None)
        params, server = wire.parse_sampling(rest, "sampling")
    except RequestError as e:  # name the OpenAI field, not the SGLang object it became
        message = str(e).replace("sampling.max_new_tokens", "max_tokens").replace("sampling.sampling_seed", "seed")
        raise RequestError(message.replace("sampling.", "").replace("sampling: ", "")) from None
    requests = [
        GenerateRequest(
            input_ids=tuple(ids),
            sampling=params,
            rid=rid,
            return_prompt_logprobs_from=0 if prompt_logprobs else None,
            lora_path=lora,
            top_logprobs_num=top_logprobs,
        )
        for ids, rid, lora in zip(prompts, rids, loras)
    ]
    count = len(requests)
    return front.job(
        requests,
        skip_special_tokens=[server["skip_special_tokens"]] * count,
        stops=[stops] * count,
        no_stop_trim=[no_trim] * count,
        watch=watch,
        lora_field=lora_field,
    )


# ---- /v1/models ----


def _model_card(front: Frontend) -> dict[str, Any]:
    name = front.served_model_name
    return {
        "id": name,
        "object": "model",
        "created": int(front.started),
        "owned_by": OWNED_BY,
        "root": name,
        "parent": None,
        "max_model_len": front.context_length,
    }


def _adapter_cards(front: Frontend) -> list[dict[str, Any]]:
    """The loaded LoRA adapters as SGLang lists them: id the adapter's name, root its folder,
    parent the served model, no max_model_len."""
    return [
        {
            "id": name,
            "object": "model",
            "created": int(front.started),
            "owned_by": OWNED_BY,
            "root": path,
            "parent": front.served_model_name,
            "max_model_len": None,
        }
        for name, path in front.loaded_adapters().items()
    ]


async def list_models(request: Request) -> Response:
    """GET /v1/models: the served model, then the loaded LoRA adapters."""
    front = _front(request)
    return json_response({"object": "list", "data": [_model_card(front), *_adapter_cards(front)]})


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}: the card, or 404 for another name."""
    front = _front(request)
    model = request.path_params["model"]
    if model != front.served_model_name:
        return json_response(
            {
                "error": {
                    "message": f"The model '{model}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            404,
        )
    return json_response(_model_card(front))


# ---- /v1/completions ----


def completion_prompts(prompt: Any, front: Frontend) -> tuple[list[list[int]], list[str] | None]:
    """(prompts as token ids, their texts when given as text)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(wire._is_int(t) for t in prompt):
        return [list(prompt)], None
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [wire._token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)], None
    elif prompt is None:
        raise RequestError("prompt: required (a string, a list of strings, token ids or a list of token-id lists)")
    else:
        raise RequestError(
            f"prompt: must be a string, a list of strings, token ids or a list of token-id lists, "
            f"got {wire.type_name(prompt)}"
        )
    if front.detok is None:
        raise RequestError("prompt: text prompts need the tokenizer (the server runs with --skip-tokenizer-init)")
    if not any(texts):
        raise RequestError("Prompt cannot be empty")
    prompts = [front.detok.encode(t) for t in texts]
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"prompt[{i}]: tokenises to no tokens; a prompt needs at least one")
    return prompts, list(texts)


def _token_texts(front: Frontend, ids: Sequence[int]) -> list[str]:
    return front.detok.token_texts(ids) if front.detok else [""] * len(ids)


def _top_dict(front: Frontend, alternatives: Sequence[tuple[int, float]], token: int, logprob: float) -> dict:
    """One position's `{token text: log-prob}`: its most likely tokens, most likely first, and the
    token itself if it is not among them (OpenAI's legacy API and vLLM add it). Two ids with the
    same text keep the larger log-prob."""
    pairs = [*alternatives, *([] if any(t == token for t, _ in alternatives) else [(token, logprob)])]
    out: dict[str, float | None] = {}
    for text, (_, lp) in zip(_token_texts(front, [t for t, _ in pairs]), pairs):
        out.setdefault(text, wire.finite_or_none(lp))
    return out


def _aligned(row: list, length: int) -> list:
    """`row` cut or padded with None to `length` entries (an engine that gave fewer)."""
    return (row + [None] * length)[:length]


def _completion_logprobs(
    front: Frontend, views: Sequence[SampleView], echo_prompt: bool, top: int = 0
) -> dict[str, Any]:
    """A completion choice's `logprobs` object: tokens (prompt ones too with echo), their
    log-probs, with top >= 1 each position's `_top_dict` (else an empty list, as for logprobs: 0),
    and each token's character offset in the choice's text."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict | None] = []
    for view in views:
        s = view.sample
        if echo_prompt:
            ids = list(s.prompt_ids)
            lps = list(s.prompt_logprobs or ())
            tokens += _token_texts(front, ids)
            values += _aligned([None, *(wire.finite_or_none(x) for x in lps)], len(ids))
            if top:
                alts = s.prompt_top_logprobs or ()
                row = [None, *(_top_dict(front, a, t, lp) for a, t, lp in zip(alts, ids[1:], lps))]
                tops += _aligned(row, len(ids))
        tokens += _token_texts(front, s.output_ids)
        values += [wire.finite_or_none(x) for x in s.logprobs]
        if top:
            alts = s.top_logprobs or ()
            row = [_top_dict(front, a, t, lp) for a, t, lp in zip(alts, s.output_ids, s.logprobs)]
            tops += _aligned(row, len(s.output_ids))
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops if top else []}


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    front = _front(request)
    _check_json_content_type(request)
    body = await read_json(request, front.max_request_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {wire.type_name(body)}")
    _refuse_unsupported(body)
    prompts, texts = completion_prompts(body.get("prompt"), front)
    max_tokens = _int_field(body, "max_tokens", 16)
    echo = bool(body.get("echo", False))
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise RequestError(
            f"max_tokens must be positive, got {max_tokens} (0 only with echo: true, to score the prompt)"
        )
    logprobs = _int_field(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}] (0: the tokens' own log-probs; N: also the "
            f"N most likely tokens at each position), got {logprobs}; pass at most {MAX_TOP_LOGPROBS}"
        )
    n = _int_field(body, "n", 1)
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise RequestError(f"best_of: only best_of == n ({n}) is supported, got {best_of!r}")
    stream = bool(body.get("stream", False))
    include_usage = _include_usage(body)
    return_token_ids = bool(body.get("return_token_ids", False))
    model = body.get("model") or front.served_model_name
    sampling = sampling_of(body, front, max_tokens, openai_defaults=OPENAI_DEFAULTS)
    response_id, rids = _rids(body, "cmpl-", len(prompts))
    loras, lora_field = lora_of(front, body, len(prompts))
    job = _submit(
        front,
        prompts,
        sampling,
        rids,
        prompt_logprobs=echo and logprobs is not None,
        watch=stream,
        loras=loras,
        lora_field=lora_field,
        top_logprobs=logprobs or 0,
    )
    n = job.requests[0].sampling.n
    echo_texts = None
    if echo:
        echo_texts = texts or [front.detok.text(p) if front.detok else "" for p in prompts]
    created = int(time.time())

    def choice(i: int, view: SampleView, *, text: str) -> dict[str, Any]:
        finish = view.finish_reason
        c: dict[str, Any] = {
            "index": i * n + view.sample.index,
            "text": text,
            "logprobs": None,
            "finish_reason": None if finish is None else finish["type"],
            "matched_stop": None if finish is None else finish.get("matched"),
        }
        if return_token_ids:
            c["token_ids"] = list(view.sample.output_ids)
            c["prompt_token_ids"] = list(view.sample.prompt_ids)
        return c

    if stream:

        async def events() -> AsyncIterator[bytes]:
            sent_text: dict[tuple[int, int], int] = {}
            sent_tokens: dict[tuple[int, int], int] = {}
            finals: dict[tuple[int, int], SampleView] = {}
            try:
                async for i, view, final in job.updates():
                    key = (i, view.sample.index)
                    text = view.text or ""
                    first = key not in sent_text
                    delta = text[sent_text.get(key, 0) :]
                    if first and echo_texts is not None:
                        delta = echo_texts[i] + delta
                    sent_text[key] = len(text)
                    c = choice(i, view, text=delta)
                    start = sent_tokens.get(key, 0)
                    if logprobs is not None:
                        # the whole choice's object, so that offsets count the text sent before
                        part = _completion_logprobs(front, [view], echo, logprobs)
                        skip = 0 if first else start + (len(view.sample.prompt_ids) if echo else 0)
                        c["logprobs"] = {k: v[skip:] for k, v in part.items()}
                    if return_token_ids:
                        c["token_ids"] = list(view.sample.output_ids[start:])
                        if not first:
                            c.pop("prompt_token_ids")
                    sent_tokens[key] = len(view.sample.output_ids)
                    if final:
                        finals[key] = view
                    yield _sse(
                        {
                            "id": response_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [c],
                        }
                    )
                if include_usage and finals:
                    yield _sse(
                        {
                            "id": response_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage([finals[k] for k in sorted(finals)], n),
                        }
                    )
            except Exception as e:
                yield _sse({"error": {"object": "error", "message": str(e), "type": "BadRequestError", "code": 400}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    results = await until_done_or_gone(request, job)
    if results is None:
        return Response(status_code=499)
    views = [v for vs in results for v in vs]
    choices = []
    for i, vs in enumerate(results):
        for view in vs:
            text = (echo_texts[i] if echo_texts else "") + (view.text or "")
            c = choice(i, view, text=text)
            if logprobs is not None:
                c["logprobs"] = _completion_logprobs(front, [view], echo, logprobs)
            choices.append(c)
    return json_response(
        {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(views, n),
            "metadata": _metadata(views),
        }
    )


# ---- /v1/chat/completions ----


def _message_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else wire.type_name(part)
                raise RequestError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return " ".join(texts)
    raise RequestError(
        f"{where}.content: must be a string, a list of text parts or null, got {wire.type_name(content)}"
    )


ROLES = ("system", "user", "assistant", "tool", "function", "developer")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI `messages` -> the dicts chat templates read (text content; tool-call arguments as objects)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: required, a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: must be an object, got {wire.type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RequestError(f"{where}.role: must be one of {list(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": role.lower(), "content": _message_content(m.get("content"), where)}
        if msg["role"] == "user" and msg["content"] is None:
            raise RequestError(f"{where}.content: a user message needs content")
        if msg["role"] == "tool" and msg["content"] is None:
            raise RequestError(f"{where}.content: a tool message needs content (the tool's result, a string)")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise RequestError(f"{where}.{key}: must be a string, got {wire.type_name(m[key])}")
                msg[key] = m[key]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls: must be a list, got {wire.type_name(calls)}")
            if msg["role"] != "assistant":
                raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls, not {role!r}")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(
                        f"{where}.tool_calls[{j}]: must be {{'id': ..., 'type': 'function', 'function': "
                        "{'name': ..., 'arguments': '<JSON object>'}}, as the server returned it"
                    )
                if call.get("type", "function") != "function":
                    raise RequestError(
                        f"{where}.tool_calls[{j}].type: only 'function' calls are supported, got {call['type']!r}"
                    )
                arguments = {} if fn.get("arguments") is None else fn["arguments"]
                if not isinstance(arguments, (str, dict)):
                    raise RequestError(
                        f"{where}.tool_calls[{j}].function.arguments: must be a JSON object as a string, "
                        f"got {wire.type_name(arguments)}"
                    )
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except ValueError:
                        pass  # the template shows the string as given
                msg["tool_calls"].append(
                    {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": arguments}}
                )
        out.append(msg)
    return out


def tool_names(body: dict) -> list[str]:
    """The names of the request's `tools`, each checked to be an OpenAI function tool."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise RequestError(f"{key}: the deprecated functions API is not supported; send tools and tool_choice")
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"tools: must be a list of tool objects, got {wire.type_name(tools)}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind not in ("function", None):
            raise RequestError(f"tools[{i}].type: only 'function' tools are supported, got {kind!r}")
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(
                f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}"
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(
                f"tools[{i}].function.parameters: must be a JSON Schema object, got {wire.type_name(fn['parameters'])}"
            )
        if fn["name"] in names:
            raise RequestError(f"tools[{i}].function.name: {fn['name']!r} is declared twice; tool names must be unique")
        names.append(fn["name"])
    return names


def tool_choice_of(body: dict, names: Sequence[str]) -> tuple[str, str | None]:
    """(mode, function) of the request's `tool_choice`: mode "none", "auto", "required" or
    "function" (then `function` is the tool's name). Leaving it out means "auto" with tools,
    else "none", as OpenAI has it."""
    choice = body.get("tool_choice")
    named = "{'type': 'function', 'function': {'name': ...}}"
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(f"tool_choice: must be 'none', 'auto', 'required' or {named}, got {choice!r}")
        if choice == "required" and not names:
            raise RequestError("tool_choice: 'required' needs tools to call; declare them in tools")
        return choice, None
    if not isinstance(choice, dict):
        raise RequestError(f"tool_choice: must be 'none', 'auto', 'required' or {named}, got {wire.type_name(choice)}")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError(
            f"tool_choice: a named tool is {named}; other kinds (allowed_tools, custom) are not supported, "
            f"got {json.dumps(choice)[:200]}"
        )
    if name not in names:
        declared = ", ".join(repr(n) for n in names) or "none"
        raise RequestError(f"tool_choice.function.name: {name!r} is not a declared tool (tools: {declared})")
    return "function", name


def chat_tools(body: dict) -> list[dict] | None:
    """The request's tools for the chat template: None when it declares none or tool_choice is
    "none" (no tools rendered, no calls parsed, as SGLang does). RequestError names a malformed
    tool, tool_choice or parallel_tool_calls."""
    names = tool_names(body)
    mode, _ = tool_choice_of(body, names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls: must be true or false, got {wire.type_name(parallel)}")
    return body["tools"] if names and mode != "none" else None


def tool_prefill(mode: str, function: str | None) -> str:
    """The text the reply starts with for tool_choice `mode`: a "required" reply opens a call, a
    named one is the call up to its arguments (Qwen 2.5's layout); the model writes the rest."""
    if mode == "required":
        return TOOL_CALL_OPEN
    if mode == "function":
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments": '
    return ""


def render_chat(front: Frontend, body: dict) -> tuple[list[int], list[dict] | None]:
    """(prompt token ids, tools to parse) for a chat request: the chat template over messages and
    tools, or the request's own `input_ids`."""
    messages = chat_messages(body.get("messages"))
    tools = chat_tools(body)
    if body.get("input_ids") is not None:
        return wire._token_ids(body["input_ids"], "input_ids"), tools
    if front.detok is None:
        raise RequestError("messages: chat needs the tokenizer (the server runs with --skip-tokenizer-init)")
    tokenizer = front.detok.tokenizer
    template = front.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise RequestError("this model has no chat template; start the server with --chat-template FILE")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs: must be an object, got {wire.type_name(kwargs)}")
    cont = bool(body.get("continue_final_message", False))
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=not cont,
            continue_final_message=cont,
            chat_template=template,
            **kwargs,
        )
    except Exception as e:  # the template's own checks (jinja raise_exception, bad roles, ...)
        raise RequestError(f"messages: the chat template rejected them: {e}") from None
    ids = front.detok.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestError("messages: the chat template rendered an empty prompt")
    return ids, tools


def _tool_call(block: str, names: frozenset[str] | None, index: int) -> dict[str, Any] | None:
    """The OpenAI tool call a `<tool_call>` block's inside holds: JSON with a string "name" (one of
    `names` when given) and "arguments" (or "parameters"); else None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None:
        arguments = {}
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": obj["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        },
    }


class ToolCallStream:
    """Qwen 2.5 / Hermes tool calls out of one sample's text as it grows; the stream and the
    whole answer both read the text through one of these, so they agree.

    `feed(text, final)` takes the text so far and returns what it settles, in order:
    ("content", str) and ("call", OpenAI tool call) events. A `<tool_call>{"name": ...,
    "arguments": ...}</tool_call>` block naming a declared tool (any name when `names` is None)
    is a call, and whitespace next to it is dropped; a block that is not such a call, or never
    closes, stays in the content as written. Text that may open a block is held back until it
    does or does not. With `parallel` false, calls after the first are dropped. A text without
    calls comes out unchanged."""

    def __init__(self, names: Sequence[str] | None = None, *, parallel: bool = True):
        self.names = None if names is None else frozenset(names)
        self.parallel = parallel
        self.calls: list[dict[str, Any]] = []
        self._pos = 0  # characters of the text settled
        self._held = ""  # whitespace: dropped if a call follows, else content
        self._sep = ""  # the whitespace before the last call: back between content on either side
        self._after_call = False
        self._wrote = False  # any content out yet

    def feed(self, text: str, final: bool = False) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            rest = text[self._pos :]
            at = rest.find(TOOL_CALL_OPEN)
            if at < 0:
                safe = len(rest) - (0 if final else held_back(rest, [TOOL_CALL_OPEN]))
                self._text(rest[:safe], out)
                self._pos += safe
                break
            self._text(rest[:at], out)
            end = rest.find(TOOL_CALL_CLOSE, at + len(TOOL_CALL_OPEN))
            if end < 0:
                if final:  # never closed: content as written
                    self._content(rest[at:], out)
                    self._pos = len(text)
                else:
                    self._pos += at
                break
            block = rest[at : end + len(TOOL_CALL_CLOSE)]
            self._pos += end + len(TOOL_CALL_CLOSE)
            call = _tool_call(rest[at + len(TOOL_CALL_OPEN) : end].strip(), self.names, len(self.calls))
            if call is None:
                self._content(block, out)
                continue
            self._sep, self._held, self._after_call = (self._held if self._wrote else ""), "", True
            if self.parallel or not self.calls:
                self.calls.append(call)
                out.append(("call", call))
        if final and self._held:
            self._content("", out)
        return out

    def _text(self, piece: str, out: list) -> None:
        if self._after_call:
            piece = piece.lstrip()
            if not piece:
                return
            self._after_call, self._held = False, self._sep
        whole = self._held + piece
        body = whole.rstrip()
        if body:
            out.append(("content", body))
            self._wrote = True
        self._held = whole[len(body) :]

    def _content(self, piece: str, out: list) -> None:
        if self._after_call:
            self._after_call, self._held = False, self._sep
        if self._held + piece:
            out.append(("content", self._held + piece))
            self._wrote = True
        self._held = ""


def parse_tool_calls(text: str, names: Sequence[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(the content, OpenAI tool calls) of a whole answer, as `ToolCallStream` reads it: the text
    itself when it holds no call."""
    stream = ToolCallStream(names)
    content = "".join(value for kind, value in stream.feed(text, final=True) if kind == "content")
    return content, stream.calls


def _token_bytes(front: Frontend, ids: Sequence[int], texts: Sequence[str]) -> list[list[int]]:
    """Each token's bytes: from the byte-level alphabet where the tokenizer is byte-level BPE
    (a lone byte of a multi-byte character keeps its value), else its text in UTF-8."""
    decoder = _byte_decoder(front)
    if decoder is None:
        return [list(t.encode("utf-8")) for t in texts]
    pieces = front.detok.tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for piece, t in zip(pieces, texts):
        if piece is not None and all(ch in decoder for ch in piece):
            out.append([decoder[ch] for ch in piece])
        else:
            out.append(list(t.encode("utf-8")))
    return out


def _byte_decoder(front: Frontend) -> dict[str, int] | None:
    cached = getattr(front, "_byte_decoder", False)
    if cached is not False:
        return cached
    decoder = None
    backend = getattr(front.detok.tokenizer, "backend_tokenizer", None) if front.detok else None
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        # GPT-2's reversible byte <-> printable-character table
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
        chars = printable[:]
        extra = 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + extra)
                extra += 1
        decoder = {chr(c): b for b, c in zip(printable, chars)}
    front._byte_decoder = decoder
    return decoder


def _chat_logprobs(front: Frontend, sample) -> dict[str, Any]:
    ids = list(sample.output_ids)
    texts = front.detok.token_texts(ids) if front.detok else [""] * len(ids)
    raw = _token_bytes(front, ids, texts) if front.detok else [[] for _ in ids]
    return {
        "content": [
            {"token": t, "bytes": b, "logprob": wire.finite_or_none(lp), "top_logprobs": []}
            for t, b, lp in zip(texts, raw, sample.logprobs)
        ]
    }


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    front = _front(request)
    _check_json_content_type(request)
    body = await read_json(request, front.max_request_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {wire.type_name(body)}")
    _refuse_unsupported(body)
    prompt, tools = render_chat(front, body)
    names = tool_names(body) if tools is not None else []
    mode, function = tool_choice_of(body, names)
    parse_tools = tools is not None and front.effective_tool_call_parser() is not None
    if tools is not None and not parse_tools and front.tool_call_parser == "auto":
        raise RequestError(
            "tools: this server cannot parse tool calls: the chat template writes no <tool_call> blocks; start "
            "it with --chat-template FILE (a template that renders tools and writes calls as <tool_call> "
            "blocks), --tool-call-parser qwen25 if the model writes those anyway, or --tool-call-parser none "
            "to get its raw text"
        )
    if mode in ("required", "function") and not parse_tools:
        raise RequestError(
            f"tool_choice: {body['tool_choice']!r} needs a tool-call parser, and this server runs with "
            "--tool-call-parser none; send 'auto' or 'none'"
        )
    prefill = tool_prefill(mode, function)
    if prefill:
        if body.get("continue_final_message"):
            raise RequestError(
                "tool_choice: 'required' or a named tool starts a new reply, so it cannot continue_final_message; "
                "send tool_choice 'auto' or drop continue_final_message"
            )
        if front.detok is None:
            raise RequestError("tool_choice: 'required' or a named tool needs the tokenizer; send 'auto'")
        prompt = [*prompt, *front.detok.encode(prefill, add_special_tokens=False)]
    parallel = body.get("parallel_tool_calls") is not False
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs: must be true or false, got {wire.type_name(logprobs)}")
    if _int_field(body, "top_logprobs", 0, minimum=0):
        raise RequestError("top_logprobs: top log-probs are not implemented; leave it out or 0")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max(1, front.context_length - len(prompt))
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise RequestError(f"max_completion_tokens / max_tokens: must be a positive integer, got {max_tokens!r}")
    stream = bool(body.get("stream", False))
    include_usage = _include_usage(body)
    return_token_ids = bool(body.get("return_token_ids", False))
    return_prompt_ids = return_token_ids or bool(body.get("return_prompt_token_ids", False))
    if stream and (return_token_ids or body.get("return_prompt_token_ids")):
        raise RequestError(
            "return_token_ids / return_prompt_token_ids are not supported with stream; set stream: false"
        )
    model = body.get("model") or front.served_model_name
    sampling = sampling_of(body, front, max_tokens, openai_defaults=OPENAI_DEFAULTS, chat=True)
    rid = _rids(body, "chatcmpl-", 1)[0]
    loras, lora_field = lora_of(front, body, 1)
    job = _submit(
        front, [prompt], sampling, [rid], prompt_logprobs=False, watch=stream, loras=loras, lora_field=lora_field
    )
    created = int(time.time())

    def tool_calls_of() -> ToolCallStream | None:
        return ToolCallStream(names, parallel=parallel) if parse_tools else None

    def finish_of(view: SampleView, calls: ToolCallStream | None) -> dict | None:
        finish = None if view.finish_reason is None else dict(view.finish_reason)
        if calls is not None and calls.calls and finish is not None and finish["type"] == "stop":
            finish = {"type": "tool_calls", "matched": None}
        return finish

    def message_of(view: SampleView) -> tuple[dict[str, Any], dict | None]:
        text = view.text or ""
        calls = tool_calls_of()
        if calls is not None:
            text = "".join(v for kind, v in calls.feed(prefill + text, final=True) if kind == "content")
        message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
        if calls is not None and calls.calls:
            message["content"] = text or None
            message["tool_calls"] = calls.calls
        return message, finish_of(view, calls)

    if stream:

        async def events() -> AsyncIterator[bytes]:
            sent: dict[int, int] = {}
            parsers: dict[int, ToolCallStream | None] = {}
            finals: list[SampleView] = []

            def chunk(index: int, delta: dict, finish: dict | None) -> bytes:
                c: dict[str, Any] = {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": None if finish is None else finish["type"],
                    "matched_stop": None if finish is None else finish.get("matched"),
                }
                return _sse(
                    {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c]}
                )

            try:
                async for _i, view, final in job.updates():
                    j = view.sample.index
                    if j not in sent:
                        sent[j] = 0
                        parsers[j] = tool_calls_of()
                        yield chunk(j, {"role": "assistant", "content": ""}, None)
                    text = view.text or ""
                    calls = parsers[j]
                    deltas: list[dict[str, Any]] = []
                    if calls is None:
                        if len(text) > sent[j]:
                            deltas.append({"content": text[sent[j] :]})
                            sent[j] = len(text)
                    else:
                        for kind, value in calls.feed(prefill + text, final):
                            if kind == "content":
                                deltas.append({"content": value})
                                continue
                            # as OpenAI streams a call: index, id, type and name first, then the arguments
                            fn = value["function"]
                            head = {"name": fn["name"], "arguments": ""}
                            deltas.append({"tool_calls": [{**value, "function": head}]})
                            tail = {"index": value["index"], "function": {"arguments": fn["arguments"]}}
                            deltas.append({"tool_calls": [tail]})
                    if not final:
                        for delta in deltas:
                            yield chunk(j, delta, None)
                        continue
                    finals.append(view)
                    if not deltas or "tool_calls" in deltas[-1]:
                        deltas.append({})  # the finish in a chunk of its own after a call, as OpenAI's
                    for delta in deltas[:-1]:
                        yield chunk(j, delta, None)
                    yield chunk(j, deltas[-1], finish_of(view, calls))
                if include_usage and finals:
                    usage = _usage(sorted(finals, key=lambda v: v.sample.index), len(finals))
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
            except Exception as e:
                yield _sse({"error": {"object": "error", "message": str(e), "type": "BadRequestError", "code": 400}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    results = await until_done_or_gone(request, job)
    if results is None:
        return Response(status_code=499)
    views = results[0]
    n = len(views)
    choices = []
    for view in views:
        message, finish = message_of(view)
        c: dict[str, Any] = {
            "index": view.sample.index,
            "message": message,
            "logprobs": _chat_logprobs(front, view.sample) if logprobs else None,
            "finish_reason": None if finish is None else finish["type"],
            "matched_stop": None if finish is None else finish.get("matched"),
        }
        if return_prompt_ids:
            c["prompt_token_ids"] = list(view.sample.prompt_ids)
        if return_token_ids:
            c["response_token_ids"] = list(view.sample.output_ids)
        choices.append(c)
    return json_response(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(views, n),
            "metadata": _metadata(views),
        }
    )


def openai_routes() -> list[Route]:
    """The OpenAI-compatible routes, for `server.make_app`."""
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
