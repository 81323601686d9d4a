"""Worker health of a FleetEngine: which workers are in service, and the way back for one that left.

    health = FleetHealth(state)
    await health.start()                      # probe every worker, then watch them
    await health.take_out(worker, "POST /generate: HTTP 503")

Every worker in service is polled with /health_generate every `health_interval_s`; one
that answers it with an error, leaves it unanswered twice in a row (a worker compiling a
program for a new shape can stall one probe), or fails a request, is taken out (and, with
`manage_router_workers`, removed from the router), then probed with exponential backoff from `probe_backoff_s` to
`probe_backoff_max_s`. A worker that answers again is brought to the current weight version
(an update from the current export folder, checked in /model_info) and loads the current
version of every pushed adapter (`FleetPush.update_lora`) before it serves again.
When no worker has been in service for `unhealthy_timeout_s`, waiting requests fail with
FleetUnavailable, which names every URL and its last answer, and so does `submit` until a worker
is back.

The router, if there is one, is polled with /health the same way; while it is down no request
is sent. Without fixed `urls` the workers are the ones its GET /workers lists, looked up again
at every router poll (a worker once found is never dropped).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ptrain.rollout.fleet_state import FleetState, FleetUnavailable, Worker
from ptrain.rollout.weight_sync import answer_text, describe_error, push_lora_to_worker, push_to_worker, worker_version

log = logging.getLogger(__name__)

SLOW_PROBES_TO_FAIL = 2
"""A worker in service leaves it after this many health probes in a row without an answer
(one that compiles a program for a new shape can stall that long once); a probe answered
with an error, or a failed request, takes it out at once."""


async def _sleep(event: asyncio.Event | None, seconds: float) -> None:
    """Sleep `seconds`, or until `event` is set (then cleared)."""
    if event is None:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass
    event.clear()


class FleetHealth:
    """Puts workers in and out of service in the shared FleetState (module docstring)."""

    def __init__(self, state: FleetState):
        self.state = state
        self.monitoring = False

    async def start(self) -> None:
        """Find and probe every worker once (the fleet's weight version is the one the workers in
        service report), then start the monitors and the watchdog."""
        s = self.state
        if s.router is not None and not s.fixed_urls:
            await self.discover()
        for w in s.workers.values():
            w.wake = asyncio.Event()
        await asyncio.gather(*(self.probe(w) for w in list(s.workers.values())))
        versions = [w.version for w in s.workers.values() if w.in_service and w.version]
        if versions:
            s.weight_version = versions[0]
        for w in list(s.workers.values()):
            s.spawn(self._monitor(w))
        self.monitoring = True
        if s.router is not None:
            s.spawn(self._router_monitor())
        s.spawn(self._watchdog())
        s.update_service()

    def answers(self) -> dict[str, str]:
        """Every URL and its last answer (FleetUnavailable's message)."""
        s = self.state
        out = {}
        if s.router is not None:
            out[s.router.url + " (router)"] = s.router.error or "answering"
        for w in s.workers.values():
            out[w.url] = "in service" if w.in_service else (w.error or "out of service")
        if s.router is not None and not s.workers:
            out[s.router.url + " (router)"] = "GET /workers lists no workers"
        return out

    async def discover(self) -> None:
        """Workers behind the router (GET /workers), added to ours; ours are never dropped."""
        s = self.state
        try:
            r = await s.control.get(s.router.url + "/workers")
            found = [w["url"].rstrip("/") for w in r.json().get("workers", [])] if r.status_code == 200 else []
        except Exception as e:  # noqa: BLE001 - the router monitor reports the router's state
            log.debug("router %s: GET /workers failed: %s", s.router.url, e)
            return
        for url in found:
            if url not in s.workers:
                w = Worker(url, backoff=s.settings.probe_backoff_s)
                w.wake = asyncio.Event()
                s.workers[url] = w
                if self.monitoring:
                    s.spawn(self._monitor(w))

    async def _health(self, w: Worker) -> tuple[bool, str]:
        """(healthy, what the probe got); counts probes in a row with no answer in w.slow_probes."""
        import httpx

        timeout_s = self.state.settings.health_timeout_s
        try:
            r = await self.state.control.get(w.url + "/health_generate", timeout=timeout_s)
        except httpx.TimeoutException as e:
            w.slow_probes += 1
            return False, f"GET /health_generate: {describe_error(e, timeout_s)}"
        except httpx.HTTPError as e:
            return False, f"GET /health_generate: {describe_error(e, timeout_s)}"
        w.slow_probes = 0
        if r.status_code != 200:
            return False, f"GET /health_generate: {answer_text(r)}"
        return True, "ok"

    async def probe(self, w: Worker) -> bool:
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

    async def _bring_to_version(self, w: Worker) -> tuple[bool, str]:
        """Load the target version on a worker that serves another; under the push lock, so a
        push under way finishes first and the target is the one it set."""
        s = self.state
        async with s.push_lock:
            try:
                version = await worker_version(s.control, w.url, s.settings.health_timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure keeps the worker out
                return False, f"GET /model_info: {e}"
            target = s.target
            if target is not None and version != target[0]:
                if not os.path.isdir(target[1]):
                    return False, f"serves {version!r}; the current version's folder {target[1]} is gone"
                log.info("%s serves weight version %r; bringing it to %r", w.url, version, target[0])
                out = await push_to_worker(
                    s.control, w.url, target[1], target[0], mode="abort", timeout_s=s.settings.weight_push_timeout_s,
                    retries=0, backoff_s=s.settings.probe_backoff_s,
                )  # fmt: skip
                if not out.ok:
                    return False, f"weight update to {target[0]!r}: {out.error}"
                version = target[0]
            w.version = version
            # The adapters pushed since: a restarted worker has none, one that was only out of
            # service may lack the newest and still hold older ones (push_lora_to_worker drops them).
            for lora in list(s.loras.values()):
                if not os.path.isdir(lora.folder):
                    return False, f"the current adapter version's folder {lora.folder} is gone"
                out = await push_lora_to_worker(
                    s.control, w.url, lora.name, lora.served, lora.folder, keep=[lora.served], reload=False,
                    timeout_s=s.settings.weight_push_timeout_s, retries=0, backoff_s=s.settings.probe_backoff_s,
                )  # fmt: skip
                if not out.ok:
                    return False, f"adapter update to {lora.served!r}: {out.error}"
                w.version = lora.version
            return True, "ok"

    async def _put_in_service(self, w: Worker) -> None:
        s = self.state
        if s.router is not None and s.settings.manage_router_workers:
            await self._router_add(w)
        w.in_service, w.error, w.backoff = True, None, s.settings.probe_backoff_s
        s.stats["brought_back"] += 1
        log.info("%s is in service (weight version %s)", w.url, w.version)
        s.update_service()
        await s.notify()

    async def take_out(self, w: Worker, why: str) -> None:
        """Take a worker out of service (and out of the router); its monitor probes it with backoff."""
        s = self.state
        w.error = why
        w.failures += 1
        if not w.in_service:
            return
        w.in_service = False
        w.backoff = s.settings.probe_backoff_s
        s.stats["taken_out"] += 1
        log.warning("%s taken out of service: %s", w.url, why)
        s.update_service()
        if w.wake is not None:
            w.wake.set()
        if s.router is not None and s.settings.manage_router_workers:
            s.spawn(self._router_remove(w))
        await s.notify()

    async def request_failed(self, target: Worker, failure: str) -> None:
        """A request failed on `target` (a worker, or the router)."""
        s = self.state
        if target is not s.router:
            await self.take_out(target, failure)
            return
        # The router hides which worker failed: check them all now.
        for w in s.workers.values():
            if w.wake is not None:
                w.wake.set()
        import httpx

        if "connection failed" in failure:
            s.router.error = failure
            try:
                await s.control.get(s.router.url + "/health", timeout=s.settings.connect_timeout_s)
            except httpx.HTTPError as e:
                if s.router.in_service:
                    log.warning("router %s out of service: %s", s.router.url, describe_error(e))
                s.router.in_service, s.router.error = False, f"POST /generate: {describe_error(e)}"
                s.router.backoff = s.settings.probe_backoff_s
                s.update_service()
                s.router_wake.set()

    async def _monitor(self, w: Worker) -> None:
        """One worker's life: polled while in service (at once when woken: a request failed
        through the router), probed with backoff while out."""
        s = self.state
        while not s.closed:
            if w.in_service:
                await _sleep(w.wake, s.settings.health_interval_s)
                if not w.in_service:
                    continue
                ok, why = await self._health(w)
                if not ok and w.in_service and 0 < w.slow_probes < SLOW_PROBES_TO_FAIL:
                    log.info("%s: %s (once; it stays in service until the next probe)", w.url, why)
                elif not ok and w.in_service:
                    await self.take_out(w, why)
            else:
                w.wake.clear()
                await asyncio.sleep(w.backoff)
                if w.in_service or s.closed:
                    continue
                if not await self.probe(w):
                    w.backoff = min(w.backoff * 2, s.settings.probe_backoff_max_s)

    async def _router_monitor(self) -> None:
        import httpx

        s = self.state
        r = s.router
        while not s.closed:
            await _sleep(s.router_wake, s.settings.health_interval_s if r.in_service else r.backoff)
            try:
                resp = await s.control.get(r.url + "/health", timeout=s.settings.health_timeout_s)
                ok, why = resp.status_code == 200, f"GET /health: {answer_text(resp)}"
            except httpx.HTTPError as e:
                ok, why = False, f"GET /health: {describe_error(e, s.settings.health_timeout_s)}"
            if ok and not r.in_service:
                log.info("router %s answers again", r.url)
                r.in_service, r.error, r.backoff = True, None, s.settings.probe_backoff_s
                s.update_service()
                await s.notify()
            elif not ok:
                if r.in_service:
                    log.warning("router %s out of service: %s", r.url, why)
                    r.backoff = s.settings.probe_backoff_s
                else:
                    r.backoff = min(r.backoff * 2, s.settings.probe_backoff_max_s)
                r.in_service, r.error = False, why
                s.update_service()
                await s.notify()
            if not s.fixed_urls:
                await self.discover()

    async def _watchdog(self) -> None:
        """Fail the waiting requests once no worker has served for unhealthy_timeout_s."""
        s = self.state
        limit = s.settings.unhealthy_timeout_s
        while not s.closed:
            await asyncio.sleep(min(0.5, limit / 4))
            s.update_service()
            since = s.no_service_since
            if since is not None and s.unavailable is None:
                waited = time.monotonic() - since
                if waited >= limit:
                    s.unavailable = FleetUnavailable(self.answers(), waited)
                    log.error("%s", s.unavailable)
                    await s.notify()

    async def _router_workers(self) -> dict[str, str]:
        s = self.state
        r = await s.control.get(s.router.url + "/workers")
        return {w["url"].rstrip("/"): w["id"] for w in r.json().get("workers", [])} if r.status_code == 200 else {}

    async def _router_remove(self, w: Worker) -> None:
        s = self.state
        try:
            ids = await self._router_workers()
            if w.url in ids:
                await s.control.delete(f"{s.router.url}/workers/{ids[w.url]}")
        except Exception as e:  # noqa: BLE001 - the router's own health checks remain
            log.warning("router %s: could not remove %s: %s", s.router.url, w.url, e)

    async def _router_add(self, w: Worker) -> None:
        s = self.state
        try:
            if w.url not in await self._router_workers():
                r = await s.control.post(s.router.url + "/workers", json={"url": w.url})
                if r.status_code >= 300:
                    log.warning("router %s: adding %s answered %s", s.router.url, w.url, answer_text(r))
        except Exception as e:  # noqa: BLE001 - the client can still use the worker
            log.warning("router %s: could not add %s: %s", s.router.url, w.url, e)
