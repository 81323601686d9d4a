"""The HTTP layer of `python -m ptrain.tinker`: Tinker's REST API in front of a `TinkerService`.

    app = make_app(TinkerService(...), api_key="tml-...")      # a Starlette app; uvicorn serves it

What the `tinker` SDK and tinker-cookbook's trainers call, under /api/v1/:
  - session plumbing, answered at once: healthz, client/config, client/dynamic_config,
    create_session, session_heartbeat, sessions/{id}/finish (the SDK's close), telemetry,
    get_server_capabilities;
  - model metadata, answered at once: get_info, create_sampling_session, samplers/{id},
    training_runs[/{id}[/checkpoints]], checkpoints, weights_info;
  - work, answered with a future ({request_id, model_id?, sample_sequence_ids?}) that the
    client polls through retrieve_future: create_model, forward(_backward), optim_step,
    save_weights, save_weights_for_sampler, load_weights, asample, unload_model.

The service's calls are blocking JAX work. Training work runs on one worker thread in the
order it arrived, which is the order the SDK sends a training client's requests in (it
holds each back until the previous one was sent), so a step always follows its gradients.
Sampling runs on a second thread, so rollouts do not wait behind a training step.

retrieve_future holds a pending poll open for up to `poll_wait_s` (the SDK polls again at
once, so answering at once would spin) and then answers HTTP 408 {"type": "try_again"}.
A finished forward/backward or sample comes back as protobuf when the poll accepts it (SDK
0.38 accepts nothing else), other results as JSON; a failed one as {"error", "category"}
with status 200, which is how the SDK tells a failed request from a failed poll. Requests
the server refuses outright get their HTTP status with the same {"error", "category"} body.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import itertools
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ptrain.tinker import wire
from ptrain.tinker.service import TinkerError

log = logging.getLogger("ptrain.tinker")

API = "/api/v1"
OPEN_PATHS = {f"{API}/healthz"}
"""Paths answered without an API key (a load balancer's or a launcher's readiness probe)."""
DEFAULT_POLL_WAIT_S = 10.0
"""How long retrieve_future waits for a pending result before it answers try_again (the SDK's
poll timeout is 45 s)."""
RESULT_TTL_S = 3600.0
"""How long a finished result waits for its client; a result read once goes after RETRIEVED_TTL_S."""
RETRIEVED_TTL_S = 60.0
CLIENT_CONFIG = {
    # No JWT exchange: the X-API-Key header is the credential on every request.
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    # forward_backward bodies arrive as plain protobuf (zstd is accepted too).
    "proto_compress_fwdbwd": False,
    # Features of the hosted service this server does not have: the SDK then uses its
    # per-request polling, client-side custom losses and random sampler clone ids.
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}
UNSUPPORTED_SAMPLE_FIELDS = {
    "topk_sample_logprobs": 0,
    "prompt_alt_tokens_k": 0,
    "target_prompt_logprobs": None,
    "record_stability_info": None,
}
"""SampleRequest fields the service cannot answer, with the value that means 'not asked for'."""


class RequestRefused(Exception):
    """A request answered with an HTTP error status and Tinker's {"error", "category"} body."""

    def __init__(self, message: str, status: int = 400, category: str = "user"):
        super().__init__(message)
        self.status, self.category = status, category


def error_body(message: str, category: str) -> dict:
    return {"error": message, "category": category}


def classify(e: BaseException) -> tuple[int, str, str]:
    """An exception -> (HTTP status, Tinker error category, message): the service's refusals
    keep theirs, a ValueError is the caller's mistake, anything else is the server's."""
    if isinstance(e, (TinkerError, RequestRefused)):
        return e.status, e.category, str(e)
    if isinstance(e, ValueError):  # WireError included
        return 400, "user", str(e) or type(e).__name__
    if isinstance(e, NotImplementedError):
        # 4xx, not 501: the SDK retries any 5xx answer for minutes, and this one will not change
        return 400, "server", f"not implemented by this server: {e}" if str(e) else "not implemented by this server"
    return 500, "server", f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------- futures


@dataclass
class Pending:
    """One future's work and how its result is written."""

    future: concurrent.futures.Future
    encode: Callable[[Any, bool], Response]
    """(result, poll accepts protobuf) -> the response."""
    created: float = field(default_factory=time.monotonic)
    retrieved: float | None = None


class Futures:
    """The futures table: request ids -> work on the training thread or the sampling threads.

    Training work runs on one thread in arrival order. Sampling requests each wait on their
    own thread of `sample_threads`, so requests that arrive together are in the engine at
    once and share its batch (the cookbook sends one request per sample)."""

    def __init__(self, sample_in_own_thread: bool = True, sample_threads: int = 64):
        self.train = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self.sample = (
            concurrent.futures.ThreadPoolExecutor(max_workers=sample_threads, thread_name_prefix="tinker-sample")
            if sample_in_own_thread
            else self.train
        )
        self.table: dict[str, Pending] = {}
        self.lock = threading.Lock()
        self.counter = itertools.count(1)

    def submit(self, executor, fn: Callable[[], Any], encode: Callable[[Any, bool], Response]) -> str:
        request_id = f"req-{next(self.counter)}-{uuid.uuid4().hex[:8]}"
        with self.lock:
            self.prune()
            self.table[request_id] = Pending(executor.submit(_logged(fn, request_id)), encode)
        return request_id

    def get(self, request_id: str) -> Pending | None:
        with self.lock:
            return self.table.get(request_id)

    def prune(self) -> None:
        now = time.monotonic()
        gone = [
            rid
            for rid, p in self.table.items()
            if p.future.done()
            and (now - p.created > RESULT_TTL_S or (p.retrieved is not None and now - p.retrieved > RETRIEVED_TTL_S))
        ]
        for rid in gone:
            del self.table[rid]

    def close(self) -> None:
        for ex in {self.train, self.sample}:
            ex.shutdown(wait=False, cancel_futures=True)


def _logged(fn: Callable[[], Any], request_id: str) -> Callable[[], Any]:
    def run():
        try:
            return fn()
        except Exception as e:
            status, _, message = classify(e)
            if status >= 500:
                log.error("%s failed: %s\n%s", request_id, message, traceback.format_exc())
            else:
                log.info("%s refused: %s", request_id, message)
            raise

    return run


# --------------------------------------------------------------------------------- the app


class TinkerFrontend:
    """The routes' state: the service, the futures table, and the ids the SDK derives itself."""

    def __init__(self, service, *, api_key: str | None, poll_wait_s: float, sample_in_own_thread: bool):
        self.service = service
        self.api_key = api_key
        self.poll_wait_s = poll_wait_s
        self.futures = Futures(sample_in_own_thread)
        self.lock = threading.Lock()
        self.models: dict[str, dict] = {}
        """model_id -> {"session_id", "created", "last_request", "user_metadata"} for models made here."""
        self.aliases: dict[str, str] = {}
        """'<session_id>:train:<model_seq_id>' -> model_id: the id an SDK computes on its own for a
        model it creates from a checkpoint (it never reads the server's answer for that one)."""

    # ---- helpers

    def model_id(self, raw: Any) -> str:
        """A request's model id, resolved and checked against the models this server made."""
        if not isinstance(raw, str) or not raw:
            raise RequestRefused("model_id is missing", 400)
        with self.lock:
            model_id = self.aliases.get(raw, raw)
            entry = self.models.get(model_id)
            if entry is None:
                raise RequestRefused(f"unknown model_id {raw!r}: no model of that id on this server", 404)
            entry["last_request"] = time.time()
        return model_id

    def register_model(self, model_id: str, session_id: str | None, model_seq_id: Any, user_metadata: Any) -> None:
        with self.lock:
            self.models[model_id] = {
                "session_id": session_id,
                "created": time.time(),
                "last_request": time.time(),
                "user_metadata": user_metadata if isinstance(user_metadata, dict) else None,
            }
            if session_id is not None and isinstance(model_seq_id, int):
                self.aliases[f"{session_id}:train:{model_seq_id}"] = model_id

    def future(self, executor, fn, encode=None, *, model_id: str | None = None, **extra) -> JSONResponse:
        request_id = self.futures.submit(executor, fn, encode or json_result)
        body: dict[str, Any] = {"request_id": request_id}
        if model_id is not None:
            body["model_id"] = model_id
        body.update(extra)
        return JSONResponse(body)

    # ---- session plumbing

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def client_config(self, request: Request) -> Response:
        return JSONResponse(CLIENT_CONFIG)

    async def dynamic_config(self, request: Request) -> Response:
        return JSONResponse(DYNAMIC_CONFIG)

    async def create_session(self, request: Request) -> Response:
        body = await json_body(request)
        session_id = await call(self.service.create_session, body.get("tags"), body.get("user_metadata"))
        return JSONResponse({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request: Request) -> Response:
        return JSONResponse({"type": "session_heartbeat"})

    async def finish_session(self, request: Request) -> Response:
        body = await json_body(request)
        reason = body.get("reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind not in ("success", "errored", "interrupted"):
            raise TinkerError(f"reason.type must be success, errored or interrupted, got {kind!r}")
        detail = body.get("detail")
        await call(self.service.finish_session, request.path_params["session_id"], kind, detail)
        return JSONResponse(None)

    async def telemetry(self, request: Request) -> Response:
        return JSONResponse({"status": "accepted"})  # the SDK's own diagnostics; nothing here reads them

    async def capabilities(self, request: Request) -> Response:
        return JSONResponse(await call(self.service.capabilities))

    # ---- models

    async def create_model(self, request: Request) -> Response:
        body = await json_body(request)
        session_id = require_str(body, "session_id")
        base_model = require_str(body, "base_model")
        lora_config, user_metadata, seq = body.get("lora_config"), body.get("user_metadata"), body.get("model_seq_id")
        if lora_config is not None and not isinstance(lora_config, dict):
            raise RequestRefused("lora_config must be an object: {rank, seed, train_unembed, train_mlp, train_attn}")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestRefused(f"optimizer_config.type {optimizer!r}: this server trains with adamw only")

        def run():
            model_id = self.service.create_model(session_id, base_model, lora_config, user_metadata)
            self.register_model(model_id, session_id, seq, user_metadata)
            return {"type": "create_model", "model_id": model_id}

        return self.future(self.futures.train, run)

    async def get_info(self, request: Request) -> Response:
        body = await json_body(request)
        model_id = self.model_id(body.get("model_id"))
        info = dict(await call(self.service.get_info, model_id))
        info.setdefault("type", "get_info")
        return JSONResponse(info)

    async def unload_model(self, request: Request) -> Response:
        body = await json_body(request)
        model_id = self.model_id(body.get("model_id"))

        def run():
            self.service.unload_model(model_id)
            with self.lock:
                self.models.pop(model_id, None)
                for alias in [a for a, m in self.aliases.items() if m == model_id]:
                    del self.aliases[alias]
            return {"type": "unload_model", "model_id": model_id}

        return self.future(self.futures.train, run, model_id=model_id)

    # ---- training

    async def forward_backward(self, request: Request) -> Response:
        return await self._forward_backward(request, forward_only=False)

    async def forward(self, request: Request) -> Response:
        return await self._forward_backward(request, forward_only=True)

    async def _forward_backward(self, request: Request, forward_only: bool) -> Response:
        body = await request.body()
        call_ = wire.decode_forward_backward(
            body, request.headers.get("content-type", ""), request.headers.get("content-encoding")
        )
        model_id = self.model_id(call_.model_id)
        only = call_.forward_only or forward_only
        if not call_.data:
            raise RequestRefused("forward_backward: no datums in the request")

        def run():
            return self.service.forward_backward(model_id, call_.data, call_.loss_fn, call_.loss_fn_config, only)

        return self.future(self.futures.train, run, forward_result, model_id=model_id)

    async def optim_step(self, request: Request) -> Response:
        body = await json_body(request)
        model_id = self.model_id(body.get("model_id"))
        params = body.get("adam_params", body.get("optim_params"))
        if params is None and isinstance(body.get("optimizer_params"), dict):
            raise RequestRefused(
                f"optimizer_params of type {body['optimizer_params'].get('type')!r}: this server steps with adam_params"
            )
        if not isinstance(params, dict):
            raise RequestRefused("optim_step needs adam_params: {learning_rate, beta1, beta2, eps, weight_decay, ...}")
        params = {k: v for k, v in params.items() if k != "type"}

        def run():
            out = self.service.optim_step(model_id, params)
            return {"type": "optim_step", "metrics": optim_metrics(out)}

        return self.future(self.futures.train, run, model_id=model_id)

    # ---- weights

    async def save_weights(self, request: Request) -> Response:
        body = await json_body(request)
        model_id = self.model_id(body.get("model_id"))
        name = optional_str(body, "path")

        def run():
            return {"type": "save_weights", "path": self.service.save_state(model_id, name)}

        return self.future(self.futures.train, run, model_id=model_id)

    async def save_weights_for_sampler(self, request: Request) -> Response:
        body = await json_body(request)
        model_id = self.model_id(body.get("model_id"))
        name = optional_str(body, "path")
        with self.lock:
            session_id = self.models[model_id]["session_id"]

        def run():
            path = self.service.save_for_sampler(model_id, name)
            out = {"type": "save_weights_for_sampler", "path": path}
            if name is None:
                # save_weights_and_get_sampling_client: the SDK wants a sampler on the snapshot
                out["sampling_session_id"] = self.service.create_sampling_session(session_id, path, None)
            return out

        return self.future(self.futures.train, run, model_id=model_id)

    async def load_weights(self, request: Request) -> Response:
        body = await json_body(request)
        path = require_str(body, "path")
        optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is not None:
            model_id = self.model_id(body.get("model_id"))

            def load_into():
                self.service.load_state(model_id, path, optimizer)
                return {"type": "load_weights", "path": path, "model_id": model_id}

            return self.future(self.futures.train, load_into, model_id=model_id)
        # create-via-load: the model's first request, addressed by (session_id, model_seq_id)
        session_id = require_str(body, "session_id")
        seq, user_metadata = body.get("model_seq_id"), body.get("user_metadata")
        if not isinstance(seq, int):
            raise RequestRefused("load_weights needs model_id, or session_id with model_seq_id")
        alias = f"{session_id}:train:{seq}"

        def create_from():
            model_id = self.service.create_model_from_state(session_id, path, optimizer)
            self.register_model(model_id, session_id, seq, user_metadata)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return self.future(self.futures.train, create_from, model_id=alias)

    # ---- sampling

    async def create_sampling_session(self, request: Request) -> Response:
        body = await json_body(request)
        session_id = require_str(body, "session_id")
        model_path, base_model = optional_str(body, "model_path"), optional_str(body, "base_model")
        if model_path is None and base_model is None:
            raise RequestRefused("create_sampling_session needs model_path (a tinker:// sampler path) or base_model")
        sid = await call(self.service.create_sampling_session, session_id, model_path, base_model)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, request: Request) -> Response:
        return JSONResponse(await call(self.service.sampler_info, request.path_params["sampler_id"]))

    async def asample(self, request: Request) -> Response:
        body = await json_body(request)
        prompt = wire.decode_model_input_json(body.get("prompt"))
        num_samples = body.get("num_samples", 1)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise RequestRefused(f"num_samples must be a positive integer, got {num_samples!r}")
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise RequestRefused("asample needs sampling_params: {max_tokens, temperature, top_k, top_p, stop, seed}")
        for name, off in UNSUPPORTED_SAMPLE_FIELDS.items():
            if body.get(name, off) not in (off, None, False):
                raise RequestRefused(f"asample: {name} is not supported by this server")
        session = optional_str(body, "sampling_session_id")
        model_path, base_model = optional_str(body, "model_path"), optional_str(body, "base_model")
        if session is None and model_path is None and base_model is None:
            raise RequestRefused("asample needs sampling_session_id, model_path or base_model")
        want_prompt_logprobs = bool(body.get("prompt_logprobs"))
        topk = body.get("topk_prompt_logprobs") or 0
        last_n = body.get("prompt_logprobs_last_n")
        if not isinstance(topk, int) or topk < 0:
            raise RequestRefused(f"topk_prompt_logprobs must be a non-negative integer, got {topk!r}")
        if last_n is not None and (not isinstance(last_n, int) or not 1 <= last_n <= len(prompt) - 1):
            raise RequestRefused(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1, got {last_n!r}")

        def run():
            result = self.service.sample(
                prompt=prompt,
                num_samples=num_samples,
                sampling_params=params,
                sampling_session_id=session,
                model_path=model_path,
                base_model=base_model,
                prompt_logprobs=want_prompt_logprobs,
                topk_prompt_logprobs=topk,
            )
            if last_n is not None:  # scored on the whole prompt; the earlier entries are not asked for
                result = dict(result)
                for key in ("prompt_logprobs", "topk_prompt_logprobs"):
                    if result.get(key) is not None:
                        rows = list(result[key])
                        result[key] = [None] * (len(rows) - last_n) + rows[len(rows) - last_n :]
            return result

        ids = [f"{session or 'sample'}:{uuid.uuid4().hex[:12]}:{i}" for i in range(num_samples)]
        # each id names one sampled sequence; the SDK stamps them on the response's sequences
        return self.future(self.futures.sample, run, sample_result, sample_sequence_ids=ids)

    # ---- futures

    async def retrieve_future(self, request: Request) -> Response:
        body = await json_body(request)
        request_id = require_str(body, "request_id")
        pending = self.futures.get(request_id)
        if pending is None:
            raise RequestRefused(f"unknown request_id {request_id!r} (never issued here, or its result expired)", 404)
        if not await finished(pending.future, self.poll_wait_s):
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408)
        pending.retrieved = time.monotonic()
        e = pending.future.exception()
        if e is not None:
            _, category, message = classify(e)
            return JSONResponse(error_body(message, category))  # 200: the request failed, not the poll
        proto = wire.PROTOBUF_TYPE in request.headers.get("accept", "")
        try:
            return pending.encode(pending.future.result(), proto)
        except Exception as e:  # a result the codec cannot write is the server's failure, reported as one
            log.error("%s: cannot encode its result: %s\n%s", request_id, e, traceback.format_exc())
            return JSONResponse(error_body(f"the result cannot be encoded: {type(e).__name__}: {e}", "server"))

    # ---- training runs and checkpoints (the SDK's RestClient)

    def training_run(self, model_id: str) -> dict:
        info = self.service.get_info(model_id)
        checkpoints = [checkpoint_json(c) for c in self.service.checkpoints(model_id)]
        with self.lock:
            entry = dict(self.models.get(model_id) or {})

        def last(kind: str):
            mine = [c for c in checkpoints if c["checkpoint_type"] == kind]
            return max(mine, key=lambda c: c["time"]) if mine else None

        return {
            "training_run_id": model_id,
            "base_model": (info.get("model_data") or {}).get("model_name") or info.get("model_name") or "",
            "model_owner": "local",
            "is_lora": bool(info.get("is_lora", True)),
            "corrupted": False,
            "lora_rank": info.get("lora_rank"),
            "last_request_time": iso_time(entry.get("last_request", time.time())),
            "last_checkpoint": last("training"),
            "last_sampler_checkpoint": last("sampler"),
            "user_metadata": {str(k): str(v) for k, v in (entry.get("user_metadata") or {}).items()} or None,
        }

    async def list_training_runs(self, request: Request) -> Response:
        limit, offset = page_params(request, 20)
        with self.lock:
            ids = sorted(self.models, key=lambda m: self.models[m]["created"])
        runs = [await call(self.training_run, m) for m in ids[offset : offset + limit]]
        return JSONResponse(
            {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}
        )

    async def get_training_run(self, request: Request) -> Response:
        model_id = self.model_id(request.path_params["model_id"])
        return JSONResponse(await call(self.training_run, model_id))

    async def list_checkpoints(self, request: Request) -> Response:
        model_id = self.model_id(request.path_params["model_id"])
        checkpoints = await call(self.service.checkpoints, model_id)
        return JSONResponse({"checkpoints": [checkpoint_json(c) for c in checkpoints]})

    async def list_user_checkpoints(self, request: Request) -> Response:
        limit, offset = page_params(request, 100)
        with self.lock:
            ids = list(self.models)
        every = []
        for m in ids:
            every.extend(checkpoint_json(c) for c in await call(self.service.checkpoints, m))
        every.sort(key=lambda c: c["time"], reverse=True)
        return JSONResponse(
            {
                "checkpoints": every[offset : offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
            }
        )

    async def weights_info(self, request: Request) -> Response:
        body = await json_body(request)
        path = require_str(body, "tinker_path")
        if not path.startswith("tinker://") or len(path[len("tinker://") :].split("/")) != 3:
            raise RequestRefused(f"tinker_path {path!r}: expected tinker://<model_id>/<weights|sampler_weights>/<name>")
        model_id = self.model_id(path[len("tinker://") :].split("/")[0])
        info = await call(self.service.get_info, model_id)
        return JSONResponse(
            {
                "base_model": (info.get("model_data") or {}).get("model_name") or info.get("model_name") or "",
                "is_lora": bool(info.get("is_lora", True)),
                "lora_rank": info.get("lora_rank"),
            }
        )


# ------------------------------------------------------------------------ result encoders


def json_result(result: Any, proto: bool) -> Response:
    return JSONResponse(result)


def forward_result(result: Any, proto: bool) -> Response:
    if proto:
        return Response(wire.encode_forward_backward_output(result), media_type=wire.PROTOBUF_TYPE)
    return JSONResponse(wire.forward_backward_output_json(result))


def sample_result(result: dict, proto: bool) -> Response:
    if proto:
        return Response(wire.encode_sample_response(result), media_type=wire.PROTOBUF_TYPE)
    return JSONResponse(wire.sample_response_json(result))


def optim_metrics(out: Any) -> dict[str, float]:
    """OptimStepResponse.metrics: the step's own metrics, plus its step count and gradient norm."""
    if out is None:
        return {}
    metrics = dict(getattr(out, "metrics", None) or {}) if not isinstance(out, dict) else dict(out)
    for name in ("step", "grad_norm"):
        if getattr(out, name, None) is not None:
            metrics.setdefault(name, getattr(out, name))
    clean = {}
    for k, v in metrics.items():
        try:
            clean[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return clean


def checkpoint_json(c: dict) -> dict:
    out = dict(c)
    t = out.get("time")
    if isinstance(t, (int, float)):
        out["time"] = iso_time(t)
    elif isinstance(t, datetime):
        out["time"] = t.isoformat()
    elif t is None:
        out["time"] = iso_time(time.time())
    return out


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


# ------------------------------------------------------------------------ request helpers


async def finished(future: concurrent.futures.Future, timeout: float) -> bool:
    """Whether `future` is done, waiting up to `timeout` seconds without blocking the event loop."""
    if future.done():
        return True
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake(_):
        with contextlib.suppress(RuntimeError):  # the loop may be gone by the time the work ends
            loop.call_soon_threadsafe(event.set)

    future.add_done_callback(wake)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
    return future.done()


async def call(fn, *args, **kwargs):
    """A blocking service call off the event loop (metadata calls; the heavy ones are futures)."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args, **kwargs)


async def json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestRefused(f"{request.url.path}: the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestRefused(f"{request.url.path}: the body must be a JSON object")
    return body


def require_str(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestRefused(f"{name} is missing (a non-empty string)")
    return value


def optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestRefused(f"{name} must be a string")
    return value or None


def page_params(request: Request, default_limit: int) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise RequestRefused("limit and offset must be integers") from None
    return max(0, limit), max(0, offset)


def endpoint(handler):
    """A route handler whose refusals and failures answer with Tinker's error shape."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            status, category, message = classify(e)
            if status >= 500:
                log.error("%s failed: %s\n%s", request.url.path, message, traceback.format_exc())
            return JSONResponse(error_body(message, category), status)

    return run


def make_app(
    service, *, api_key: str | None, poll_wait_s: float = DEFAULT_POLL_WAIT_S, sample_in_own_thread: bool = True
) -> Starlette:
    """Tinker's REST API over `service` (a TinkerService). api_key None serves without auth;
    otherwise every route but healthz wants it in the X-API-Key header."""
    front = TinkerFrontend(service, api_key=api_key, poll_wait_s=poll_wait_s, sample_in_own_thread=sample_in_own_thread)
    f = front
    routes = [
        Route(f"{API}/healthz", endpoint(f.healthz), methods=["GET"]),
        Route(f"{API}/client/config", endpoint(f.client_config), methods=["POST"]),
        Route(f"{API}/client/dynamic_config", endpoint(f.dynamic_config), methods=["POST"]),
        Route(f"{API}/create_session", endpoint(f.create_session), methods=["POST"]),
        Route(f"{API}/session_heartbeat", endpoint(f.heartbeat), methods=["POST"]),
        Route(f"{API}/sessions/{{session_id}}/finish", endpoint(f.finish_session), methods=["POST"]),
        Route(f"{API}/telemetry", endpoint(f.telemetry), methods=["POST"]),
        Route(f"{API}/get_server_capabilities", endpoint(f.capabilities), methods=["GET"]),
        Route(f"{API}/create_model", endpoint(f.create_model), methods=["POST"]),
        Route(f"{API}/get_info", endpoint(f.get_info), methods=["POST"]),
        Route(f"{API}/unload_model", endpoint(f.unload_model), methods=["POST"]),
        Route(f"{API}/forward", endpoint(f.forward), methods=["POST"]),
        Route(f"{API}/forward_backward", endpoint(f.forward_backward), methods=["POST"]),
        Route(f"{API}/optim_step", endpoint(f.optim_step), methods=["POST"]),
        Route(f"{API}/save_weights", endpoint(f.save_weights), methods=["POST"]),
        Route(f"{API}/save_weights_for_sampler", endpoint(f.save_weights_for_sampler), methods=["POST"]),
        Route(f"{API}/load_weights", endpoint(f.load_weights), methods=["POST"]),
        Route(f"{API}/create_sampling_session", endpoint(f.create_sampling_session), methods=["POST"]),
        Route(f"{API}/samplers/{{sampler_id}}", endpoint(f.get_sampler), methods=["GET"]),
        Route(f"{API}/asample", endpoint(f.asample), methods=["POST"]),
        Route(f"{API}/retrieve_future", endpoint(f.retrieve_future), methods=["POST"]),
        Route(f"{API}/training_runs", endpoint(f.list_training_runs), methods=["GET"]),
        Route(f"{API}/training_runs/{{model_id}}", endpoint(f.get_training_run), methods=["GET"]),
        Route(f"{API}/training_runs/{{model_id}}/checkpoints", endpoint(f.list_checkpoints), methods=["GET"]),
        Route(f"{API}/checkpoints", endpoint(f.list_user_checkpoints), methods=["GET"]),
        Route(f"{API}/weights_info", endpoint(f.weights_info), methods=["POST"]),
    ]

    async def not_found(request: Request, exc: HTTPException) -> Response:
        message = (
            f"{request.method} {request.url.path}: not a route of this server"
            if exc.status_code in (404, 405)
            else exc.detail
        )
        return JSONResponse(error_body(message, "user"), exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        front.futures.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.front = front

    if api_key is not None:
        expected = api_key.encode()

        class RequireKey:
            """Every path but the open ones needs X-API-Key == api_key (compared in constant time)."""

            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
                    given = dict(scope["headers"]).get(b"x-api-key", b"")
                    if not hmac.compare_digest(given, expected):
                        why = "missing X-API-Key header" if not given else "wrong API key"
                        response = JSONResponse(error_body(f"unauthorized: {why}", "user"), 401)
                        await response(scope, receive, send)
                        return
                await self.inner(scope, receive, send)

        app.add_middleware(RequireKey)
    return app
