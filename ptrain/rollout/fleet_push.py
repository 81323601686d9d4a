"""Weight push of a FleetEngine: export a version and load it on every worker in service.

    push = FleetPush(state, health, model_cfg=cfg, weight_dir="runs/x/weights")
    push.update_weights(params, model_state, weight_version="12", mode="drain")

The new params are exported to `<weight_dir>/v<version>/` (bf16 or fp32 safetensors,
manifest, atomic rename: `ptrain.rollout.weight_sync`), every worker in service loads it with
/update_weights_from_disk at once (mode drain, abort, or pause = pause in place, update,
continue), and must report the version in /model_info; one that fails after
`weight_push_retries` is taken out until it is brought to the version (FleetHealth does that
before it serves again, from the target this push sets). Old versions beyond
`keep_weight_versions` are deleted. A worker that refuses the folder (HTTP 400: another model)
is an error for the caller (WeightSyncError), not a retry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ptrain.rollout.fleet_health import FleetHealth
from ptrain.rollout.fleet_state import EngineClosed, FleetState
from ptrain.rollout.protocol import SWAP_MODES
from ptrain.rollout.weight_sync import PushOutcome, WeightSyncError, export_weights, prune_versions, push_to_workers

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
