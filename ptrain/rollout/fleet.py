"""FleetEngine: the rollout protocol over an SGLang fleet (`rollout=sglang`).

    engine = FleetEngine(router_url="http://127.0.0.1:30000", model_cfg=cfg, weight_dir="runs/x/weights")
    future = engine.submit(GenerateRequest(prompt_ids, SamplingParams(n=8), rid="task-3"))
    engine.update_weights(params, model_state, weight_version="12", mode="drain")

The workers are SGLang servers (`python -m sglang.launch_server`) or `python -m ptrain.serve`,
listed in `urls`, or found behind an sglang-router (`router_url`, its GET /workers). An asyncio
loop on a background thread drives them with one httpx.AsyncClient; `submit` only queues.

Requests. Each one is a native `/generate` with `input_ids`, `return_logprob`, its own `rid`
and SGLang's sampling names (`shared/reference/sglang_api.md`); the answer is parsed by
`sglang_wire.sample_from_item`: tokens, the `[logprob, token_id, text]` triples (ptrain.serve
and SGLang both give the log-prob under the tempered full-vocabulary softmax, the trainer's
number; SGLang reports one log-prob a token, so `sampling_logprobs` equals `logprobs`),
`finish_reason`, `weight_version`, cached tokens. A request without `sampling_seed` gets one
from this engine's seeded generator, so a re-issued request samples what the first would have.
The model's end-of-sequence ids (`eos_token_ids`) join each request's stop_token_ids unless it
sets ignore_eos, as LocalEngine stops on them. `on_update`, if given, is called once with the
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
future fails with RequestFailed, naming every attempt's answer.

Health. Every worker in service is polled with /health_generate every `health_interval_s`; one
that answers it with an error, leaves it unanswered twice in a row (a worker compiling a
program for a new shape can stall one probe), or fails a request, is taken out (and, with
`manage_router_workers`, removed from the router), then probed with exponential backoff from `probe_backoff_s` to
`probe_backoff_max_s`. A worker that answers again is brought to the current weight version
(an update from the current export folder, checked in /model_info) before it serves again.
When no worker has been in service for `unhealthy_timeout_s`, waiting requests fail with
FleetUnavailable, which names every URL and its last answer, and so does `submit` until a worker
is back.

Weights (`update_weights`). The new params are exported to `<weight_dir>/v<version>/` (bf16 or
fp32 safetensors, manifest, atomic rename: `ptrain.rollout.weight_sync`), every worker in
service loads it with /update_weights_from_disk at once (mode drain, abort, or pause = pause
in place, update, continue), and must report the version in /model_info; one that fails after
`weight_push_retries` is taken out until it is brought to the version. Old versions beyond
`keep_weight_versions` are deleted. A worker that refuses the folder (HTTP 400: another model)
is an error for the caller (WeightSyncError), not a retry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import (
    SWAP_MODES,
    EngineBase,
    EngineUnavailable,
    FinishReason,
    GenerateRequest,
    RequestError,
    Sample,
    SamplingParams,
)
from ptrain.rollout.weight_sync import (
    WeightSyncError,
    answer_text,
    describe_error,
    export_weights,
    prune_versions,
    push_to_worker,
    push_to_workers,
    worker_version,
)

log = logging.getLogger(__name__)

PUSH_FOR_SWAP = {"drain": "drain", "abort": "abort", "in_place": "pause"}
"""The fleet's way to do each of LocalEngine's swap modes (weight_push_mode "stage")."""
ABORT_TIMEOUT_S = 5.0
SLOW_PROBES_TO_FAIL = 2
"""A worker in service leaves it after this many health probes in a row without an answer
(one that compiles a program for a new shape can stall that long once); a probe answered
with an error, or a failed request, takes it out at once."""


class FleetUnavailable(EngineUnavailable):
    """No worker of the fleet has been healthy for `unhealthy_timeout_s`. `answers` maps every
    URL (workers, and the router if there is one) to its last answer. A stage that gets it
    saves a resumable checkpoint and stops with this message."""

    def __init__(self, answers: Mapping[str, str], seconds: float):
        self.answers = dict(answers)
        self.seconds = seconds
        lines = "; ".join(f"{url}: {why}" for url, why in self.answers.items()) or "no workers are known"
        super().__init__(
            f"no healthy SGLang worker for {seconds:.0f} s ({lines}); start or fix the workers "
            "(tools/launch_fleet.py), then resume the run"
        )


class RequestFailed(RuntimeError):
    """A request that failed on `max_retries` + 1 workers while the fleet was up."""


class EngineClosed(RuntimeError):
    """The engine was closed before the request finished."""


@dataclasses.dataclass(eq=False)
class _Worker:
    url: str
    in_service: bool = False
    outstanding: int = 0
    version: str | None = None
    error: str | None = "not probed yet"
    backoff: float = 1.0
    served: int = 0
    failures: int = 0
    slow_probes: int = 0
    wake: asyncio.Event | None = None


@dataclasses.dataclass(eq=False)
class _Call:
    request: GenerateRequest
    sampling: SamplingParams
    future: concurrent.futures.Future
    on_update: Callable[[list[Sample]], None] | None
    submit_time: float
    attempt: int = 0
    wire_rid: str | None = None
    target: _Worker | None = None
    tried: set[str] = dataclasses.field(default_factory=set)
    answers: list[str] = dataclasses.field(default_factory=list)
    aborted: str | None = None
    task: asyncio.Task | None = None

    @property
    def rid(self) -> str:
        return self.request.rid


class FleetEngine(EngineBase):
    """The rollout protocol over SGLang workers, with or without an sglang-router (module docstring).

    model_cfg: the trained model's ModelConfig (exports need it; None: no update_weights).
    weight_dir: where versions are exported (every worker must read the same path).
    eos_token_ids: ids that end a sample unless it sets ignore_eos (the stage's stop ids).
    extra_config: keys for each export's config.json (e.g. eos_token_id).
    The other arguments are the `rollout.*` fields of the same names (RolloutConfig).
    """

    def __init__(
        self,
        *,
        urls: Sequence[str] = (),
        router_url: str | None = None,
        model_cfg=None,
        weight_dir: str | None = None,
        eos_token_ids: Sequence[int] = (),
        extra_config: Mapping[str, Any] | None = None,
        seed: int = 0,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        unhealthy_timeout_s: float = 120.0,
        max_retries: int = 5,
        retry_backoff_s: float = 0.5,
        per_worker_concurrency: int = 64,
        health_interval_s: float = 10.0,
        health_timeout_s: float = 20.0,
        probe_backoff_s: float = 1.0,
        probe_backoff_max_s: float = 30.0,
        manage_router_workers: bool = True,
        weight_dtype: str = "bfloat16",
        keep_weight_versions: int = 2,
        weight_push_mode: str = "stage",
        weight_push_timeout_s: float = 600.0,
        weight_push_retries: int = 2,
        export_writers: int = 2,
        weight_checksums: bool = True,
    ):
        if not urls and not router_url:
            raise ValueError("FleetEngine needs worker urls or a router_url")
        self.router_url = router_url.rstrip("/") if router_url else None
        self.model_cfg = model_cfg
        self.weight_dir = weight_dir
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.extra_config = dict(extra_config or {})
        self.request_timeout_s = float(request_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.unhealthy_timeout_s = float(unhealthy_timeout_s)
        self.max_retries = int(max_retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self.per_worker_concurrency = int(per_worker_concurrency)
        self.health_interval_s = float(health_interval_s)
        self.health_timeout_s = float(health_timeout_s)
        self.probe_backoff_s = float(probe_backoff_s)
        self.probe_backoff_max_s = float(probe_backoff_max_s)
        self.manage_router_workers = bool(manage_router_workers)
        self.weight_dtype = weight_dtype
        self.keep_weight_versions = int(keep_weight_versions)
        if weight_push_mode not in ("stage", *PUSH_FOR_SWAP.values()):
            raise ValueError(f"weight_push_mode={weight_push_mode!r}: pass stage, drain, abort or pause")
        self.weight_push_mode = weight_push_mode
        self.weight_push_timeout_s = float(weight_push_timeout_s)
        self.weight_push_retries = int(weight_push_retries)
        self.export_writers = int(export_writers)
        self.weight_checksums = bool(weight_checksums)

        self._fixed_urls = bool(urls)
        self._workers: dict[str, _Worker] = {}
        for u in urls:
            self._workers[u.rstrip("/")] = _Worker(u.rstrip("/"), backoff=self.probe_backoff_s)
        self._router = _Worker(self.router_url, in_service=True, error=None) if self.router_url else None
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._seeds = np.random.default_rng(seed)
        self._weight_version = "default"
        self._target: tuple[str, str] | None = None  # (version, folder) every worker must serve
        self._updates = 0
        self._closed = False
        self._no_service_since: float | None = time.monotonic()
        self._unavailable: FleetUnavailable | None = None
        self._rr = 0
        self._monitoring = False
        self.stats = {"requests": 0, "retries": 0, "abandoned": 0, "taken_out": 0, "brought_back": 0,
                      "pushes": 0, "failed_pushes": 0}  # fmt: skip
        self.last_push: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ptrain-fleet", daemon=True)
        self._thread.start()
        try:
            self._call_in_loop(self._start(), timeout=self.health_timeout_s + 2 * self.connect_timeout_s + 30)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, ro, *, model_cfg=None, weight_dir: str | None = None, eos_token_ids=(), seed: int = 0,
                    extra_config=None) -> FleetEngine:  # fmt: skip
        """From a RolloutConfig (`rollout.*`); weight_dir: the folder to export into (default
        rollout.weight_dir itself; make_engine passes the stage's own folder under it)."""
        names = (
            "request_timeout_s", "connect_timeout_s", "unhealthy_timeout_s", "max_retries", "retry_backoff_s",
            "per_worker_concurrency", "health_interval_s", "health_timeout_s", "probe_backoff_s",
            "probe_backoff_max_s", "manage_router_workers", "weight_dtype", "keep_weight_versions",
            "weight_push_mode", "weight_push_timeout_s", "weight_push_retries", "export_writers", "weight_checksums",
        )  # fmt: skip
        return cls(
            urls=list(ro.urls), router_url=ro.router_url, model_cfg=model_cfg,
            weight_dir=weight_dir or ro.weight_dir, eos_token_ids=eos_token_ids, seed=seed,
            extra_config=extra_config, **{k: getattr(ro, k) for k in names},
        )  # fmt: skip

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> str:
        return self._weight_version

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
        if self._closed:
            raise EngineClosed("the fleet engine is closed")
        if self._unavailable is not None:
            raise self._unavailable
        sp = request.sampling
        with self._lock:
            seed = sp.sampling_seed if sp.sampling_seed is not None else int(self._seeds.integers(0, 2**31 - 1))
            stops = tuple(sp.stop_token_ids)
            if not sp.ignore_eos:
                stops += tuple(i for i in self.eos_token_ids if i not in stops)
            future: concurrent.futures.Future = concurrent.futures.Future()
            call = _Call(request, dataclasses.replace(sp, sampling_seed=seed, stop_token_ids=stops), future, on_update,
                         time.time())  # fmt: skip
            if request.rid in self._calls:
                raise RequestError(f"rid {request.rid!r} is already in flight; give each request its own rid")
            self._calls[request.rid] = call
            self.stats["requests"] += 1
        self._loop.call_soon_threadsafe(self._start_call, call)
        return future

    def abort(self, rid: str | None = None) -> int:
        """End request `rid` (every sample), sample `rid-j`, or every request when None, with
        finish_reason abort and the tokens made so far (none for one not yet sent). Returns
        the number of samples asked to end; the futures resolve when the workers answer.
        abort() with no rid sends abort_all to every worker (the fleet serves this trainer)."""
        sample = None
        with self._lock:
            if rid is None:
                calls = list(self._calls.values())
            elif rid in self._calls:
                calls = [self._calls[rid]]
            else:
                base, _, j = rid.rpartition("-")
                call = self._calls.get(base)
                ok = call is not None and j.isdigit() and int(j) < call.sampling.n
                calls, sample = ([call], int(j)) if ok else ([], None)
        if calls or rid is None:
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._abort_calls(calls, sample, every=rid is None)))
        return sum(1 if sample is not None else c.sampling.n for c in calls)

    def update_weights(self, params, model_state=None, *, weight_version: str | None = None,
                       mode: str = "drain") -> str:  # fmt: skip
        """Export `params` (pure dicts, as TrainState.params) to `<weight_dir>/v<version>/`
        and load them on every worker (module docstring); blocks until every worker in service
        reports the version. mode: drain | abort | in_place (LocalEngine's names; the fleet
        does in_place as pause/update/continue), unless rollout.weight_push_mode fixes one.
        WeightSyncError when a worker refuses the folder; FleetUnavailable when no worker is
        left to serve it. Returns the version."""
        if mode not in SWAP_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {SWAP_MODES}")
        if self.model_cfg is None or self.weight_dir is None:
            raise WeightSyncError("this FleetEngine was built without model_cfg and weight_dir; it cannot export")
        version = str(weight_version) if weight_version is not None else str(self._updates + 1)
        push_mode = PUSH_FOR_SWAP[mode] if self.weight_push_mode == "stage" else self.weight_push_mode
        t0 = time.perf_counter()
        export = export_weights(
            self.model_cfg, params, model_state, self.weight_dir, version, dtype=self.weight_dtype,
            writers=self.export_writers, extra_config=self.extra_config, checksums=self.weight_checksums,
        )  # fmt: skip
        t1 = time.perf_counter()
        timeout = (self.weight_push_timeout_s + 1) * (self.weight_push_retries + 2) + self.unhealthy_timeout_s
        outcomes = self._call_in_loop(self._push(export.path, version, push_mode), timeout=timeout)
        t2 = time.perf_counter()
        self._weight_version = version
        self._updates += 1
        deleted = prune_versions(self.weight_dir, keep=self.keep_weight_versions, current=version)
        self.last_push = {
            "version": version, "path": export.path, "bytes": export.bytes, "export_s": t1 - t0,
            "export_gbps": export.gbps, "push_s": t2 - t1, "mode": push_mode,
            "workers": {o.url: {"ok": o.ok, "seconds": o.seconds, "update_s": o.update_s, "verify_s": o.verify_s,
                              "attempts": o.attempts, "error": o.error}
                        for o in outcomes},
            "deleted": deleted,
        }  # fmt: skip
        return version

    def load(self) -> dict[str, int]:
        """Requests on the workers ("running") and waiting for a worker ("queued")."""
        with self._lock:
            calls = list(self._calls.values())
        running = sum(1 for c in calls if c.target is not None)
        return {"running": running, "queued": len(calls) - running}

    def info(self) -> dict[str, Any]:
        """The fleet as this client sees it: workers (in service, outstanding, version, last
        error, requests served), router, weight version and the last push."""
        return {
            "kind": "sglang",
            "router_url": self.router_url,
            "router_error": self._router.error if self._router else None,
            "weight_version": self._weight_version,
            "weight_dir": self.weight_dir,
            "workers": [
                {
                    "url": w.url,
                    "in_service": w.in_service,
                    "outstanding": w.outstanding,
                    "version": w.version,
                    "error": w.error,
                    "served": w.served,
                    "failures": w.failures,
                }
                for w in list(self._workers.values())
            ],  # fmt: skip
            "stats": dict(self.stats),
            "last_push": dict(self.last_push),
        }

    def close(self) -> None:
        """Stop the client: requests still waiting or running fail with EngineClosed (the
        workers are left running; their requests end on their own)."""
        if self._closed and not self._thread.is_alive():
            return
        self._closed = True
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
            except Exception:  # the loop is going away either way
                log.exception("fleet client shutdown")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ loop plumbing

    def _call_in_loop(self, coro, *, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _start(self) -> None:
        import httpx

        self._tasks: set[asyncio.Task] = set()
        self._cond = asyncio.Condition()
        self._push_lock = asyncio.Lock()
        self._router_wake = asyncio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s, pool=None)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self._control = httpx.AsyncClient(timeout=httpx.Timeout(self.health_timeout_s, connect=self.connect_timeout_s))
        if self._router is not None and not self._fixed_urls:
            await self._discover()
        for w in self._workers.values():
            w.wake = asyncio.Event()
        await asyncio.gather(*(self._probe(w) for w in list(self._workers.values())))
        versions = [w.version for w in self._workers.values() if w.in_service and w.version]
        if versions:
            self._weight_version = versions[0]
        for w in list(self._workers.values()):
            self._spawn(self._monitor(w))
        self._monitoring = True
        if self._router is not None:
            self._spawn(self._router_monitor())
        self._spawn(self._watchdog())
        self._update_service()

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            if c.task is not None:
                c.task.cancel()
            if not c.future.done():
                c.future.set_exception(EngineClosed("the fleet engine was closed before the request finished"))
        with self._lock:
            self._calls.clear()
        await self._notify()
        await self._client.aclose()
        await self._control.aclose()

    # ------------------------------------------------------------------ workers: health and service

    def _in_service(self) -> list[_Worker]:
        if self._router is not None and not self._router.in_service:
            return []
        return [w for w in self._workers.values() if w.in_service]

    def _update_service(self) -> None:
        if self._in_service():
            self._no_service_since = None
            self._unavailable = None
        elif self._no_service_since is None:
            self._no_service_since = time.monotonic()

    def _answers(self) -> dict[str, str]:
        out = {}
        if self._router is not None:
            out[self._router.url + " (router)"] = self._router.error or "answering"
        for w in self._workers.values():
            out[w.url] = "in service" if w.in_service else (w.error or "out of service")
        if self._router is not None and not self._workers:
            out[self._router.url + " (router)"] = "GET /workers lists no workers"
        return out

    async def _discover(self) -> None:
        """Workers behind the router (GET /workers), added to ours; ours are never dropped."""
        try:
            r = await self._control.get(self._router.url + "/workers")
            found = [w["url"].rstrip("/") for w in r.json().get("workers", [])] if r.status_code == 200 else []
        except Exception as e:  # noqa: BLE001 - the router monitor reports the router's state
            log.debug("router %s: GET /workers failed: %s", self._router.url, e)
            return
        for url in found:
            if url not in self._workers:
                w = _Worker(url, backoff=self.probe_backoff_s)
                w.wake = asyncio.Event()
                self._workers[url] = w
                if self._monitoring:
                    self._spawn(self._monitor(w))

    async def _health(self, w: _Worker) -> tuple[bool, str]:
        """(healthy, what the probe got); counts probes in a row with no answer in w.slow_probes."""
        import httpx

        try:
            r = await self._control.get(w.url + "/health_generate", timeout=self.health_timeout_s)
        except httpx.TimeoutException as e:
            w.slow_probes += 1
            return False, f"GET /health_generate: {describe_error(e, self.health_timeout_s)}"
        except httpx.HTTPError as e:
            return False, f"GET /health_generate: {describe_error(e, self.health_timeout_s)}"
        w.slow_probes = 0
        if r.status_code != 200:
            return False, f"GET /health_generate: {answer_text(r)}"
        return True, "ok"

    async def _probe(self, w: _Worker) -> bool:
        """Health, then the weight version: a worker serves only once it has the target's."""
        ok, why = await self._health(w)
        if ok:
            ok, why = await self._bring_to_version(w)
        if ok:
            if not w.in_service:
                await self._put_in_service(w)
            return True
        w.error = why
        return False

    async def _bring_to_version(self, w: _Worker) -> tuple[bool, str]:
        async with self._push_lock:
            try:
                version = await worker_version(self._control, w.url, self.health_timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure keeps the worker out
                return False, f"GET /model_info: {e}"
            target = self._target
            if target is None or version == target[0]:
                w.version = version
                return True, "ok"
            if not os.path.isdir(target[1]):
                return False, f"serves {version!r}; the current version's folder {target[1]} is gone"
            log.info("%s serves weight version %r; bringing it to %r", w.url, version, target[0])
            out = await push_to_worker(
                self._control, w.url, target[1], target[0], mode="abort", timeout_s=self.weight_push_timeout_s,
                retries=0, backoff_s=self.probe_backoff_s,
            )  # fmt: skip
            if not out.ok:
                return False, f"weight update to {target[0]!r}: {out.error}"
            w.version = target[0]
            return True, "ok"

    async def _put_in_service(self, w: _Worker) -> None:
        if self._router is not None and self.manage_router_workers:
            await self._router_add(w)
        w.in_service, w.error, w.backoff = True, None, self.probe_backoff_s
        self.stats["brought_back"] += 1
        log.info("%s is in service (weight version %s)", w.url, w.version)
        self._update_service()
        await self._notify()

    async def _take_out(self, w: _Worker, why: str) -> None:
        w.error = why
        w.failures += 1
        if not w.in_service:
            return
        w.in_service = False
        w.backoff = self.probe_backoff_s
        self.stats["taken_out"] += 1
        log.warning("%s taken out of service: %s", w.url, why)
        self._update_service()
        if w.wake is not None:
            w.wake.set()
        if self._router is not None and self.manage_router_workers:
            self._spawn(self._router_remove(w))
        await self._notify()

    async def _sleep(self, event: asyncio.Event | None, seconds: float) -> None:
        if event is None:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
        event.clear()

    async def _monitor(self, w: _Worker) -> None:
        """One worker's life: polled while in service (at once when woken: a request failed
        through the router), probed with backoff while out."""
        while not self._closed:
            if w.in_service:
                await self._sleep(w.wake, self.health_interval_s)
                if not w.in_service:
                    continue
                ok, why = await self._health(w)
                if not ok and w.in_service and 0 < w.slow_probes < SLOW_PROBES_TO_FAIL:
                    log.info("%s: %s (once; it stays in service until the next probe)", w.url, why)
                elif not ok and w.in_service:
                    await self._take_out(w, why)
            else:
                w.wake.clear()
                await asyncio.sleep(w.backoff)
                if w.in_service or self._closed:
                    continue
                if not await self._probe(w):
                    w.backoff = min(w.backoff * 2, self.probe_backoff_max_s)

    async def _router_monitor(self) -> None:
        import httpx

        r = self._router
        while not self._closed:
            await self._sleep(self._router_wake, self.health_interval_s if r.in_service else r.backoff)
            try:
                resp = await self._control.get(r.url + "/health", timeout=self.health_timeout_s)
                ok, why = resp.status_code == 200, f"GET /health: {answer_text(resp)}"
            except httpx.HTTPError as e:
                ok, why = False, f"GET /health: {describe_error(e, self.health_timeout_s)}"
            if ok and not r.in_service:
                log.info("router %s answers again", r.url)
                r.in_service, r.error, r.backoff = True, None, self.probe_backoff_s
                self._update_service()
                await self._notify()
            elif not ok:
                if r.in_service:
                    log.warning("router %s out of service: %s", r.url, why)
                    r.backoff = self.probe_backoff_s
                else:
                    r.backoff = min(r.backoff * 2, self.probe_backoff_max_s)
                r.in_service, r.error = False, why
                self._update_service()
                await self._notify()
            if not self._fixed_urls:
                await self._discover()

    async def _watchdog(self) -> None:
        """Fail the waiting requests once no worker has served for unhealthy_timeout_s."""
        while not self._closed:
            await asyncio.sleep(min(0.5, self.unhealthy_timeout_s / 4))
            self._update_service()
            since = self._no_service_since
            if since is not None and self._unavailable is None:
                waited = time.monotonic() - since
                if waited >= self.unhealthy_timeout_s:
                    self._unavailable = FleetUnavailable(self._answers(), waited)
                    log.error("%s", self._unavailable)
                    await self._notify()

    async def _router_workers(self) -> dict[str, str]:
        r = await self._control.get(self._router.url + "/workers")
        return {w["url"].rstrip("/"): w["id"] for w in r.json().get("workers", [])} if r.status_code == 200 else {}

    async def _router_remove(self, w: _Worker) -> None:
        try:
            ids = await self._router_workers()
            if w.url in ids:
                await self._control.delete(f"{self._router.url}/workers/{ids[w.url]}")
        except Exception as e:  # noqa: BLE001 - the router's own health checks remain
            log.warning("router %s: could not remove %s: %s", self._router.url, w.url, e)

    async def _router_add(self, w: _Worker) -> None:
        try:
            if w.url not in await self._router_workers():
                r = await self._control.post(self._router.url + "/workers", json={"url": w.url})
                if r.status_code >= 300:
                    log.warning("router %s: adding %s answered %s", self._router.url, w.url, answer_text(r))
        except Exception as e:  # noqa: BLE001 - the client can still use the worker
            log.warning("router %s: could not add %s: %s", self._router.url, w.url, e)

    # ------------------------------------------------------------------ requests

    def _start_call(self, call: _Call) -> None:
        call.task = self._spawn(self._run_call(call))

    def _choose(self, call: _Call) -> _Worker | None:
        service = self._in_service()
        if not service:
            return None
        if self._router is not None:
            room = self._router.outstanding < self.per_worker_concurrency * len(service)
            return self._router if room else None
        room = [w for w in service if w.outstanding < self.per_worker_concurrency]
        fresh = [w for w in room if w.url not in call.tried] or room
        if not fresh:
            return None
        self._rr += 1
        least = min(w.outstanding for w in fresh)
        ties = [w for w in fresh if w.outstanding == least]
        return ties[self._rr % len(ties)]

    async def _acquire(self, call: _Call) -> _Worker | None:
        async with self._cond:
            while True:
                if self._closed:
                    raise EngineClosed("the fleet engine is closed")
                if call.aborted:
                    return None
                target = self._choose(call)
                if target is not None:
                    target.outstanding += 1
                    call.target = target
                    return target
                if self._unavailable is not None:
                    raise self._unavailable
                await self._cond.wait()

    def _body(self, call: _Call) -> dict[str, Any]:
        body = {
            "input_ids": list(call.request.input_ids),
            "sampling_params": call.sampling.to_dict(),
            "return_logprob": True,
            "rid": call.wire_rid,
        }
        if call.request.return_prompt_logprobs_from is not None:
            body["logprob_start_len"] = call.request.return_prompt_logprobs_from
        return body

    def _samples(self, call: _Call, answer: Any) -> list[Sample]:
        items = answer if isinstance(answer, list) else [answer]
        n = call.sampling.n
        if len(items) != n:
            raise ValueError(f"{len(items)} response objects for n={n}")
        out = []
        for j, item in enumerate(items):
            s = wire.sample_from_item(item, call.request.input_ids, index=j)
            out.append(dataclasses.replace(s, rid=call.rid, e2e_latency_s=time.time() - call.submit_time))
        return out

    def _aborted_samples(self, call: _Call) -> list[Sample]:
        reason = FinishReason("abort", message=call.aborted or "aborted")
        return [
            Sample(call.rid, j, call.request.input_ids, (), (), (), reason, self._weight_version)
            for j in range(call.sampling.n)
        ]

    async def _run_call(self, call: _Call) -> None:
        try:
            samples = await self._attempts(call)
        except asyncio.CancelledError:
            if not call.future.done():
                call.future.set_exception(EngineClosed("the fleet engine was closed before the request finished"))
            raise
        except BaseException as e:
            if not call.future.done():
                call.future.set_exception(e)
        else:
            if call.on_update is not None:
                try:
                    call.on_update(samples)
                except Exception:  # a caller's callback must not stop the client
                    log.exception("on_update callback of request %s raised", call.rid)
            if not call.future.done():
                call.future.set_result(samples)
        finally:
            with self._lock:
                if self._calls.get(call.rid) is call:
                    del self._calls[call.rid]

    async def _attempts(self, call: _Call) -> list[Sample]:
        import httpx

        while True:
            target = await self._acquire(call)
            if target is None:
                return self._aborted_samples(call)
            call.attempt += 1
            call.wire_rid = f"{call.rid}#{call.attempt}"
            call.tried.add(target.url)
            blame = True
            try:
                r = await asyncio.wait_for(
                    self._client.post(target.url + "/generate", json=self._body(call)), self.request_timeout_s + 5
                )
            except (TimeoutError, httpx.HTTPError) as e:
                failure = f"POST /generate: {describe_error(e, self.request_timeout_s)}"
                if isinstance(e, TimeoutError):
                    failure = f"POST /generate: no answer within {self.request_timeout_s:g} s"
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
                await self._notify()
            call.answers.append(f"{target.url}: {failure}")
            if call.aborted:
                return self._aborted_samples(call)
            self._spawn(self._abandon(call.wire_rid, target))
            if blame:
                await self._blame(target, failure)
            if call.attempt > self.max_retries:
                raise RequestFailed(
                    f"request {call.rid!r} failed on {call.attempt} attempts ({'; '.join(call.answers)}); "
                    f"rollout.max_retries={self.max_retries}"
                )
            self.stats["retries"] += 1
            log.info("re-issuing %s after %s", call.rid, call.answers[-1])
            await asyncio.sleep(min(self.retry_backoff_s * 2 ** (call.attempt - 1), self.probe_backoff_max_s))

    async def _blame(self, target: _Worker, failure: str) -> None:
        if target is not self._router:
            await self._take_out(target, failure)
            return
        # The router hides which worker failed: check them all now.
        for w in self._workers.values():
            if w.wake is not None:
                w.wake.set()
        import httpx

        if "connection failed" in failure:
            self._router.error = failure
            try:
                await self._control.get(self._router.url + "/health", timeout=self.connect_timeout_s)
            except httpx.HTTPError as e:
                if self._router.in_service:
                    log.warning("router %s out of service: %s", self._router.url, describe_error(e))
                self._router.in_service, self._router.error = False, f"POST /generate: {describe_error(e)}"
                self._router.backoff = self.probe_backoff_s
                self._update_service()
                self._router_wake.set()

    async def _abandon(self, wire_rid: str, target: _Worker) -> None:
        """Abort an abandoned attempt where it may still run, so it frees its slots."""
        self.stats["abandoned"] += 1
        urls = [target.url] if target is not self._router else [w.url for w in self._workers.values()]
        await self._post_aborts(urls, {"rid": wire_rid})

    async def _post_aborts(self, urls: Sequence[str], body: dict) -> None:
        import httpx

        async def one(url: str) -> None:
            try:
                await self._control.post(url + "/abort_request", json=body, timeout=ABORT_TIMEOUT_S)
            except httpx.HTTPError as e:
                log.debug("%s/abort_request %s: %s", url, body, describe_error(e))

        await asyncio.gather(*(one(u) for u in urls))

    async def _abort_calls(self, calls: list[_Call], sample: int | None, *, every: bool) -> None:
        message = "aborted by request"
        if sample is None:
            for c in calls:
                c.aborted = message
        await self._notify()  # the ones still waiting for a worker end now
        if every:
            await self._post_aborts([w.url for w in self._workers.values()], {"rid": "", "abort_all": True})
            return
        for c in calls:
            target = c.target
            if target is None or c.wire_rid is None:
                continue
            rid = c.wire_rid if sample is None else f"{c.wire_rid}-{sample}"
            urls = [target.url] if target is not self._router else [w.url for w in self._workers.values()]
            await self._post_aborts(urls, {"rid": rid})

    # ------------------------------------------------------------------ weights

    async def _push(self, folder: str, version: str, mode: str):
        async with self._push_lock:
            self._target = (version, folder)
            targets = [w for w in self._workers.values() if w.in_service]  # the others catch up when back
            outcomes = await push_to_workers(
                self._control, [w.url for w in targets], folder, version, mode=mode,
                timeout_s=self.weight_push_timeout_s, retries=self.weight_push_retries, backoff_s=self.probe_backoff_s,
            )  # fmt: skip
            self.stats["pushes"] += 1
            refused = []
            for w, o in zip(targets, outcomes):
                if o.ok:
                    w.version = version
                elif o.permanent:
                    refused.append(f"{w.url}: {o.error}")
                else:
                    self.stats["failed_pushes"] += 1
                    await self._take_out(w, f"weight update to {version!r}: {o.error}")
            if refused:
                hint = (
                    "; rollout.weight_push_mode=drain updates without pausing"
                    if mode == "pause" and any("paused" in r for r in refused)
                    # The folder is complete here, so a worker that refuses it may not see it.
                    else "; every worker must read that folder (rollout.weight_dir: a file system they share, "
                    "or /dev/shm for workers on this host) and serve the policy's architecture"
                )
                raise WeightSyncError(
                    f"workers refused weight version {version!r} from {folder}: {'; '.join(refused)}{hint}"
                )
        if not any(o.ok for o in outcomes):
            await self._wait_for_service()
        return outcomes

    async def _wait_for_service(self) -> None:
        """Until a worker serves the target version, or FleetUnavailable."""
        async with self._cond:
            while not self._in_service():
                if self._closed:
                    raise EngineClosed("the fleet engine is closed")
                if self._unavailable is not None:
                    raise self._unavailable
                await self._cond.wait()


__all__ = ["FleetEngine", "FleetUnavailable", "RequestFailed", "EngineClosed", "WeightSyncError"]
