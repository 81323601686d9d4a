"""Dispatch of a FleetEngine: each request to a worker in service (or the router), exactly once.

    dispatch = FleetDispatch(state, health, eos_token_ids=(2,), seed=0)
    future = dispatch.submit(GenerateRequest(prompt_ids, SamplingParams(n=8), rid="task-3"))
    dispatch.abort("task-3")

Requests. Each one is a native `/generate` with `input_ids`, `return_logprob`, its own `rid`
and SGLang's sampling names (`shared/reference/sglang_api.md`); the answer is parsed by
`sglang_wire.sample_from_item`: tokens, the `[logprob, token_id, text]` triples (ptrain.serve
and SGLang both give the log-prob under the tempered full-vocabulary softmax, the trainer's
number; SGLang reports one log-prob a token, so `sampling_logprobs` equals `logprobs`),
`finish_reason`, `weight_version`, cached tokens. A request without `sampling_seed` gets one
from this engine's seeded generator, so a re-issued request samples what the first would have.
A request's `lora_path` (else the engine's default adapter) goes as SGLang's `lora_path`; an
adapter the fleet pushed (`update_lora`) is named by its current version's name on the workers,
and its samples report that adapter version as their weight_version.
The model's end-of-sequence ids (`eos_token_ids`) join each request's stop_token_ids unless it
sets ignore_eos, as LocalEngine stops on them. A thinking budget also goes as the top-level
`max_thinking_tokens`, which SGLang enforces (with --enable-strict-thinking) or refuses, where
`custom_params.thinking_budget` alone would be ignored. `on_update`, if given, is called once with the
finished samples (the client does not stream).

Routing. Without a router the client spreads requests itself: each goes to the worker in
service with the fewest requests outstanding (ties in turn), at most `per_worker_concurrency`
each. With a router, requests go to the router, which picks the worker; aborts and weight
updates go to every worker directly (the router answers 404 to /abort_request).

Exactly once. A request lost to a dead worker (connection refused or reset), a hung one (no
answer within `request_timeout_s`) or a failing one (5xx) is abandoned (aborted on its worker,
its connection closed, so no late answer can arrive), and re-issued on another worker with a
new wire rid `<rid>#<attempt>`; its future resolves exactly once, from the one attempt that
answered. An answer the caller aborted (`abort`, a weight update with mode abort) is a result:
finish_reason abort with the partial tokens, as from LocalEngine. Other 4xx answers are the
request's own fault: RequestError with the server's message. After `max_retries` re-issues the
future fails with RequestFailed, naming every attempt's answer. The worker a request failed on
goes to FleetHealth (`request_failed`), which takes it out of service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.fleet_health import FleetHealth
from ptrain.rollout.fleet_state import EngineClosed, FleetState, Worker
from ptrain.rollout.protocol import FinishReason, GenerateRequest, RequestError, Sample, SamplingParams
from ptrain.rollout.weight_sync import answer_text, describe_error

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


class RequestFailed(RuntimeError):
    """A request that failed on `max_retries` + 1 workers while the fleet was up."""


@dataclasses.dataclass(eq=False)
class Call:
    """One submitted request: its future, and where its attempts went and what they answered."""

    request: GenerateRequest
    sampling: SamplingParams
    future: concurrent.futures.Future
    on_update: Callable[[list[Sample]], None] | None
    submit_time: float
    attempt: int = 0
    wire_rid: str | None = None
    target: Worker | None = None
    tried: set[str] = dataclasses.field(default_factory=set)
    answers: list[str] = dataclasses.field(default_factory=list)
    aborted: str | None = None
    task: asyncio.Task | None = None
    lora: str | None = None
    """The adapter name the current attempt went out with (a pushed adapter's versioned name)."""
    lora_version: str | None = None
    """That adapter's fleet version, when it is one the fleet pushed (its samples report it)."""

    @property
    def rid(self) -> str:
        return self.request.rid


class FleetDispatch:
    """The requests in flight and their attempts (module docstring). `submit`, `abort` and `load`
    are called from the caller's thread; `calls` is guarded by `lock`, everything else runs on
    the state's loop."""

    def __init__(self, state: FleetState, health: FleetHealth, *, eos_token_ids: Sequence[int] = (), seed: int = 0):
        self.state = state
        self.health = health
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.calls: dict[str, Call] = {}
        self.lock = threading.Lock()
        self._seeds = np.random.default_rng(seed)
        self._rr = 0

    # ------------------------------------------------------------------ caller's thread

    def submit(self, request: GenerateRequest, on_update=None) -> concurrent.futures.Future:
        """Queue a request (RolloutEngine.submit). RequestError for a malformed request or a rid
        already in flight; FleetUnavailable while no worker has been healthy for too long."""
        if not isinstance(request, GenerateRequest):
            raise RequestError(f"submit takes a GenerateRequest, got {type(request).__name__}")
        if len(request.input_ids) == 0:
            raise RequestError("input_ids: the prompt is empty; send at least one token")
        request.sampling.validate()
        if not request.rid:
            request = dataclasses.replace(request, rid=uuid.uuid4().hex)
        if self.state.closed:
            raise EngineClosed("the fleet engine is closed")
        if self.state.unavailable is not None:
            raise self.state.unavailable
        sp = request.sampling
        with self.lock:
            seed = sp.sampling_seed if sp.sampling_seed is not None else int(self._seeds.integers(0, 2**31 - 1))
            stops = tuple(sp.stop_token_ids)
            if not sp.ignore_eos:
                stops += tuple(i for i in self.eos_token_ids if i not in stops)
            future: concurrent.futures.Future = concurrent.futures.Future()
            call = Call(request, dataclasses.replace(sp, sampling_seed=seed, stop_token_ids=stops), future, on_update,
                        time.time())  # fmt: skip
            if request.rid in self.calls:
                raise RequestError(f"rid {request.rid!r} is already in flight; give each request its own rid")
            self.calls[request.rid] = call
            self.state.stats["requests"] += 1
        self.state.loop.call_soon_threadsafe(self._start_call, call)
        return future

    def abort(self, rid: str | None = None) -> int:
        """End request `rid` (every sample), sample `rid-j`, or every request when None, with
        finish_reason abort and the tokens made so far (none for one not yet sent). Returns
        the number of samples asked to end; the futures resolve when the workers answer.
        abort() with no rid sends abort_all to every worker (the fleet serves this trainer)."""
        sample = None
        with self.lock:
            if rid is None:
                calls = list(self.calls.values())
            elif rid in self.calls:
                calls = [self.calls[rid]]
            else:
                base, _, j = rid.rpartition("-")
                call = self.calls.get(base)
                ok = call is not None and j.isdigit() and int(j) < call.sampling.n
                calls, sample = ([call], int(j)) if ok else ([], None)
        if calls or rid is None:
            self.state.loop.call_soon_threadsafe(
                lambda: self.state.spawn(self._abort_calls(calls, sample, every=rid is None))
            )
        return sum(1 if sample is not None else c.sampling.n for c in calls)

    def load(self) -> dict[str, int]:
        """Requests on the workers ("running") and waiting for a worker ("queued")."""
        with self.lock:
            calls = list(self.calls.values())
        running = sum(1 for c in calls if c.target is not None)
        return {"running": running, "queued": len(calls) - running}

    def fail_all(self) -> None:
        """Cancel every request in flight; their futures fail with EngineClosed (closing)."""
        with self.lock:  # out of flight first, as in _retire
            calls = list(self.calls.values())
            self.calls.clear()
        for c in calls:
            if c.task is not None:
                c.task.cancel()
            if not c.future.done():
                c.future.set_exception(EngineClosed("the fleet engine was closed before the request finished"))

    # ------------------------------------------------------------------ on the loop

    def _start_call(self, call: Call) -> None:
        call.task = self.state.spawn(self._run_call(call))

    def _choose(self, call: Call) -> Worker | None:
        s = self.state
        service = s.in_service()
        if not service:
            return None
        limit = s.settings.per_worker_concurrency
        if s.router is not None:
            room = s.router.outstanding < limit * len(service)
            return s.router if room else None
        room = [w for w in service if w.outstanding < limit]
        fresh = [w for w in room if w.url not in call.tried] or room
        if not fresh:
            return None
        self._rr += 1
        least = min(w.outstanding for w in fresh)
        ties = [w for w in fresh if w.outstanding == least]
        return ties[self._rr % len(ties)]

    async def _acquire(self, call: Call) -> Worker | None:
        s = self.state
        async with s.cond:
            while True:
                if s.closed:
                    raise EngineClosed("the fleet engine is closed")
                if call.aborted:
                    return None
                target = self._choose(call)
                if target is not None:
                    target.outstanding += 1
                    call.target = target
                    return target
                if s.unavailable is not None:
                    raise s.unavailable
                await s.cond.wait()

    def _resolve_lora(self, call: Call) -> None:
        """The adapter this attempt samples with: the request's lora_path, else the default; a
        name the fleet pushed (update_lora) goes out as its current version's served name,
        resolved per attempt so a re-issued request uses the version current then."""
        s = self.state
        name = call.request.lora_path if call.request.lora_path is not None else s.default_lora
        current = s.loras.get(name) if name is not None else None
        call.lora = current.served if current is not None else name
        call.lora_version = current.version if current is not None else None

    def _body(self, call: Call) -> dict[str, Any]:
        body = {
            "input_ids": list(call.request.input_ids),
            "sampling_params": call.sampling.to_dict(),
            "return_logprob": True,
            "rid": call.wire_rid,
        }
        if call.request.return_prompt_logprobs_from is not None:
            body["logprob_start_len"] = call.request.return_prompt_logprobs_from
        if call.request.top_logprobs_num:
            body["top_logprobs_num"] = call.request.top_logprobs_num
        if call.sampling.thinking_budget is not None:
            body["max_thinking_tokens"] = call.sampling.thinking_budget
        if call.lora is not None:
            body["lora_path"] = call.lora
        return body

    def _samples(self, call: Call, answer: Any) -> list[Sample]:
        items = answer if isinstance(answer, list) else [answer]
        n = call.sampling.n
        if len(items) != n:
            raise ValueError(f"{len(items)} response objects for n={n}")
        out = []
        for j, item in enumerate(items):
            s = wire.sample_from_item(item, call.request.input_ids, index=j)
            if call.lora_version is not None:
                # The worker reports its base weights' version; the policy is the adapter's,
                # which cannot change during a request.
                v = call.lora_version
                spans = tuple(dataclasses.replace(w, version=v) for w in s.weight_versions)
                s = dataclasses.replace(s, weight_version=v, weight_versions=spans)
            out.append(dataclasses.replace(s, rid=call.rid, e2e_latency_s=time.time() - call.submit_time))
        return out

    def _aborted_samples(self, call: Call) -> list[Sample]:
        reason = FinishReason("abort", message=call.aborted or "aborted")
        return [
            Sample(call.rid, j, call.request.input_ids, (), (), (), reason, self.state.weight_version)
            for j in range(call.sampling.n)
        ]

    def _retire(self, call: Call) -> None:
        """Take `call` out of the requests in flight. Before its future resolves: whoever waits on
        it may send its rid again at once (an environment reuses a task's rid once the task's
        earlier request has ended), and that must not be refused as still in flight."""
        with self.lock:
            if self.calls.get(call.rid) is call:
                del self.calls[call.rid]

    async def _run_call(self, call: Call) -> None:
        try:
            samples = await self._attempts(call)
        except asyncio.CancelledError:
            self._retire(call)
            if not call.future.done():
                call.future.set_exception(EngineClosed("the fleet engine was closed before the request finished"))
            raise
        except BaseException as e:
            self._retire(call)
            if not call.future.done():
                call.future.set_exception(e)
        else:
            self._retire(call)
            if call.on_update is not None:
                try:
                    call.on_update(samples)
                except Exception:  # a caller's callback must not stop the client
                    log.exception("on_update callback of request %s raised", call.rid)
            if not call.future.done():
                call.future.set_result(samples)

    async def _attempts(self, call: Call) -> list[Sample]:
        import httpx

        s = self.state
        timeout_s = s.settings.request_timeout_s
        while True:
            target = await self._acquire(call)
            if target is None:
                return self._aborted_samples(call)
            call.attempt += 1
            call.wire_rid = f"{call.rid}#{call.attempt}"
            call.tried.add(target.url)
            blame = True
            self._resolve_lora(call)
            lora = call.lora
            if lora is not None:  # an adapter version is unloaded only once none of these is left
                s.lora_inflight[lora] = s.lora_inflight.get(lora, 0) + 1
            try:
                r = await asyncio.wait_for(
                    s.client.post(target.url + "/generate", json=self._body(call)), timeout_s + 5
                )
            except (TimeoutError, httpx.HTTPError) as e:
                failure = f"POST /generate: {describe_error(e, timeout_s)}"
                if isinstance(e, TimeoutError):
                    failure = f"POST /generate: no answer within {timeout_s:g} s"
            else:
                if r.status_code == 200:
                    try:
                        samples = self._samples(call, r.json())
                    except (ValueError, KeyError, TypeError, AttributeError) as e:  # e.g. "meta_info": null
                        failure = f"POST /generate: a malformed answer ({e})"
                    else:
                        target.served += 1
                        return samples
                elif 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    raise RequestError(f"{target.url}/generate: {answer_text(r)}")
                else:
                    failure = f"POST /generate: {answer_text(r)}"
                    blame = r.status_code != 429
            finally:
                target.outstanding -= 1
                call.target = None
                if lora is not None:
                    s.lora_inflight[lora] -= 1
                    if not s.lora_inflight[lora]:
                        del s.lora_inflight[lora]
                await s.notify()
            call.answers.append(f"{target.url}: {failure}")
            if call.aborted:
                return self._aborted_samples(call)
            s.spawn(self._abandon(call.wire_rid, target))
            if blame:
                await self.health.request_failed(target, failure)
            max_retries = s.settings.max_retries
            if call.attempt > max_retries:
                raise RequestFailed(
                    f"request {call.rid!r} failed on {call.attempt} attempts ({'; '.join(call.answers)}); "
                    f"rollout.max_retries={max_retries}"
                )
            s.stats["retries"] += 1
            log.info("re-issuing %s after %s", call.rid, call.answers[-1])
            backoff = s.settings.retry_backoff_s * 2 ** (call.attempt - 1)
            await asyncio.sleep(min(backoff, s.settings.probe_backoff_max_s))

    def _worker_urls(self, target: Worker) -> list[str]:
        """Where a request sent to `target` may run: the worker, or through the router any worker."""
        return [target.url] if target is not self.state.router else [w.url for w in self.state.workers.values()]

    async def _abandon(self, wire_rid: str, target: Worker) -> None:
        """Abort an abandoned attempt where it may still run, so it frees its slots."""
        self.state.stats["abandoned"] += 1
        await self._post_aborts(self._worker_urls(target), {"rid": wire_rid})

    async def _post_aborts(self, urls: Sequence[str], body: dict) -> None:
        import httpx

        async def one(url: str) -> None:
            try:
                await self.state.control.post(url + "/abort_request", json=body, timeout=ABORT_TIMEOUT_S)
            except httpx.HTTPError as e:
                log.debug("%s/abort_request %s: %s", url, body, describe_error(e))

        await asyncio.gather(*(one(u) for u in urls))

    async def _abort_calls(self, calls: list[Call], sample: int | None, *, every: bool) -> None:
        message = "aborted by request"
        if sample is None:
            for c in calls:
                c.aborted = message
        await self.state.notify()  # the ones still waiting for a worker end now
        if every:
            await self._post_aborts([w.url for w in self.state.workers.values()], {"rid": "", "abort_all": True})
            return
        for c in calls:
            target = c.target
            if target is None or c.wire_rid is None:
                continue
            rid = c.wire_rid if sample is None else f"{c.wire_rid}-{sample}"
            await self._post_aborts(self._worker_urls(target), {"rid": rid})
