"""vLLM's token-in/token-out route on `python -m ptrain.serve`: `POST /inference/v1/generate`.

This is where trainers that drive vLLM get token ids and log-probs, verifiers 0.4's train client
among them (`renderers/client.py` `generate`, which renders the chat itself and posts the ids).
The shapes are vLLM's `GenerateRequest` / `GenerateResponse`
(`vllm/entrypoints/serve/disagg/protocol.py`, `serving.py` `serve_tokens_full_generator`):

    {"token_ids": [int, ...], "sampling_params": {...}, "model"?, "request_id"?, "cache_salt"?,
     "priority"?}
    -> {"request_id", "model", "created", "choices": [{"index": j, "token_ids": [...],
        "finish_reason": "stop" | "length" | "abort",
        "logprobs": {"content": [{"token": "token_id:<id>", "logprob": x, "bytes": null,
                                  "top_logprobs": [...]}]} | null}],
        "prompt_token_ids", "prompt_logprobs": null, "usage", "kv_transfer_params": null}

`sampling_params` are vLLM's (`max_tokens`, `temperature`, `top_p`, `top_k` (0 or -1: off),
`min_p`, `n`, `seed` (an integer, or a string of one: verifiers passes CLI extras untyped),
`stop_token_ids`, `ignore_eos`, `logprobs`, `skip_special_tokens`, ...). Without `max_tokens` a
sample may fill the context, as vLLM's server defaults it. `logprobs`: null gives none; k >= 0
gives every sampled token's log-prob plus the k most likely tokens at its position (at most
MAX_TOP_LOGPROBS). Tokens are always written `token_id:<id>` (vLLM's
--return-tokens-as-token-ids form, the one verifiers checks), since the ids are the answer here.

Log-probs are the engine's own, `Sample.logprobs`: log p(token) under the tempered
full-vocabulary softmax (`ptrain.rollout.protocol`), what the trainer's policy loss computes for
the same tokens. (vLLM's default `logprobs_mode` reports the untempered ones.)

Not served, and refused by name rather than ignored: streaming, stop strings (`stop`; use
`stop_token_ids`), penalties, `min_tokens`, `prompt_logprobs`, structured outputs, multimodal
`features`/`content_parts`, KV transfer, and a non-zero `priority`. `routed_experts_prompt_start`
(verifiers adds it on bridged turns, for MoE routing replay) is accepted and ignored; no
`routed_experts` are returned. Errors are vLLM's (OpenAI's) shape,
`{"error": {"message", "type", "param", "code"}}`, and name the field and the fix.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import MAX_TOP_LOGPROBS, GenerateRequest, RequestError, SamplingParams
from ptrain.serve.server import Frontend, HTTPError, json_response, read_json, until_done_or_gone

ROUTE = "/inference/v1/generate"

# vLLM's SamplingParams fields this route implements.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos",
    "logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
    "include_stop_str_in_output",
)  # fmt: skip
# vLLM's fields this route does not implement, at their vLLM defaults (accepted only at those).
UNSUPPORTED_AT_DEFAULT: dict[str, Any] = {
    "stop": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_tokens": 0, "prompt_logprobs": None, "bad_words": None, "logit_bias": None,
    "allowed_token_ids": None, "structured_outputs": None, "guided_decoding": None,
    "truncate_prompt_tokens": None, "extra_args": None, "best_of": None, "thinking_token_budget": None,
}  # fmt: skip
FIXES = {
    "stop": "stop strings are not implemented on this token route; send stop_token_ids",
    "prompt_logprobs": "prompt log-probs are served by /generate (return_logprob, logprob_start_len)",
}
IGNORED_SAMPLING = ("routed_experts_prompt_start",)
"""Accepted and ignored: verifiers' hint for MoE routing replay, which this route does not return."""
# Top-level GenerateRequest fields: served, accepted-and-ignored, or refused unless null.
REFUSED_UNLESS_NULL = {
    "features": "multimodal inputs are not served here; send text-only token ids",
    "content_parts": "multimodal inputs are not served here; send text-only token ids",
    "kv_transfer_params": "this server does no disaggregated prefill; leave it out",
    "stream_options": None,
}


def vllm_error(status: int, message: str, param: str | None = None) -> Response:
    """vLLM's ErrorResponse (OpenAI's error object)."""
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "InternalServerError"
    if status == 413:
        kind = "RequestEntityTooLarge"
    elif status == 503:
        kind = "ServiceUnavailableError"
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_field(sp: dict, key: str) -> int | None:
    v = sp.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise RequestError(f"sampling_params.{key}: must be an integer, got {v!r}")
    return v


def _seed(v: Any) -> int | None:
    """vLLM's seed; a string of an integer is taken too (verifiers' CLI passes extras as strings)."""
    if v is None:
        return None
    if isinstance(v, str) and re.fullmatch(r"\s*-?\d+\s*", v):
        v = int(v)
    if not _is_int(v):
        raise RequestError(f"sampling_params.seed: must be an integer (or a string of one), got {v!r}")
    return v


def parse_sampling(sp: Any, prompt_len: int, context_length: int) -> tuple[SamplingParams, int | None, bool]:
    """vLLM sampling_params -> (the engine's SamplingParams, top log-probs asked (None: no
    log-probs), skip_special_tokens). RequestError names the vLLM field."""
    if not isinstance(sp, dict):
        raise RequestError(
            f"sampling_params: required, a JSON object of vLLM sampling parameters, got {wire.type_name(sp)}"
        )
    known = set(SAMPLING_FIELDS) | set(UNSUPPORTED_AT_DEFAULT) | set(IGNORED_SAMPLING)
    unknown = sorted(k for k in sp if k not in known)
    if unknown:
        raise RequestError(
            f"sampling_params: unknown field(s) {unknown}; this route takes vLLM's {sorted(SAMPLING_FIELDS)}"
        )
    for key, default in UNSUPPORTED_AT_DEFAULT.items():
        v = sp.get(key)
        if v is None or v == default or (key in ("stop", "bad_words") and v == []):
            continue
        fix = FIXES.get(key, f"leave it out (or at {default!r})")
        raise RequestError(f"sampling_params.{key}: not implemented by this server; {fix}")
    for key in ("temperature", "top_p", "min_p"):
        if sp.get(key) is not None and not _is_number(sp[key]):
            raise RequestError(f"sampling_params.{key}: must be a number, got {sp[key]!r}")
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
        if sp.get(key) is not None and not isinstance(sp[key], bool):
            raise RequestError(f"sampling_params.{key}: must be true or false, got {sp[key]!r}")
    n = _int_field(sp, "n")
    top_k = _int_field(sp, "top_k")
    if top_k is not None and top_k < -1:
        raise RequestError(f"sampling_params.top_k: must be 0 or -1 (off) or >= 1, got {top_k}")
    max_tokens = _int_field(sp, "max_tokens")
    room = context_length - prompt_len
    if room < 1:
        raise RequestError(
            f"token_ids: the prompt has {prompt_len} tokens, which leaves no room in this server's context of "
            f"{context_length}; send a shorter prompt (or start the server with a larger --context-length)"
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise RequestError(f"sampling_params.max_tokens: must be >= 1, got {max_tokens}")
    elif max_tokens > room:
        raise RequestError(
            f"sampling_params.max_tokens: {max_tokens} more tokens do not fit after a {prompt_len}-token prompt in "
            f"this server's context of {context_length}; ask for at most {room}"
        )
    logprobs = _int_field(sp, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"sampling_params.logprobs: must be in [0, {MAX_TOP_LOGPROBS}] (the most likely tokens to list beside "
            f"each sampled one), got {logprobs}; leave it out for no log-probs"
        )
    ids = sp.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
        raise RequestError(f"sampling_params.stop_token_ids: must be a list of integers, got {ids!r}")
    kw: dict[str, Any] = {"max_new_tokens": max_tokens}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p")):
        if sp.get(theirs) is not None:
            kw[ours] = float(sp[theirs])
    if top_k is not None and top_k > 0:
        kw["top_k"] = top_k
    if n is not None:
        kw["n"] = n
    if ids:
        kw["stop_token_ids"] = tuple(ids)
    if sp.get("ignore_eos") is not None:
        kw["ignore_eos"] = sp["ignore_eos"]
    seed = _seed(sp.get("seed"))
    if seed is not None:
        kw["sampling_seed"] = seed
    params = SamplingParams(**kw)
    try:
        params.validate()
    except RequestError as e:  # name vLLM's field, not the engine's
        raise RequestError(str(e).replace("max_new_tokens", "max_tokens").replace("sampling_seed", "seed")) from None
    skip = sp.get("skip_special_tokens")
    return params, logprobs, True if skip is None else skip


def parse_body(body: Any, front: Frontend) -> tuple[GenerateRequest, int | None, str]:
    """vLLM GenerateRequest -> (the engine request, top log-probs asked (None: none), request_id)."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object (vLLM's GenerateRequest), got {wire.type_name(body)}")
    if body.get("stream"):
        raise RequestError("stream: streaming is not implemented on this route; send stream false (or leave it out)")
    for key, fix in REFUSED_UNLESS_NULL.items():
        if body.get(key) is not None and key != "stream_options":
            raise RequestError(f"{key}: not implemented by this server; {fix}")
    priority = body.get("priority")
    if priority is not None and (not _is_int(priority) or priority != 0):
        raise RequestError(
            f"priority: this server schedules first come, first served; send 0 or leave it out, got {priority!r}"
        )
    if body.get("cache_salt") is not None and not isinstance(body["cache_salt"], str):
        raise RequestError(f"cache_salt: must be a string, got {wire.type_name(body['cache_salt'])}")
    request_id = body.get("request_id")
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request_id: must be a non-empty string, got {request_id!r}")
    if body.get("token_ids") is None:
        raise RequestError("token_ids: required, the prompt as a list of token ids")
    ids = wire._token_ids(body["token_ids"], "token_ids")
    vocab = front.vocab_size
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        raise RequestError(f"token_ids: token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab})")
    params, logprobs, _skip = parse_sampling(body.get("sampling_params"), len(ids), front.context_length)
    params.validate(vocab)
    lora = _adapter_of(front, body.get("model"))
    rid = f"generate-tokens-{request_id}"
    if rid in front.inflight:
        rid = f"{rid}-{uuid.uuid4().hex[:8]}"
    request = GenerateRequest(
        input_ids=tuple(ids), sampling=params, rid=rid, lora_path=lora, top_logprobs_num=logprobs or 0
    )
    return request, logprobs, rid


class UnknownModel(Exception):
    pass


def _adapter_of(front: Frontend, model: Any) -> str | None:
    """The LoRA adapter `model` names (None: the served model); UnknownModel (vLLM's 404) otherwise."""
    if model is None or model == front.served_model_name or model == front.model_path:
        return None
    if not isinstance(model, str):
        raise RequestError(f"model: must be a string, got {wire.type_name(model)}")
    from ptrain.serve.openai_api import adapter_of_model

    adapter = adapter_of_model(front, model)
    if adapter is None:
        raise UnknownModel(
            f"model: The model `{model}` does not exist; this server serves {front.served_model_name!r}"
            + (f" and the adapters {sorted(front.loaded_adapters())}" if front.loaded_adapters() else "")
        )
    return adapter


def _logprobs(sample, k: int | None) -> dict | None:
    if k is None:
        return None
    content = []
    for i, (tok, lp) in enumerate(zip(sample.output_ids, sample.logprobs)):
        top = []
        if k and sample.top_logprobs is not None:
            top = [
                {"token": f"token_id:{t}", "logprob": float(x), "bytes": None} for t, x in sample.top_logprobs[i][:k]
            ]
        content.append({"token": f"token_id:{tok}", "logprob": float(lp), "bytes": None, "top_logprobs": top})
    return {"content": content}


async def inference_generate(request: Request) -> Response:
    """POST /inference/v1/generate: vLLM's GenerateRequest -> GenerateResponse (module docstring)."""
    front: Frontend = request.app.state.front
    try:
        body = await read_json(request, front.max_request_bytes)
        engine_request, k, rid = parse_body(body, front)
        job = front.job([engine_request], skip_special_tokens=[True], lora_field="model")
    except RequestError as e:
        return vllm_error(400, str(e))
    except UnknownModel as e:
        return vllm_error(404, str(e), "model")
    except HTTPError as e:
        return vllm_error(e.status, e.message)
    results = await until_done_or_gone(request, job)
    if results is None:
        return Response(status_code=499)
    samples = [view.sample for view in results[0]]
    choices = [
        {
            "index": s.index,
            "token_ids": list(s.output_ids),
            "finish_reason": s.finish_reason.type if s.finish_reason is not None else "stop",
            "logprobs": _logprobs(s, k),
        }
        for s in samples
    ]
    prompt_len = len(engine_request.input_ids)
    completion = sum(len(s.output_ids) for s in samples)
    return json_response(
        {
            "request_id": rid,
            "model": body.get("model") or front.served_model_name,
            "created": int(time.time()),
            "choices": choices,
            "prompt_token_ids": list(engine_request.input_ids),
            "prompt_logprobs": None,
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion,
                "total_tokens": prompt_len + completion,
            },
            "kv_transfer_params": None,
        }
    )


def vllm_routes() -> list[Route]:
    """vLLM's token route, for `server.make_app`."""
    return [Route(ROUTE, inference_generate, methods=["POST"])]
