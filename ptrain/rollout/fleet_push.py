"""Weight push of a FleetEngine: export a version and load it on every worker in service.

    push = FleetPush(state, health, model_cfg=cfg, weight_dir="runs/x/weights")
    push.update_weights(params, model_state, weight_version="12", mode="drain")

The new params are exported to `<weight_dir>/v<version>/` (bf16 or fp32 safetensors,
manifest, atomic rename: `ptrain.rollout.weight_sync`), every worker in service loads it with
/update_weights_from_disk at once (mode drain, abort, or pause = pause in place, update,
continue), and must report the version in /model_info (a trainer of several JAX processes
exports from every process and pushes from process 0); one that fails after
`weight_push_retries` is taken out until it is brought to the version (FleetHealth does that
before it serves again, from the target this push sets). Old versions beyond
`keep_weight_versions` are deleted. A worker that refuses the folder (HTTP 400: another model)
is an error for the caller (WeightSyncError), not a retry.

Adapter push (`update_lora`), for a LoRA stage whose workers serve its frozen base with LoRA
enabled, as SGLang users do RL with LoRA: the adapters alone are written as a PEFT folder
`<weight_dir>/v<version>-lora/` (atomically, like a full export), every worker in service
loads them under the versioned name `<name>-v<version>` (/load_lora_adapter), requests naming
`name` (or none, when it is the default adapter) go out under that name from then on, and the
previous version's name is unloaded once the fleet's requests using it have ended (mode drain
waits for that; abort ends them first; in_place lets them finish in the background on the
adapter they started with, which SGLang cannot swap under a running request). A worker
brought back into service loads the current adapter version (FleetHealth); one that refuses
the adapter (LoRA off, a rank above its --max-lora-rank, targets outside its
--lora-target-modules) is a WeightSyncError naming the flags to start it with. A trainer of
several JAX processes gathers the adapters to every host (they are small) and process 0 alone
writes and pushes them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from ptrain.rollout.fleet_health import FleetHealth
from ptrain.rollout.fleet_state import EngineClosed, FleetState, LoRAVersion
from ptrain.rollout.protocol import SWAP_MODES
from ptrain.rollout.weight_sync import (
    PushOutcome,
    WeightSyncError,
    export_adapters,
    export_weights,
    lora_flags,
    prune_lora_versions,
    prune_versions,
    push_lora_to_worker,
    push_to_workers,
    unload_lora_on_worker,
)

log = logging.getLogger(__name__)

PUSH_FOR_SWAP = {"drain": "drain", "abort": "abort", "in_place": "pause"}
"""The fleet's way to do each of LocalEngine's swap modes (weight_push_mode "stage")."""


class FleetPush:
    """Exports and pushes weight versions (module docstring); `last_push` describes the last one.

    model_cfg: the trained model's ModelConfig (exports need it; None: no update_weights).
    weight_dir: where versions are exported (every worker must read the same path).
    extra_config: keys for each export's config.json (e.g. eos_token_id).
    """

    def __init__(self, state: FleetState, health: FleetHealth, *, model_cfg=None, weight_dir: str | None = None,
                 extra_config: Mapping[str, Any] | None = None):  # fmt: skip
        self.state = state
        self.health = health
        self.model_cfg = model_cfg
        self.weight_dir = weight_dir
        self.extra_config = dict(extra_config or {})
        self.updates = 0
        self.last_push: dict[str, Any] = {}

    def update_weights(self, params, model_state=None, *, weight_version: str | None = None,
                       mode: str = "drain") -> str:  # fmt: skip
        """Export `params` (pure dicts, as TrainState.params) to `<weight_dir>/v<version>/`
        and load them on every worker (module docstring); blocks until every worker in service
        reports the version. mode: drain | abort | in_place (LocalEngine's names; the fleet
        does in_place as pause/update/continue), unless rollout.weight_push_mode fixes one.
        WeightSyncError when a worker refuses the folder; FleetUnavailable when no worker is
        left to serve it. Returns the version."""
        s = self.state
        cfg = s.settings
        if mode not in SWAP_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {SWAP_MODES}")
        if self.model_cfg is None or self.weight_dir is None:
            raise WeightSyncError("this FleetEngine was built without model_cfg and weight_dir; it cannot export")
        version = str(weight_version) if weight_version is not None else str(self.updates + 1)
        push_mode = PUSH_FOR_SWAP[mode] if cfg.weight_push_mode == "stage" else cfg.weight_push_mode
        t0 = time.perf_counter()
        export = export_weights(
            self.model_cfg, params, model_state, self.weight_dir, version, dtype=cfg.weight_dtype,
            writers=cfg.export_writers, extra_config=self.extra_config, checksums=cfg.weight_checksums,
        )  # fmt: skip
        t1 = time.perf_counter()
        import jax

        if jax.process_index() > 0:
            # Several trainer processes: each wrote its share of the export above; process 0
            # alone tells the workers and prunes old versions.
            s.weight_version, self.updates = version, self.updates + 1
            return version
        timeout = (cfg.weight_push_timeout_s + 1) * (cfg.weight_push_retries + 2) + cfg.unhealthy_timeout_s
        outcomes = s.call_in_loop(self._push(export.path, version, push_mode), timeout=timeout)
        t2 = time.perf_counter()
        s.weight_version = version
        self.updates += 1
        deleted = prune_versions(self.weight_dir, keep=cfg.keep_weight_versions, current=version)
        self.last_push = {
            "version": version, "path": export.path, "bytes": export.bytes, "export_s": t1 - t0,
            "export_gbps": export.gbps, "push_s": t2 - t1, "mode": push_mode,
            "workers": {o.url: {"ok": o.ok, "seconds": o.seconds, "update_s": o.update_s, "verify_s": o.verify_s,
                              "attempts": o.attempts, "error": o.error}
                        for o in outcomes},
            "deleted": deleted,
        }  # fmt: skip
        return version

    async def _push(self, folder: str, version: str, mode: str) -> list[PushOutcome]:
        s = self.state
        cfg = s.settings
        async with s.push_lock:
            s.target = (version, folder)
            targets = [w for w in s.workers.values() if w.in_service]  # the others catch up when back
            outcomes = await push_to_workers(
                s.control, [w.url for w in targets], folder, version, mode=mode,
                timeout_s=cfg.weight_push_timeout_s, retries=cfg.weight_push_retries, backoff_s=cfg.probe_backoff_s,
            )  # fmt: skip
            s.stats["pushes"] += 1
            refused = []
            for w, o in zip(targets, outcomes):
                if o.ok:
                    w.version = version
                elif o.permanent:
                    refused.append(f"{w.url}: {o.error}")
                else:
                    s.stats["failed_pushes"] += 1
                    await self.health.take_out(w, f"weight update to {version!r}: {o.error}")
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

    def update_lora(self, name: str, adapters, spec, *, weight_version: str | None = None,
                    mode: str = "drain") -> str:  # fmt: skip
        """Export LoRA `adapters` (the trainer's pytree, with LoRASpec `spec`) of adapter `name`
        to `<weight_dir>/v<version>-lora/`, load them on every worker in service and make
        requests for `name` use them (module docstring): a weight update whose payload is the
        adapters alone, as LocalEngine.update_lora. Blocks until every worker in service holds
        the version (and with mode drain or abort until the previous version is unloaded).
        WeightSyncError when a worker refuses the adapter; FleetUnavailable when no worker is
        left to serve it. Returns the version. With several JAX processes every one calls it:
        the adapters are gathered to every host (a collective) and process 0 alone pushes."""
        s = self.state
        cfg = s.settings
        if mode not in SWAP_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {SWAP_MODES}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: pass the adapter's name, got {name!r}")
        if self.model_cfg is None or self.weight_dir is None:
            raise WeightSyncError("this FleetEngine was built without model_cfg and weight_dir; it cannot export")
        version = str(weight_version) if weight_version is not None else str(self.updates + 1)
        push_mode = PUSH_FOR_SWAP[mode] if cfg.weight_push_mode == "stage" else cfg.weight_push_mode
        import jax

        if jax.process_count() > 1:
            from ptrain.parallel.multihost import host_array

            adapters = jax.tree.map(host_array, adapters)  # a collective: every process gathers
            if jax.process_index() > 0:
                s.weight_version, self.updates = version, self.updates + 1
                return version
        t0 = time.perf_counter()
        export = export_adapters(adapters, spec, self.model_cfg, self.weight_dir, version)
        t1 = time.perf_counter()
        current = LoRAVersion(name, f"{name}-v{version}", version, export.path)
        timeout = (cfg.weight_push_timeout_s + 1) * (cfg.weight_push_retries + 3) + cfg.unhealthy_timeout_s
        outcomes, previous = s.call_in_loop(self._push_lora(current, spec, push_mode), timeout=timeout)
        t2 = time.perf_counter()
        if previous is not None and previous.served != current.served:
            if push_mode == "pause":  # its requests continue; the unload follows when they end
                s.loop.call_soon_threadsafe(lambda: s.spawn(self._retire(previous)))
            else:
                s.call_in_loop(self._retire(previous), timeout=cfg.request_timeout_s + timeout)
        t3 = time.perf_counter()
        s.weight_version = version
        self.updates += 1
        deleted = prune_lora_versions(self.weight_dir, keep=cfg.keep_weight_versions, current=version)
        self.last_push = {
            "kind": "lora", "adapter": current.served, "version": version, "path": export.path,
            "bytes": export.bytes, "export_s": t1 - t0, "export_gbps": export.gbps, "push_s": t2 - t1,
            "unload_s": t3 - t2, "mode": push_mode,
            "workers": {o.url: {"ok": o.ok, "seconds": o.seconds, "update_s": o.update_s, "verify_s": o.verify_s,
                              "attempts": o.attempts, "error": o.error}
                        for o in outcomes},
            "deleted": deleted,
        }  # fmt: skip
        return version

    async def _push_lora(self, current: LoRAVersion, spec, mode: str) -> tuple[list[PushOutcome], LoRAVersion | None]:
        s = self.state
        cfg = s.settings
        async with s.push_lock:
            previous = s.loras.get(current.name)
            keep = [v.served for v in (current, previous) if v is not None]
            targets = [w for w in s.workers.values() if w.in_service]  # the others catch up when back
            kw = dict(keep=keep, timeout_s=cfg.weight_push_timeout_s, retries=cfg.weight_push_retries,
                      backoff_s=cfg.probe_backoff_s)  # fmt: skip
            one = current.name, current.served, current.folder
            outcomes = list(await asyncio.gather(*(push_lora_to_worker(s.control, w.url, *one, **kw) for w in targets)))
            s.stats["pushes"] += 1
            refused = [f"{w.url}: {o.error}" for w, o in zip(targets, outcomes) if not o.ok and o.permanent]
            if refused:
                # The old version keeps serving: requests are not switched to a version some
                # workers lack.
                raise WeightSyncError(
                    f"workers refused adapter version {current.served!r} from {current.folder}: {'; '.join(refused)}"
                    f"; start every worker with {lora_flags(spec)} (tools/launch_fleet.py passes them on with "
                    "--enable-lora, --max-lora-rank and --lora-target-modules) on the stage's base model, and give "
                    "them room for two adapters (--max-loras-per-batch >= 2), reading rollout.weight_dir"
                )
            for w, o in zip(targets, outcomes):
                if o.ok:
                    w.version = current.version
                else:
                    s.stats["failed_pushes"] += 1
                    await self.health.take_out(w, f"adapter update to {current.served!r}: {o.error}")
            if mode == "abort":
                # Before the switch, so the requests this ends are all on the old version.
                await asyncio.gather(*(self._abort_all(w.url) for w in targets))
            s.loras[current.name] = current
        if not any(o.ok for o in outcomes):
            await self._wait_for_service()
        return outcomes, previous

    async def _abort_all(self, url: str) -> None:
        import httpx

        try:
            await self.state.control.post(url + "/abort_request", json={"rid": "", "abort_all": True})
        except httpx.HTTPError as e:
            log.warning("%s: abort before an adapter update failed: %s", url, e)

    async def _retire(self, old: LoRAVersion) -> None:
        """Unload adapter version `old` from the workers once no request of the fleet uses it
        (a worker out of service now drops it when it catches up)."""
        s = self.state
        async with s.cond:
            while s.lora_inflight.get(old.served) and not s.closed:
                await s.cond.wait()
        if s.closed or any(v.served == old.served for v in s.loras.values()):
            return
        urls = [w.url for w in s.workers.values() if w.in_service]
        timeout_s = s.settings.weight_push_timeout_s
        errors = await asyncio.gather(*(unload_lora_on_worker(s.control, u, old.served, timeout_s=timeout_s)
                                        for u in urls))  # fmt: skip
        for url, error in zip(urls, errors):
            if error is not None:
                log.warning("%s: unloading adapter version %s failed: %s", url, old.served, error)

    async def _wait_for_service(self) -> None:
        """Until a worker serves the target version, or FleetUnavailable."""
        s = self.state
        async with s.cond:
            while not s.in_service():
                if s.closed:
                    raise EngineClosed("the fleet engine is closed")
                if s.unavailable is not None:
                    raise s.unavailable
                await s.cond.wait()
