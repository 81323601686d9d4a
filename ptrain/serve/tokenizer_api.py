"""Tokenizer routes of `python -m ptrain.serve`: /tokenize, /detokenize and /tokenizer_info.

Clients that count tokens or score text against a served model tokenise with the server's own
tokenizer through these, so they need no copy of the model folder (lm-evaluation-harness's
`tokenizer_backend=remote`, which its `local-completions` model picks by itself when
`/tokenizer_info` and `/tokenize` answer):

- `POST /tokenize` and `/v1/tokenize`, SGLang 0.5.23's (`srt/entrypoints/openai/serving_tokenize.py`):
  `{"prompt": str | [str], "add_special_tokens": true}` -> `{"tokens", "count", "max_model_len"}`,
  a list of each for a list of prompts;
- `POST /detokenize` and `/v1/detokenize`, SGLang's: `{"tokens": [int] | [[int]],
  "skip_special_tokens": true}` -> `{"text"}`, plus the same string as `prompt`, the field vLLM's
  DetokenizeResponse has and lm-eval's remote tokenizer reads;
- `GET /tokenizer_info`, vLLM's (SGLang has none): the tokenizer's tokenizer_config.json as
  loaded (its JSON-valued init arguments), `tokenizer_class`, the special tokens as text
  (`eos_token`, `bos_token`, `pad_token`, `unk_token`), the chat template the server renders
  with, and `model_max_length` the server's context length.

A server started with --skip-tokenizer-init answers each with a 400 that says so. Errors on the
/v1/ paths use the OpenAI routes' shape, as SGLang serves these routes from its OpenAI layer.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import RequestError
from ptrain.serve.server import Frontend, json_response, read_json

NO_TOKENIZER = "the server runs with --skip-tokenizer-init, so it has no tokenizer; restart it without that flag"


def _front(request: Request) -> Frontend:
    front: Frontend = request.app.state.front
    if front.detok is None:
        raise RequestError(f"{request.url.path}: {NO_TOKENIZER}")
    return front


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{key}: must be true or false, got {wire.type_name(v)}")
    return v


async def _body(request: Request, front: Frontend) -> dict:
    body = await read_json(request, front.max_request_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {wire.type_name(body)}")
    return body


async def tokenize(request: Request) -> Response:
    """POST /tokenize: a prompt (or a list of them) -> token ids, counts and the context length."""
    front = _front(request)
    body = await _body(request, front)
    if body.get("messages") is not None:
        raise RequestError(
            "messages: tokenizing chat messages is not implemented here; send prompt (the rendered text), "
            "or send the messages to /v1/chat/completions with return_token_ids: true"
        )
    prompt = body.get("prompt")
    add_special = _flag(body, "add_special_tokens", True)
    if isinstance(prompt, str):
        tokens: Any = front.detok.encode(prompt, add_special_tokens=add_special)
        count: Any = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [front.detok.encode(p, add_special_tokens=add_special) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise RequestError(f"prompt: required, a string or a list of strings, got {wire.type_name(prompt)}")
    return json_response({"tokens": tokens, "count": count, "max_model_len": front.context_length})


async def detokenize(request: Request) -> Response:
    """POST /detokenize: token ids (or a list of id lists) -> text."""
    front = _front(request)
    body = await _body(request, front)
    tokens = body.get("tokens")
    skip = _flag(body, "skip_special_tokens", True)
    size = len(front.detok.tokenizer)
    batch = isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) for t in tokens)
    lists = tokens if batch else [tokens]
    for i, ids in enumerate(lists):
        where = f"tokens[{i}]" if batch else "tokens"
        ids = wire._token_ids(ids, where) if ids != [] else []
        bad = sorted({t for t in ids if not 0 <= t < size})
        if bad:
            raise RequestError(f"{where}: token id(s) {bad[:5]} outside the tokenizer's vocabulary [0, {size})")
    texts = [front.detok.text(ids, skip_special_tokens=skip) for ids in lists]
    text: Any = texts if batch else texts[0]
    return json_response({"text": text, "prompt": text})


def _jsonable(value: Any) -> Any:
    """A tokenizer init argument as JSON: AddedToken as its text; values JSON cannot hold dropped (None)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    content = getattr(value, "content", None)  # tokenizers.AddedToken
    if isinstance(content, str):
        return content
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return [v for v in items if v is not None]
    if isinstance(value, dict):
        items = {str(k): _jsonable(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not None}
    return None


async def tokenizer_info(request: Request) -> Response:
    """GET /tokenizer_info: the tokenizer's configuration (vLLM's route; module docstring)."""
    front = _front(request)
    tok = front.detok.tokenizer
    info = {k: v for k, v in ((k, _jsonable(v)) for k, v in getattr(tok, "init_kwargs", {}).items()) if v is not None}
    info.update(
        tokenizer_class=type(tok).__name__,
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        chat_template=front.chat_template or getattr(tok, "chat_template", None),
        model_max_length=front.context_length,
        vocab_size=len(tok),
    )
    return json_response(info)


def tokenizer_routes() -> list[Route]:
    """The tokenizer routes, for `server.make_app`."""
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
