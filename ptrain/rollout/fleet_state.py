"""What the parts of a FleetEngine share: the settings, the workers and the router, whether any
of them serves, the weight version they must serve, and the asyncio loop that drives them.

    state = FleetState(FleetSettings(max_retries=3), urls=["http://127.0.0.1:30001"], router_url=None)

Dispatch (`fleet_dispatch`), health (`fleet_health`) and the weight push (`fleet_push`) each
read and change this record, almost all of it on the loop's one thread, so it has no lock:
from the caller's thread `submit` only reads `closed` and `unavailable` and counts requests,
`update_weights` sets `weight_version` once its push is done, and `info` reads. Two httpx
clients, opened on the loop: `client` for /generate (timeout request_timeout_s, no bound on
connections) and `control` for health probes, aborts, the router's worker list and weight
pushes (timeout health_timeout_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from ptrain.rollout.protocol import EngineUnavailable
from ptrain.rollout.weight_sync import PUSH_MODES


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


class EngineClosed(RuntimeError):
    """The engine was closed before the request finished."""


@dataclasses.dataclass(frozen=True)
class FleetSettings:
    """The `rollout.*` fields a FleetEngine runs by (RolloutConfig documents each), coerced to
    their types; ValueError for a weight_push_mode the fleet has no way to do."""

    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    unhealthy_timeout_s: float = 120.0
    max_retries: int = 5
    retry_backoff_s: float = 0.5
    per_worker_concurrency: int = 64
    health_interval_s: float = 10.0
    health_timeout_s: float = 20.0
    probe_backoff_s: float = 1.0
    probe_backoff_max_s: float = 30.0
    manage_router_workers: bool = True
    weight_dtype: str = "bfloat16"
    keep_weight_versions: int = 2
    weight_push_mode: str = "stage"
    weight_push_timeout_s: float = 600.0
    weight_push_retries: int = 2
    export_writers: int = 2
    weight_checksums: bool = True

    def __post_init__(self) -> None:
        kinds = {"float": float, "int": int, "bool": bool}
        for f in dataclasses.fields(self):
            if f.type in kinds:
                object.__setattr__(self, f.name, kinds[f.type](getattr(self, f.name)))
        if self.weight_push_mode not in ("stage", *PUSH_MODES):
            raise ValueError(f"weight_push_mode={self.weight_push_mode!r}: pass stage, drain, abort or pause")


@dataclasses.dataclass(frozen=True)
class LoRAVersion:
    """The version of a pushed adapter the workers serve: requests naming `name` (or none, when
    it is the default) go out as `served`, the name its folder was loaded under on every worker."""

    name: str
    served: str
    version: str
    folder: str


@dataclasses.dataclass(eq=False)
class Worker:
    """One SGLang server (or the router) as the client sees it."""

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


class FleetState:
    """The shared record (module docstring). `target` is the (version, folder) every worker must
    serve before it serves requests, and `loras` the adapters it must have loaded (the current
    LoRAVersion of each adapter name pushed); `default_lora` the adapter name requests without
    lora_path sample with; `lora_inflight` the requests on the workers by adapter (served) name; `no_service_since` the time the last worker left service
    (None while one serves), and `unavailable` the FleetUnavailable raised once that lasts
    unhealthy_timeout_s."""

    def __init__(self, settings: FleetSettings, *, urls: Sequence[str], router_url: str | None):
        self.settings = settings
        self.fixed_urls = bool(urls)
        self.workers: dict[str, Worker] = {}
        for u in urls:
            self.workers[u.rstrip("/")] = Worker(u.rstrip("/"), backoff=settings.probe_backoff_s)
        self.router = Worker(router_url, in_service=True, error=None) if router_url else None
        self.weight_version = "default"
        self.target: tuple[str, str] | None = None
        self.loras: dict[str, LoRAVersion] = {}
        self.default_lora: str | None = None
        self.lora_inflight: dict[str, int] = {}
        self.closed = False
        self.no_service_since: float | None = time.monotonic()
        self.unavailable: FleetUnavailable | None = None
        self.stats = {"requests": 0, "retries": 0, "abandoned": 0, "taken_out": 0, "brought_back": 0,
                      "pushes": 0, "failed_pushes": 0}  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ptrain-fleet", daemon=True)
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ loop plumbing

    def call_in_loop(self, coro: Coroutine, *, timeout: float | None = None) -> Any:
        """Run `coro` on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A task on the loop (from the loop's thread), cancelled when the engine closes."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def open(self) -> None:
        """The loop's synchronisation primitives and the two HTTP clients (module docstring)."""
        import httpx

        s = self.settings
        self.cond = asyncio.Condition()
        self.push_lock = asyncio.Lock()
        self.router_wake = asyncio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s, pool=None)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.control = httpx.AsyncClient(timeout=httpx.Timeout(s.health_timeout_s, connect=s.connect_timeout_s))

    def cancel_tasks(self) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.control.aclose()

    async def notify(self) -> None:
        """Wake everything waiting on `cond`: a worker's service, a slot or the fleet's state changed."""
        async with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ service

    def in_service(self) -> list[Worker]:
        """The workers requests may go to (none while the router, if there is one, is down)."""
        if self.router is not None and not self.router.in_service:
            return []
        return [w for w in self.workers.values() if w.in_service]

    def update_service(self) -> None:
        """Start or stop the clock of no worker in service; a worker back clears `unavailable`."""
        if self.in_service():
            self.no_service_since = None
            self.unavailable = None
        elif self.no_service_since is None:
            self.no_service_since = time.monotonic()
