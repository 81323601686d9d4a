"""FleetEngine: the rollout protocol over an SGLang fleet (`rollout=sglang`).

    engine = FleetEngine(router_url="http://127.0.0.1:30000", model_cfg=cfg, weight_dir="runs/x/weights")
    future = engine.submit(GenerateRequest(prompt_ids, SamplingParams(n=8), rid="task-3"))
    engine.update_weights(params, model_state, weight_version="12", mode="drain")

The workers are SGLang servers (`python -m sglang.launch_server`) or `python -m ptrain.serve`,
listed in `urls`, or found behind an sglang-router (`router_url`, its GET /workers). An asyncio
loop on a background thread drives them with one httpx.AsyncClient; `submit` only queues.

FleetEngine joins three parts over one shared record (`fleet_state.FleetState`: settings,
workers, router, the weight version they must serve, the loop):
- `fleet_dispatch.FleetDispatch`: requests to the workers or the router, re-issued on another
  worker when one fails, each answered exactly once; abort; the per-worker concurrency limit.
- `fleet_health.FleetHealth`: /health_generate polls, taking a worker out of service (and out
  of the router), probing it with backoff, bringing it to the current weights before it
  serves again; FleetUnavailable once no worker has served for `unhealthy_timeout_s`.
- `fleet_push.FleetPush` (`update_weights`, `update_lora`): exporting a weight version (or a
  LoRA adapter version) and loading it on every worker in service (`weight_sync` has the
  export and the per-worker push).
Each module's docstring explains its part.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ptrain.rollout.fleet_dispatch import FleetDispatch, RequestFailed
from ptrain.rollout.fleet_health import FleetHealth
from ptrain.rollout.fleet_push import FleetPush
from ptrain.rollout.fleet_state import EngineClosed, FleetSettings, FleetState, FleetUnavailable
from ptrain.rollout.protocol import EngineBase, GenerateRequest
from ptrain.rollout.weight_sync import WeightSyncError

log = logging.getLogger(__name__)


class FleetEngine(EngineBase):
    """The rollout protocol over SGLang workers, with or without an sglang-router (module docstring).

    model_cfg: the trained model's ModelConfig (exports need it; None: no update_weights).
    weight_dir: where versions are exported (every worker must read the same path).
    eos_token_ids: ids that end a sample unless it sets ignore_eos (the stage's stop ids).
    extra_config: keys for each export's config.json (e.g. eos_token_id).
    settings: FleetSettings' fields, the `rollout.*` fields of the same names (RolloutConfig),
    e.g. max_retries=3, weight_push_mode="drain".
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
        **settings: Any,
    ):
        if not urls and not router_url:
            raise ValueError("FleetEngine needs worker urls or a router_url")
        self.settings = FleetSettings(**settings)
        self.router_url = router_url.rstrip("/") if router_url else None
        self._state = FleetState(self.settings, urls=urls, router_url=self.router_url)
        self._health = FleetHealth(self._state)
        self._dispatch = FleetDispatch(self._state, self._health, eos_token_ids=eos_token_ids, seed=seed)
        self._push = FleetPush(self._state, self._health, model_cfg=model_cfg, weight_dir=weight_dir,
                               extra_config=extra_config)  # fmt: skip
        self.stats = self._state.stats
        self._state.thread.start()
        s = self.settings
        try:
            self._state.call_in_loop(self._start(), timeout=s.health_timeout_s + 2 * s.connect_timeout_s + 30)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, ro, *, model_cfg=None, weight_dir: str | None = None, eos_token_ids=(), seed: int = 0,
                    extra_config=None) -> FleetEngine:  # fmt: skip
        """From a RolloutConfig (`rollout.*`); weight_dir: the folder to export into (default
        rollout.weight_dir itself; make_engine passes the stage's own folder under it)."""
        return cls(
            urls=list(ro.urls), router_url=ro.router_url, model_cfg=model_cfg,
            weight_dir=weight_dir or ro.weight_dir, eos_token_ids=eos_token_ids, seed=seed,
            extra_config=extra_config, **{f.name: getattr(ro, f.name) for f in dataclasses.fields(FleetSettings)},
        )  # fmt: skip

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> str:
        return self._state.weight_version

    @property
    def model_cfg(self):
        return self._push.model_cfg

    @property
    def weight_dir(self) -> str | None:
        return self._push.weight_dir

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._dispatch.eos_token_ids

    @property
    def last_push(self) -> dict[str, Any]:
        """The last update_weights: version, folder, bytes, export and push seconds, each worker's outcome."""
        return self._push.last_push

    def submit(self, request: GenerateRequest, on_update=None) -> concurrent.futures.Future:
        """Queue a request (RolloutEngine.submit; FleetDispatch.submit)."""
        return self._dispatch.submit(request, on_update)

    def abort(self, rid: str | None = None) -> int:
        """End request `rid`, sample `rid-j`, or every request when None (FleetDispatch.abort)."""
        return self._dispatch.abort(rid)

    def update_weights(self, params, model_state=None, *, weight_version: str | None = None,
                       mode: str = "drain") -> str:  # fmt: skip
        """Export `params` and load them on every worker in service (FleetPush.update_weights)."""
        return self._push.update_weights(params, model_state, weight_version=weight_version, mode=mode)

    def update_lora(self, name: str, adapters, spec, *, weight_version: str | None = None,
                    mode: str = "drain") -> str:  # fmt: skip
        """Push LoRA adapters alone: a weight update whose payload is `adapters` (LoRASpec
        `spec`), served as adapter `name` (FleetPush.update_lora; LocalEngine.update_lora)."""
        return self._push.update_lora(name, adapters, spec, weight_version=weight_version, mode=mode)

    @property
    def default_lora(self) -> str | None:
        """The adapter requests without `lora_path` sample with (None: the base model)."""
        return self._state.default_lora

    def set_default_lora(self, name: str | None) -> None:
        """Requests without `lora_path` sample with adapter `name` (None: the base model): an
        adapter pushed with update_lora (its current version; it may be pushed later, as the
        GRPO stage does before its first step), or one the workers were started with."""
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name: pass an adapter's name or None, got {name!r}")
        self._state.default_lora = name

    def loras(self) -> dict[str, dict[str, str]]:
        """The adapters pushed with update_lora: name -> the current version, the name the
        workers serve it under, and its folder."""
        return {n: {"version": v.version, "served": v.served, "path": v.folder} for n, v in self._state.loras.items()}

    def load(self) -> dict[str, int]:
        """Requests on the workers ("running") and waiting for a worker ("queued")."""
        return self._dispatch.load()

    def info(self) -> dict[str, Any]:
        """The fleet as this client sees it: workers (in service, outstanding, version, last
        error, requests served), router, weight version and the last push."""
        s = self._state
        return {
            "kind": "sglang",
            "router_url": self.router_url,
            "router_error": s.router.error if s.router else None,
            "weight_version": s.weight_version,
            "weight_dir": self.weight_dir,
            "loras": self.loras(),
            "default_lora": s.default_lora,
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
                for w in list(s.workers.values())
            ],  # fmt: skip
            "stats": dict(s.stats),
            "last_push": dict(self.last_push),
        }

    def close(self) -> None:
        """Stop the client: requests still waiting or running fail with EngineClosed (the
        workers are left running; their requests end on their own)."""
        s = self._state
        if s.closed and not s.thread.is_alive():
            return
        s.closed = True
        if s.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), s.loop).result(timeout=30)
            except Exception:  # the loop is going away either way
                log.exception("fleet client shutdown")
            s.loop.call_soon_threadsafe(s.loop.stop)
        s.thread.join(timeout=30)

    # ------------------------------------------------------------------ on the loop

    async def _start(self) -> None:
        await self._state.open()
        await self._health.start()

    async def _shutdown(self) -> None:
        self._state.cancel_tasks()
        self._dispatch.fail_all()
        await self._state.notify()
        await self._state.aclose()


__all__ = ["FleetEngine", "FleetUnavailable", "RequestFailed", "EngineClosed", "WeightSyncError"]
