"""An SGLang-compatible HTTP server around a rollout engine (`python -m ptrain.serve`).

    app = make_app(engine, tokenizer, served_model_name="m")     a Starlette ASGI app
    serve(args)                                                  uvicorn on args.host:args.port

It speaks SGLang 0.5.23's native API (`shared/reference/sglang_api.md`): `/generate` (single,
batch, n, log-prob triples, SSE streaming), `/health`, `/health_generate`, `/model_info`,
`/server_info`, `/flush_cache`, `/v1/loads`, `/update_weights_from_disk`, `/pause_generation`,
`/continue_generation`, `/abort_request`, `/load_lora_adapter`, `/unload_lora_adapter`; and the
OpenAI-compatible `/v1/models`,
`/v1/completions`, `/v1/chat/completions` (`ptrain.serve.openai_api`); and the tokenizer's
`/tokenize`, `/detokenize`, `/tokenizer_info` (`ptrain.serve.tokenizer_api`); and vLLM's
token-in/token-out `/inference/v1/generate` (`ptrain.serve.vllm_api`). The request and
response translation lives in `ptrain.rollout.sglang_wire`.

Threads. The engine samples on its own thread; `submit` returns a concurrent Future and calls
`on_update` from that thread. The event loop never blocks on the engine: futures are awaited
through `asyncio.wrap_future`, updates cross with `loop.call_soon_threadsafe`, and the slow
control calls (weight loading, pause) run in a worker thread.

Errors. Every bad request is a 400 that names the field and the fix, in SGLang's shape
(`{"error": {"message": ...}}`; OpenAI routes use SGLang's OpenAI ErrorResponse), a body over
`max_request_bytes` is a 413, and the server keeps serving. Stop strings (`stop`) and
`skip_special_tokens` are implemented here, over the engine's token stream: a sample whose
text reaches a stop string is aborted in the engine and cut after the token that completed it.

Thinking budget. A request's budget (`/generate`: SGLang's `max_thinking_tokens` or
`sampling_params.custom_params.thinking_budget`; OpenAI routes: `thinking_budget`,
`custom_params.thinking_budget`, and for chat the template variable
`chat_template_kwargs.reasoning_budget`) is enforced by the engine, which forces the
tokenizer's encoding of `</think>` once the budget is spent (`ptrain.rollout.local`). The
server fills those ids in from its tokenizer, and drops the budget of a prompt that already
ends in `</think>` (a reasoning-off template's `<think></think>`: nothing left to force).

LoRA adapters (an engine with max_loras > 0: `--enable-lora` or `--lora-paths`). A request
names its adapter by the name it was loaded under: `/generate`'s `lora_path` (one for every
prompt, or one a prompt), the OpenAI routes' `lora_path` or `model` (a loaded adapter's name,
or SGLang's `<served-model>:<adapter>`). `/load_lora_adapter` and `/unload_lora_adapter` answer
SGLang's LoRAUpdateOutput `{success, error_message, loaded_adapters}`, 400 when they fail (an
adapter that does not fit names the mismatch). As in SGLang, an unload waits for the requests
already using the adapter and refuses new ones meanwhile. Adapters here are never evicted, so
`pinned` is accepted and changes nothing.

Shutdown. SIGTERM stops accepting connections, `/health` turns 503, requests in flight finish
(up to `--graceful-shutdown-timeout` seconds), then the engine closes and the process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ptrain import __version__
from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import (
    MAX_THINK_END_IDS,
    THINK_END_IDS_KEY,
    THINK_END_TEXT,
    FinishReason,
    GenerateRequest,
    RequestError,
    Sample,
    SamplingParams,
)

log = logging.getLogger("ptrain.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
SERVER_STOP_KEYS = ("stop", "no_stop_trim")
"""Sampling keys this server implements on top of the engine (see parse_stops)."""
DEFAULT_MAX_LORAS_PER_BATCH = 8
"""What SGLang's /server_info reports for --max-loras-per-batch when LoRA is off."""
LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer to an adapter load or unload on a server without LoRA."""
LORA_ID_REFUSED = (
    "lora_id: SGLang assigns it to a loaded adapter internally; leave it out and name the adapter in lora_name"
)
# The engine's LoRAError texts name its constructor arguments; over HTTP the fix is a flag.
ENGINE_TO_FLAGS = (
    ("start the engine with max_loras >= 1", "start the server with --enable-lora"),
    ("start the engine with a larger max_loras", "start the server with a larger --max-loras-per-batch"),
    ("start the engine with max_lora_rank >=", "start the server with --max-lora-rank >="),
    ("start the engine with those lora targets", "start the server with those --lora-target-modules"),
)


def with_flag_names(message: str) -> str:
    """An engine LoRA message with the server's flags in place of the engine's arguments."""
    for engine_words, flag_words in ENGINE_TO_FLAGS:
        message = message.replace(engine_words, flag_words)
    return message


class HTTPError(Exception):
    """An answer other than 200 for the client, with a message that names the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def json_response(content: Any, status: int = 200) -> Response:
    """A compact UTF-8 JSON response (strict JSON: non-finite floats are a bug, not output)."""
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return Response(body, status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    """SGLang's native error body: `{"error": {"message": ...}}`."""
    return json_response({"error": {"message": message}}, status)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON; HTTPError 413 over `limit` bytes, 400 for malformed JSON."""
    declared = request.headers.get("content-length")
    too_big = (
        f"the request body is over this server's limit of {limit} bytes; send a smaller request "
        "(or start the server with a larger --max-request-bytes)"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, too_big)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPError(413, too_big)
    if not body.strip():
        raise HTTPError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"malformed JSON in the request body: {e}") from None


async def read_optional_json(request: Request, limit: int) -> dict:
    """A control endpoint's body: a JSON object, or {} when there is none."""
    declared = request.headers.get("content-length")
    if declared == "0":
        return {}
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPError(413, f"the request body is over this server's limit of {limit} bytes")
    if not body.strip():
        return {}
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"malformed JSON in the request body: {e}") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {wire.type_name(obj)}")
    return obj


class Detokenizer:
    """The model folder's tokenizer, for text prompts, output text and log-prob token texts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as SGLang tokenises a text prompt (with the tokenizer's special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def text(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (SGLang's return_text_in_logprobs), cached a token id."""
        cache = self._token_text
        missing = [i for i in dict.fromkeys(ids) if i not in cache]
        if missing:
            for i, s in zip(missing, self.tokenizer.batch_decode([[i] for i in missing])):
                cache[i] = s
        return [cache[i] for i in ids]

    def think_end_ids(self) -> tuple[int, ...]:
        """The token ids of `</think>` (one special token in Qwen3's tokenizer, several in a
        byte-level BPE without it); () when longer than MAX_THINK_END_IDS."""
        ids = tuple(int(i) for i in self.encode(THINK_END_TEXT, add_special_tokens=False))
        return ids if len(ids) <= MAX_THINK_END_IDS else ()


def parse_stops(sampling: Any, where: str, has_tokenizer: bool) -> tuple[dict, tuple[str, ...], bool]:
    """Split the server-side stop-string keys off a `sampling_params` object:
    (the rest, stop strings, no_stop_trim)."""
    if not isinstance(sampling, dict):
        return sampling, (), False
    rest = {k: v for k, v in sampling.items() if k not in SERVER_STOP_KEYS}
    stop = sampling.get("stop")
    if stop is None or stop == []:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise RequestError(f"{where}.stop: must be a string or a list of strings, got {wire.type_name(stop)}")
    if any(not s for s in stops):
        raise RequestError(f"{where}.stop: an empty stop string would stop at once; remove it")
    if stops and not has_tokenizer:
        raise RequestError(
            f"{where}.stop: stop strings need the tokenizer (the server runs with --skip-tokenizer-init); "
            "use stop_token_ids"
        )
    no_trim = sampling.get("no_stop_trim")
    if no_trim is not None and not isinstance(no_trim, bool):
        raise RequestError(f"{where}.no_stop_trim: must be true or false, got {wire.type_name(no_trim)}")
    return rest, stops, bool(no_trim)


@dataclass
class SampleView:
    """A sample as the client sees it: its text and its finish_reason object (None while it
    runs), with the stop-string cut applied once it has finished."""

    sample: Sample
    text: str | None
    finish_reason: dict | None


@dataclass
class Job:
    """One HTTP request's engine requests, from submission to their finished samples.

    `stops[i]` are request i's stop strings; `watch` asks for `latest` snapshots (streaming)."""

    front: Frontend
    requests: tuple[GenerateRequest, ...]
    skip_special_tokens: tuple[bool, ...]
    stops: tuple[tuple[str, ...], ...] = ()
    no_stop_trim: tuple[bool, ...] = ()
    watch: bool = False
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    latest: list[list[Sample] | None] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: set[tuple[int, int]] = field(default_factory=set)
    """(request, sample) pairs whose text reached a stop string (aborted, cut when they end)."""
    _checked: dict[tuple[int, int], int] = field(default_factory=dict)
    _finished: dict[tuple[int, int], SampleView] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count = len(self.requests)
        self.stops = self.stops or ((),) * count
        self.no_stop_trim = self.no_stop_trim or (False,) * count
        self.latest = [None] * count
        self.loop = asyncio.get_running_loop()

    def start(self) -> None:
        """Submit every request; RequestError (before any answer is sent) aborts those already submitted."""
        try:
            for i, request in enumerate(self.requests):
                future = self.front.engine.submit(request, on_update=self._updater(i))
                self.front.track(request.rid, future, request.lora_path)
                future.add_done_callback(self._wake)
                self.futures.append(future)
        except RequestError:
            self.abort()
            raise
        except Exception as e:  # a closed or failed engine: the server cannot serve now
            self.abort()
            raise HTTPError(503, f"the engine cannot take requests: {e}") from None

    def _wake(self, _future) -> None:
        self.front.last_progress = time.monotonic()
        self.loop.call_soon_threadsafe(self.changed.set)

    def _updater(self, i: int) -> Callable[[list[Sample]], None] | None:
        # No callback unless snapshots are needed: the engine builds every sample of the
        # request for each call, which costs the engine thread time on long outputs.
        if not (self.watch or self.stops[i]):
            return None
        front, loop = self.front, self.loop

        def on_update(samples: list[Sample]) -> None:
            front.last_progress = time.monotonic()
            loop.call_soon_threadsafe(self._on_update, i, samples)

        return on_update

    def _on_update(self, i: int, samples: list[Sample]) -> None:
        self.latest[i] = samples
        if self.stops[i]:
            self._check_stops(i, samples)
        self.changed.set()

    def _check_stops(self, i: int, samples: Sequence[Sample]) -> None:
        """Abort samples whose new tokens complete a stop string (the cut happens in `finish`)."""
        stops = self.stops[i]
        longest = max(len(s) for s in stops)
        for s in samples:
            key = (i, s.index)
            if s.finish_reason is not None or key in self.stopped:
                continue
            start = max(0, self._checked.get(key, 0) - longest - 2)
            self._checked[key] = len(s.output_ids)
            tail = self.front.detok.text(s.output_ids[start:], skip_special_tokens=False)
            if any(stop in tail for stop in stops):
                self.stopped.add(key)
                self.front.abort_soon(f"{self.requests[i].rid}-{s.index}")

    def abort(self) -> None:
        """Abort every request of this job that is still running (without waiting for the engine)."""
        for request, future in zip(self.requests, self.futures):
            if not future.done():
                self.front.abort_soon(request.rid)

    def finish(self, i: int, sample: Sample) -> SampleView:
        """The client's view of a finished sample of request i (memoised, so stream and body agree)."""
        key = (i, sample.index)
        done = self._finished.get(key)
        if done is not None:
            return done
        detok = self.front.detok
        finish = None if sample.finish_reason is None else sample.finish_reason.to_sglang()
        text = None
        if detok is not None:
            cut = cut_at_stop(sample, self.stops[i], detok) if self.stops[i] else None
            if cut is not None:
                sample, stop = cut
                finish = {"type": "stop", "matched": stop}
                text = detok.text(sample.output_ids, self.skip_special_tokens[i])
                at = text.find(stop)
                if at >= 0 and not self.no_stop_trim[i]:
                    text = text[:at]
            else:
                text = detok.text(sample.output_ids, self.skip_special_tokens[i])
        done = SampleView(sample, text, finish)
        self._finished[key] = done
        return done

    def partial(self, i: int, sample: Sample) -> SampleView:
        """A running sample's view for a stream chunk (not memoised); text that may be the start
        of a stop string, or a character still missing bytes, is held back until the next tokens."""
        detok = self.front.detok
        text = None if detok is None else detok.text(sample.output_ids, self.skip_special_tokens[i])
        if text:
            # a trailing U+FFFD is the start of a character whose other bytes are still to come
            text = text.rstrip("\ufffd")
        if text and self.stops[i]:
            text = text[: len(text) - held_back(text, self.stops[i])]
        return SampleView(sample, text, None)

    async def results(self) -> list[list[SampleView]]:
        """Wait for every request; a cancelled wait (client gone) aborts them."""
        try:
            outs = await asyncio.gather(*(wait_future(f) for f in self.futures))
        except asyncio.CancelledError:
            self.abort()
            raise
        return [[self.finish(i, s) for s in samples] for i, samples in enumerate(outs)]

    async def updates(self) -> AsyncIterator[tuple[int, SampleView, bool]]:
        """(request index, sample view, final) whenever a sample grows or ends, until all end."""
        emitted: dict[tuple[int, int], int] = {}
        final: set[tuple[int, int]] = set()
        pending = set(range(len(self.requests)))
        try:
            while pending:
                await self.changed.wait()
                self.changed.clear()
                for i in sorted(pending):
                    future = self.futures[i]
                    if future.done():
                        for s in future.result():
                            if (i, s.index) not in final:
                                final.add((i, s.index))
                                yield i, self.finish(i, s), True
                        pending.discard(i)
                        continue
                    snapshot, self.latest[i] = self.latest[i], None
                    for s in snapshot or ():
                        key = (i, s.index)
                        if key in final or key in self.stopped:
                            continue
                        if s.finish_reason is not None:
                            final.add(key)
                            yield i, self.finish(i, s), True
                        elif len(s.output_ids) > emitted.get(key, 0):
                            emitted[key] = len(s.output_ids)
                            yield i, self.partial(i, s), False
        finally:
            self.abort()


def wait_future(future: concurrent.futures.Future) -> asyncio.Future:
    """Await an engine future without letting a cancelled wait cancel the engine's future
    (the engine resolves it; abort is how a request is stopped)."""
    return asyncio.shield(asyncio.wrap_future(future))


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def cut_at_stop(sample: Sample, stops: Sequence[str], detok: Detokenizer) -> tuple[Sample, str] | None:
    """(sample cut after the token that completes the first stop string, that string), or None.
    Stop strings match the text with special tokens, as SGLang matches them."""

    def decode(k: int) -> str:
        return detok.text(sample.output_ids[:k], skip_special_tokens=False)

    def hit(text: str) -> str | None:
        found = [(text.find(s), s) for s in stops if s in text]
        return min(found)[1] if found else None

    if hit(decode(len(sample.output_ids))) is None:
        return None
    lo, hi = 1, len(sample.output_ids)
    while lo < hi:  # the shortest prefix whose text holds a stop string
        mid = (lo + hi) // 2
        if hit(decode(mid)) is None:
            lo = mid + 1
        else:
            hi = mid
    stop = hit(decode(lo))
    spans = tuple(replace(s, end=min(s.end, lo)) for s in sample.weight_versions if s.start < lo or s.start == 0)
    cut = replace(
        sample,
        output_ids=sample.output_ids[:lo],
        logprobs=sample.logprobs[:lo],
        sampling_logprobs=sample.sampling_logprobs[:lo],
        top_logprobs=None if sample.top_logprobs is None else sample.top_logprobs[:lo],
        finish_reason=FinishReason("stop"),
        weight_versions=spans,
    )
    return cut, stop


class Frontend:
    """What the routes share: the engine, the tokenizer, requests in flight, server facts."""

    def __init__(
        self,
        engine,
        tokenizer=None,
        *,
        served_model_name: str | None = None,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        hf_config: dict | None = None,
        sampling_defaults: dict | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = "auto",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        health_timeout_s: float = 20.0,
        server_args: dict | None = None,
    ):
        self.engine = engine
        self.detok = None if tokenizer is None else Detokenizer(tokenizer)
        # What the engine forces once a request's thinking budget is spent (module docstring).
        self.think_end_ids = () if self.detok is None else self.detok.think_end_ids()
        self.model_path = model_path or getattr(engine, "model_path", None) or ""
        self.served_model_name = served_model_name or self.model_path or "default"
        self.tokenizer_path = tokenizer_path or (self.model_path if tokenizer is not None else None)
        if hf_config is None and self.model_path:
            hf_config = read_json_file(os.path.join(self.model_path, "config.json"))
        self.hf_config = hf_config or {}
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.max_request_bytes = max_request_bytes
        self.health_timeout_s = health_timeout_s
        self.server_args = dict(server_args or {})
        self.inflight: dict[str, concurrent.futures.Future] = {}
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ptrain-serve-abort")
        self.last_progress = time.monotonic()
        self.ready = True
        self.draining = False
        self.paused = False
        self.update_lock = asyncio.Lock()
        self.started = time.time()
        self.lora_enabled = bool(getattr(engine, "max_loras", 0))
        self.lora_lock = asyncio.Lock()  # one adapter load or unload at a time
        self.unloading: set[str] = set()
        self._lora_users: dict[str, int] = {}  # adapter -> requests in flight (engine thread decrements)
        self._lora_users_lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return int(self.engine.context_length)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    def tokenize(self) -> Callable[[str], list[int]] | None:
        return None if self.detok is None else self.detok.encode

    def track(self, rid: str, future: concurrent.futures.Future, lora: str | None = None) -> None:
        """Remember a request in flight (for prefix aborts, and for an unload of its adapter to
        wait on) until its future resolves."""
        self.inflight[rid] = future
        if lora is not None:
            with self._lora_users_lock:
                self._lora_users[lora] = self._lora_users.get(lora, 0) + 1

        def forget(f: concurrent.futures.Future) -> None:
            if self.inflight.get(rid) is f:
                self.inflight.pop(rid, None)
            if lora is not None:
                with self._lora_users_lock:
                    self._lora_users[lora] -= 1

        future.add_done_callback(forget)

    def lora_users(self, name: str) -> int:
        """Requests in flight that sample with adapter `name`."""
        with self._lora_users_lock:
            return self._lora_users.get(name, 0)

    def loaded_adapters(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: {adapter name: its folder}."""
        if not self.lora_enabled:
            return {}
        return {name: info.get("path") or "" for name, info in self.engine.loras().items()}

    def check_lora(self, name: str | None, field: str) -> None:
        """RequestError unless `name` is None (the base model) or an adapter being served;
        `field` is the request field that named it."""
        if name is None:
            return
        if not self.lora_enabled:
            raise RequestError(
                f"{field}: LoRA adapter {name!r} was requested, but this server serves no LoRA adapters; start "
                "it with --enable-lora (or --lora-paths) and load the adapter"
            )
        if name in self.unloading:
            raise RequestError(f"{field}: LoRA adapter {name!r} is being unloaded; load it again to use it")
        loaded = self.loaded_adapters()
        if name not in loaded:
            raise RequestError(
                f"{field}: no LoRA adapter named {name!r} is loaded (loaded: {sorted(loaded) or 'none'}); load it "
                "with /load_lora_adapter (or start the server with --lora-paths)"
            )

    def abort(self, rid: str | None) -> int:
        """Abort `rid` (SGLang matches request ids by prefix, so a batch's `rid` reaches its
        `rid_i` requests), a sample id `rid-j`, or everything when None. Blocks until the
        engine is between two device calls: call it from a worker thread."""
        if rid is None:
            return self.engine.abort(None)
        targets = [r for r in list(self.inflight) if r.startswith(rid)] or [rid]
        return sum(self.engine.abort(r) for r in targets)

    def abort_soon(self, rid: str) -> None:
        """engine.abort(rid) on a worker thread, so the event loop never waits for a device call."""
        self._workers.submit(self.engine.abort, rid)

    def job(
        self,
        requests: Sequence[GenerateRequest],
        *,
        skip_special_tokens: Sequence[bool],
        stops: Sequence[tuple[str, ...]] = (),
        no_stop_trim: Sequence[bool] = (),
        watch: bool = False,
        lora_field: str = "lora_path",
    ) -> Job:
        """Submit `requests` (RequestError before anything runs) and return their Job.
        `lora_field`: the request field that named the requests' adapter, for errors."""
        for name in dict.fromkeys(r.lora_path for r in requests):
            self.check_lora(name, lora_field)
        job = Job(
            self,
            tuple(self.with_thinking(r) for r in requests),
            tuple(skip_special_tokens),
            tuple(stops),
            tuple(no_stop_trim),
            watch,
        )
        job.start()
        return job

    def with_thinking(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with its thinking budget ready for the engine: the end-of-thinking ids
        from the tokenizer unless the request names its own, and no budget when the prompt
        already closed the reasoning. RequestError when there are no ids to force."""
        sp = request.sampling
        if sp.thinking_budget is None:
            return request
        ends = sp.think_end_ids or self.think_end_ids
        if not ends:
            raise RequestError(
                f"thinking budget {sp.thinking_budget}: this server has no tokenizer to find the "
                f"{THINK_END_TEXT!r} token ids in (--skip-tokenizer-init, or it encodes to more than "
                f"{MAX_THINK_END_IDS} tokens); send them as sampling_params.custom_params.{THINK_END_IDS_KEY}"
            )
        if self.prompt_closes_thinking(request.input_ids, ends):
            return replace(request, sampling=replace(sp, thinking_budget=None, think_end_ids=()))
        return replace(request, sampling=replace(sp, think_end_ids=ends))

    def prompt_closes_thinking(self, prompt_ids: Sequence[int], ends: Sequence[int]) -> bool:
        """Whether the prompt ends with the end of thinking, trailing whitespace aside (Nemotron
        3 Nano's reasoning-off `<think></think>`, Qwen3's `<think>\n\n</think>\n\n`)."""
        if self.detok is not None and tuple(ends) == self.think_end_ids:
            tail = self.detok.text(prompt_ids[-(len(ends) + 8) :], skip_special_tokens=False)
            return tail.rstrip().endswith(THINK_END_TEXT)
        return tuple(prompt_ids[-len(ends) :]) == tuple(ends)

    async def warmup(self) -> None:
        """One short greedy request, so the first client does not wait for the first compile."""
        try:
            request = GenerateRequest(
                input_ids=(0,),
                sampling=SamplingParams(max_new_tokens=2, temperature=0.0),
                rid=f"{HEALTH_CHECK_RID_PREFIX}_warmup_{uuid.uuid4().hex}",
            )
            await wait_future(self.engine.submit(request))
        except Exception:  # a broken engine shows in /health_generate, not as a crash here
            log.exception("warm-up request failed")
        finally:
            self.ready = True
            log.info("the server is ready")

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` body."""
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path or "",
            "is_generation": True,
            "preferred_sampling_params": self.sampling_defaults or None,
            "weight_version": self.engine.weight_version,
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": self.effective_tool_call_parser(),
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"),
            "architectures": self.hf_config.get("architectures"),
        }

    def effective_tool_call_parser(self) -> str | None:
        """The tool-call format to parse: the flag's, or with "auto" the chat template's
        (a template that writes `<tool_call>` blocks is the Qwen 2.5 / Hermes format)."""
        if self.tool_call_parser not in (None, "auto"):
            return None if self.tool_call_parser == "none" else self.tool_call_parser
        if self.tool_call_parser is None:
            return None
        template = self.chat_template
        if template is None and self.detok is not None:
            template = getattr(self.detok.tokenizer, "chat_template", None)
        return "qwen25" if isinstance(template, str) and "<tool_call>" in template else None

    def output_tokens(self) -> int | None:
        """The engine's count of tokens generated so far, where it keeps one (LocalEngine.stats)."""
        stats = getattr(self.engine, "stats", None)
        return stats.get("output_tokens") if isinstance(stats, dict) else None

    def is_paused(self) -> bool:
        """Generation is paused (/pause_generation), as the engine reports it."""
        return bool(self.engine.info().get("paused", self.paused))

    def load(self) -> dict[str, int]:
        load = self.engine.load()
        return {"running": int(load.get("running", 0)), "queued": int(load.get("queued", 0))}

    def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info` body: the launch arguments plus live state."""
        info = self.engine.info()
        load = self.load()
        max_running = int(info.get("max_running_requests", self.engine.max_running_requests))
        lora = self.lora_enabled
        return {
            **self.server_args,
            # SGLang's LoRA server args, as resolved: what the engine serves
            "enable_lora": lora,
            "max_loras_per_batch": int(self.engine.max_loras) if lora else DEFAULT_MAX_LORAS_PER_BATCH,
            "max_lora_rank": int(self.engine.max_lora_rank) if lora else None,
            "lora_target_modules": list(self.engine.lora_targets) if lora else None,
            "lora_paths": self.server_args.get("lora_paths") if lora else None,
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path or "",
            "context_length": self.context_length,
            "max_context_length": self.context_length,
            "max_running_requests": max_running,
            "max_total_num_tokens": max_running * self.context_length,
            "dp_size": 1,
            "disaggregation_mode": "null",
            "incremental_streaming_output": False,
            "version": __version__,
            "frontend": "ptrain",
            "startup_time": self.started,
            "internal_states": [
                {
                    "weight_version": self.engine.weight_version,
                    "num_running_reqs": load["running"],
                    "num_waiting_reqs": load["queued"],
                    "paused": self.is_paused(),
                }
            ],
        }


# ---- native routes ----


def _front(request: Request) -> Frontend:
    return request.app.state.front


async def _watch_disconnect(receive) -> None:
    """Return when the client hangs up (the ASGI receive after the body blocks until then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_gone(request: Request, job: Job) -> list[list[SampleView]] | None:
    """The job's results, or None (with the job aborted) if the client disconnects first."""
    results = asyncio.ensure_future(job.results())
    gone = asyncio.ensure_future(_watch_disconnect(request.receive))
    done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    if results in done:
        gone.cancel()
        return results.result()
    results.cancel()
    job.abort()
    log.info("client disconnected; aborted %s", [r.rid for r in job.requests])
    return None


def _item(parsed: wire.ParsedGenerate, front: Frontend, i: int, view: SampleView, index: int | None) -> dict:
    item = wire.generate_item(
        view.sample,
        text=view.text,
        return_logprob=parsed.return_logprob[i],
        logprob_start_len=parsed.logprob_start_len[i],
        token_texts=front.detok.token_texts if parsed.return_text_in_logprobs and front.detok else None,
        return_prompt_token_ids=parsed.return_prompt_token_ids,
        index=index,
    )
    item["meta_info"]["finish_reason"] = view.finish_reason
    return item


def parse_generate_body(body: Any, front: Frontend) -> tuple[wire.ParsedGenerate, list, list]:
    """`wire.parse_generate` with this server's stop strings split off each `sampling_params`."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object (GenerateReqInput), got {wire.type_name(body)}")
    sp = body.get("sampling_params")
    has_tok = front.detok is not None
    if isinstance(sp, list):
        split = [parse_stops(s, f"sampling_params[{i}]", has_tok) for i, s in enumerate(sp)]
        body = {**body, "sampling_params": [s[0] for s in split]}
    else:
        one = parse_stops(sp, "sampling_params", has_tok)
        body = {**body, "sampling_params": one[0]}
        split = None
    parsed = wire.parse_generate(body, tokenize=front.tokenize())
    count = len(parsed.requests)
    split = split or [one] * count
    if parsed.ignored_fields:
        log.debug("/generate ignored unknown fields %s", list(parsed.ignored_fields))
    return parsed, [s[1] for s in split], [s[2] for s in split]


async def generate(request: Request) -> Response:
    """POST /generate: SGLang's GenerateReqInput -> one response object, or a list, or an SSE stream."""
    front = _front(request)
    body = await read_json(request, front.max_request_bytes)
    parsed, stops, no_trim = parse_generate_body(body, front)
    job = front.job(
        parsed.requests,
        skip_special_tokens=parsed.skip_special_tokens,
        stops=stops,
        no_stop_trim=no_trim,
        watch=parsed.stream,
    )
    n = parsed.n
    if parsed.stream:

        async def events() -> AsyncIterator[bytes]:
            try:
                async for i, view, _final in job.updates():
                    index = None if parsed.single else i * n + view.sample.index
                    chunk = _item(parsed, front, i, view, index)
                    yield b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            except Exception as e:  # the engine failed mid-stream: SGLang's in-stream error object
                log.exception("stream failed")
                error = {"error": {"message": str(e), "type": "invalid_request_error", "code": 400, "retryable": False}}
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    results = await until_done_or_gone(request, job)
    if results is None:
        return Response(status_code=499)
    items = [[_item(parsed, front, i, view, None) for view in views] for i, views in enumerate(results)]
    return json_response(wire.order_items(items, parsed.single))


async def health(request: Request) -> Response:
    """GET /health: 200 while serving; 503 while warming up or shutting down."""
    front = _front(request)
    return Response(status_code=200 if front.ready and not front.draining else 503)


async def health_generate(request: Request) -> Response:
    """GET /health_generate: 200 once a one-token request is served (or the engine shows any
    progress meanwhile, as SGLang counts it); 503 while starting, shutting down or stuck.
    A paused server answers 200 without generating: it is alive, deliberately idle."""
    front = _front(request)
    if not front.ready or front.draining:
        return Response(status_code=503)
    if front.is_paused():
        return Response(status_code=200)
    tic = time.monotonic()
    tokens = front.output_tokens()
    rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
    probe = GenerateRequest(input_ids=(0,), sampling=SamplingParams(max_new_tokens=1, temperature=0.0), rid=rid)
    try:
        future = front.engine.submit(probe)
    except Exception as e:
        log.error("health check could not submit: %s", e)
        return Response(status_code=503)
    waiter = wait_future(future)
    while time.monotonic() < tic + front.health_timeout_s:
        done, _ = await asyncio.wait({waiter}, timeout=0.05)
        if done:
            ok = not waiter.exception()
            return Response(status_code=200 if ok else 503)
        if front.last_progress > tic or front.output_tokens() != tokens:
            front.abort_soon(rid)
            return Response(status_code=200)
    front.abort_soon(rid)
    log.error("health check: no progress in %.0f s", front.health_timeout_s)
    return Response(status_code=503)


async def model_info(request: Request) -> Response:
    """GET /model_info (and /get_model_info)."""
    return json_response(_front(request).model_info())


async def server_info(request: Request) -> Response:
    """GET /server_info (and /get_server_info)."""
    return json_response(_front(request).server_info())


async def flush_cache(request: Request) -> Response:
    """POST/GET /flush_cache: 200, or 400 while requests run (clients retry), as SGLang answers."""
    ok = await asyncio.to_thread(_front(request).engine.flush_cache)
    if ok:
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status_code=200,
        )
    return Response("Flush cache failed: requests are running or waiting; retry when idle.\n", status_code=400)


async def loads(request: Request) -> Response:
    """GET /v1/loads: the request counts SGLang's `LoadSnapshot` reports, for one rank."""
    front = _front(request)
    dp_rank = request.query_params.get("dp_rank")
    if dp_rank not in (None, "0"):
        raise HTTPError(400, f"dp_rank: this server has one rank (0), got {dp_rank}")
    load = front.load()
    max_running = int(front.engine.max_running_requests)
    snapshot = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": load["running"],
        "num_waiting_reqs": load["queued"],
        "max_running_requests": max_running,
        "utilization": load["running"] / max_running if max_running else 0.0,
    }
    if request.query_params.get("format") == "prometheus":
        lines = []
        for key, value in snapshot.items():
            if key != "dp_rank":
                lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="0"}} {value}']
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
    return json_response(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": __version__,
            "accelerator": front.server_args.get("accelerator"),
            "num_accelerators": front.server_args.get("tp_size", 1),
            "loads": [snapshot],
        }
    )


def _control_body(body: dict, where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A control body with SGLang's field names: unknown keys refused, defaults filled in."""
    wire.check_fields(body, where, fields)
    return {k: default if body.get(k) is None else body[k] for k, default in fields.items()}


async def update_weights_from_disk(request: Request) -> Response:
    """POST /update_weights_from_disk: load a safetensors folder, check it against the served
    model, swap atomically and bump the weight version; a bad folder is a 400 with the reason
    and the old weights keep serving."""
    front = _front(request)
    body = _control_body(
        await read_optional_json(request, front.max_request_bytes),
        "update_weights_from_disk",
        wire.UPDATE_WEIGHTS_FIELDS,
    )
    path = body["model_path"]
    if not isinstance(path, str) or not path:
        raise RequestError("model_path: required, the folder of the new weights (config.json + *.safetensors)")
    for key in ("abort_all_requests", "flush_cache", "keep_pause", "is_async"):
        if not isinstance(body[key], bool):
            raise RequestError(f"{key}: must be true or false, got {wire.type_name(body[key])}")
    version = body["weight_version"]
    if version is not None and not isinstance(version, str):
        raise RequestError(f"weight_version: must be a string, got {wire.type_name(version)}")
    if body["load_format"] not in wire.LOAD_FORMATS:
        raise RequestError(
            f"load_format: this server loads safetensors folders only; leave it out, got {body['load_format']!r}"
        )
    if body["manifest"] is not None:
        raise RequestError("manifest: not supported; the folder's safetensors index is read instead")
    async with front.update_lock:
        try:
            new_version = await asyncio.to_thread(
                front.engine.update_weights_from_disk,
                path,
                weight_version=version,
                abort_all_requests=body["abort_all_requests"],
                flush_cache=body["flush_cache"],
            )
        except Exception as e:  # the engine keeps the old weights on any failure
            log.warning("update_weights_from_disk %s failed: %s", path, e)
            return json_response({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
    front.model_path = path
    message = f"Succeeded to update model weights. Weight version updated to {new_version}."
    return json_response({"success": True, "message": message, "num_paused_requests": 0})


async def pause_generation(request: Request) -> Response:
    """POST /pause_generation {"mode": "abort" | "retract" | "in_place"}."""
    front = _front(request)
    body = _control_body(
        await read_optional_json(request, front.max_request_bytes), "pause_generation", wire.PAUSE_FIELDS
    )
    if body["mode"] not in wire.PAUSE_MODES:
        raise RequestError(f"mode: must be one of {list(wire.PAUSE_MODES)}, got {body['mode']!r}")
    await asyncio.to_thread(front.engine.pause, body["mode"])
    front.paused = True
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    """POST /continue_generation."""
    front = _front(request)
    _control_body(
        await read_optional_json(request, front.max_request_bytes), "continue_generation", wire.CONTINUE_FIELDS
    )
    await asyncio.to_thread(front.engine.resume)
    front.paused = False
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


def lora_update(front: Frontend, success: bool, error_message: str = "", loaded: bool = True) -> Response:
    """SGLang's LoRAUpdateOutput body: 200 on success, else 400. `loaded`: list the adapters
    (SGLang leaves them out, null, when LoRA is off)."""
    body = {
        "success": success,
        "error_message": error_message,
        "loaded_adapters": front.loaded_adapters() if loaded else None,
    }
    return json_response(body, 200 if success else 400)


def _lora_name_of(body: dict) -> str:
    name = body["lora_name"]
    if not isinstance(name, str) or not name:
        raise RequestError(
            f"lora_name: required, the adapter's name (requests name it in lora_path), got {wire.type_name(name)}"
        )
    if body["lora_id"] is not None:
        raise RequestError(LORA_ID_REFUSED)
    return name


async def load_lora_adapter(request: Request) -> Response:
    """POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}: serve the PEFT folder at
    lora_path under lora_name. An adapter that does not fit (another model size, a rank above
    --max-lora-rank, targets outside --lora-target-modules, no such folder, no free slot) is a
    400 naming the mismatch; the adapters already loaded keep serving."""
    front = _front(request)
    body = _control_body(
        await read_optional_json(request, front.max_request_bytes), "load_lora_adapter", wire.LOAD_LORA_FIELDS
    )
    name, path = _lora_name_of(body), body["lora_path"]
    if not isinstance(path, str) or not path:
        raise RequestError(f"lora_path: required, the adapter's PEFT folder, got {wire.type_name(path)}")
    if not isinstance(body["pinned"], bool):
        raise RequestError(f"pinned: must be true or false, got {wire.type_name(body['pinned'])}")
    if not front.lora_enabled:
        return lora_update(front, False, LORA_NOT_ENABLED, loaded=False)
    from ptrain.rollout.local import LoRAError

    async with front.lora_lock:
        if name in front.unloading:
            return lora_update(front, False, f"LoRA adapter {name!r} is being unloaded; load it again afterwards")
        try:
            await asyncio.to_thread(front.engine.load_lora, name, path)
        except LoRAError as e:
            log.warning("load_lora_adapter %s from %s failed: %s", name, path, e)
            return lora_update(front, False, with_flag_names(str(e)))
    log.info("loaded LoRA adapter %s from %s", name, path)
    return lora_update(front, True)


async def unload_lora_adapter(request: Request) -> Response:
    """POST /unload_lora_adapter {"lora_name"}: stop serving the adapter and free its slot.
    As SGLang does, new requests for it are refused at once and the unload waits for the
    requests already using it to finish."""
    front = _front(request)
    body = _control_body(
        await read_optional_json(request, front.max_request_bytes), "unload_lora_adapter", wire.UNLOAD_LORA_FIELDS
    )
    name = _lora_name_of(body)
    if not front.lora_enabled:
        return lora_update(front, False, LORA_NOT_ENABLED, loaded=False)
    from ptrain.rollout.local import LoRAError

    async with front.lora_lock:
        if name not in front.loaded_adapters():
            loaded = sorted(front.loaded_adapters()) or "none"
            return lora_update(front, False, f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        front.unloading.add(name)
        try:
            while front.lora_users(name):
                await asyncio.sleep(0.02)
            await asyncio.to_thread(front.engine.unload_lora, name)
        except LoRAError as e:
            return lora_update(front, False, with_flag_names(str(e)))
        finally:
            front.unloading.discard(name)
    log.info("unloaded LoRA adapter %s", name)
    return lora_update(front, True)


async def abort_request(request: Request) -> Response:
    """POST /abort_request {"rid": ..., "abort_all": false}: aborted requests answer with
    finish_reason abort and their partial tokens."""
    front = _front(request)
    body = _control_body(await read_optional_json(request, front.max_request_bytes), "abort_request", wire.ABORT_FIELDS)
    rid, abort_all = body["rid"], body["abort_all"]
    if not isinstance(rid, str):
        raise RequestError(f"rid: must be a string, got {wire.type_name(rid)}")
    if not isinstance(abort_all, bool):
        raise RequestError(f"abort_all: must be true or false, got {wire.type_name(abort_all)}")
    if abort_all or rid:
        await asyncio.to_thread(front.abort, None if abort_all else rid)
    return Response(status_code=200)


# ---- the app ----


async def _request_error(request: Request, exc: Exception) -> Response:
    if request.url.path.startswith("/v1/") and request.url.path != "/v1/loads":
        from ptrain.serve.openai_api import openai_error

        return openai_error(400, str(exc))
    return error_response(400, str(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    if request.url.path.startswith("/v1/") and request.url.path != "/v1/loads":
        from ptrain.serve.openai_api import openai_error

        return openai_error(exc.status, exc.message)
    return error_response(exc.status, exc.message)


def make_app(
    engine,
    tokenizer=None,
    *,
    served_model_name: str | None = None,
    warmup: bool = False,
    **front_kw: Any,
) -> Starlette:
    """The ASGI app around `engine` (a `RolloutEngine` with LocalEngine's control methods) and
    the model folder's `tokenizer` (None: token-id prompts only). `front_kw` go to `Frontend`
    (model_path, tokenizer_path, hf_config, sampling_defaults, chat_template, tool_call_parser,
    max_request_bytes, health_timeout_s, server_args). warmup: answer /health 503 until one
    short request has run (the server's start-up)."""
    from ptrain.serve.openai_api import openai_routes
    from ptrain.serve.tokenizer_api import tokenizer_routes
    from ptrain.serve.vllm_api import vllm_routes

    front = Frontend(engine, tokenizer, served_model_name=served_model_name, **front_kw)
    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        *openai_routes(),
        *tokenizer_routes(),
        *vllm_routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if warmup:
            front.ready = False
            task = asyncio.create_task(front.warmup())
        yield
        if warmup and not task.done():
            task.cancel()

    app = Starlette(
        routes=routes,
        exception_handlers={RequestError: _request_error, HTTPError: _http_error},
        lifespan=lifespan,
    )
    app.state.front = front
    return app


# ---- the process ----


def load_tokenizer(path: str):
    """The folder's Hugging Face tokenizer (local files only, never a download)."""
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
        os.path.join(path, "tokenizer_config.json")
    ):
        raise FileNotFoundError(
            f"no tokenizer in '{path}' (tokenizer.json or tokenizer_config.json); pass --tokenizer-path DIR, "
            "or --skip-tokenizer-init to serve token-id prompts only"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:  # transformers' message alone names no file for a corrupt one
        raise ValueError(
            f"the tokenizer in '{path}' does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "copy or convert its tokenizer files again, or pass --tokenizer-path DIR"
        ) from None


def read_json_file(path: str) -> dict:
    """A JSON file as a dict ({} when absent); ValueError naming the file when it is not one."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); copy or convert the model folder again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def sampling_defaults_of(model_path: str) -> dict:
    """The model's generation_config.json sampling defaults (what SGLang's OpenAI routes use
    when a request leaves them out)."""
    gen = read_json_file(os.path.join(model_path, "generation_config.json"))
    return {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p") if gen.get(k) is not None}


def serve(args) -> int:
    """Build the engine from args.model_path, then serve until SIGTERM/SIGINT; returns the exit code."""
    import uvicorn

    from ptrain.rollout.local import LocalEngine

    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        vocab = read_json_file(os.path.join(args.model_path, "config.json")).get("vocab_size")
        if isinstance(vocab, int) and len(tokenizer) > vocab:  # its ids past the embedding would fail requests
            raise ValueError(
                f"the tokenizer in '{args.tokenizer_path or args.model_path}' has {len(tokenizer)} tokens, but the "
                f"model in '{args.model_path}' has a vocabulary of {vocab}; pass the tokenizer saved with that "
                "model (--tokenizer-path DIR)"
            )
    chat_template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    engine_kw: dict[str, Any] = {"weight_version": args.weight_version, "seed": args.random_seed}
    if args.max_running_requests is not None:
        engine_kw["max_running_requests"] = args.max_running_requests
    if args.context_length is not None:
        engine_kw["context_length"] = args.context_length
    lora_refs = getattr(args, "lora_refs", [])
    if getattr(args, "enable_lora", False):  # resolved by cli.check_lora
        engine_kw.update(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, lora_targets=args.lora_targets)
    log.info("loading %s (tp_size %d, %s)", args.model_path, args.tp_size, args.dtype)
    engine = LocalEngine.from_hf(args.model_path, dtype=args.dtype, tp_size=args.tp_size, **engine_kw)
    load_startup_adapters(engine, lora_refs)
    import jax

    server_args = {
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp_size,
        "dtype": args.dtype,
        "random_seed": args.random_seed,
        "skip_tokenizer_init": args.skip_tokenizer_init,
        "chat_template": args.chat_template,
        "tool_call_parser": args.tool_call_parser,
        "max_request_bytes": args.max_request_bytes,
        "graceful_shutdown_timeout": args.graceful_shutdown_timeout,
        "accelerator": jax.devices()[0].device_kind,
        "lora_paths": lora_refs or None,
    }
    app = make_app(
        engine,
        tokenizer,
        served_model_name=args.served_model_name,
        warmup=not args.skip_server_warmup,
        model_path=args.model_path,
        tokenizer_path=None if tokenizer is None else (args.tokenizer_path or args.model_path),
        hf_config=read_json_file(os.path.join(args.model_path, "config.json")),
        sampling_defaults=sampling_defaults_of(args.model_path),
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
        max_request_bytes=args.max_request_bytes,
        server_args=server_args,
    )
    front: Frontend = app.state.front

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, with /health answering 503 from the first SIGTERM on."""

        def handle_exit(self, sig, frame) -> None:
            front.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_requests,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
        lifespan="on",
    )
    # uvicorn drains on SIGTERM, then re-raises the signal to the handler it found; ours
    # turns that into a normal return, so a drained server exits 0 (Ctrl-C likewise).
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    server = DrainingServer(config)

    def watch_engine() -> None:
        # An engine whose thread failed serves nothing again; SGLang's server exits when its
        # scheduler dies, and so does this one, so that a supervisor or the fleet client sees
        # a dead worker rather than one that answers /health and fails every request.
        while engine.failure is None and not server.should_exit:
            time.sleep(0.5)
        if engine.failure is not None:
            log.error("the engine thread failed (%r); stopping the server", engine.failure)
            front.draining = True
            server.should_exit = True

    threading.Thread(target=watch_engine, name="ptrain-serve-watch", daemon=True).start()
    try:
        server.run()
    except (Stopped, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    if engine.failure is not None:
        print(f"ptrain.serve: error: the engine thread failed: {engine.failure!r} (traceback above)", file=sys.stderr)
        return 1
    log.info("server stopped")
    return 0


def load_startup_adapters(engine, refs: Sequence[dict]) -> None:
    """Load the --lora-paths adapters; one that does not fit closes the engine and raises
    ValueError naming it (the process exits 1 with the message)."""
    from ptrain.rollout.local import LoRAError

    for ref in refs:
        try:
            engine.load_lora(ref["lora_name"], ref["lora_path"])
        except LoRAError as e:
            engine.close()
            raise ValueError(f"--lora-paths {ref['lora_name']}: {with_flag_names(str(e))}") from None
        log.info("loaded LoRA adapter %s from %s", ref["lora_name"], ref["lora_path"])


class Stopped(Exception):
    """SIGTERM arrived after the server drained its requests."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped()
