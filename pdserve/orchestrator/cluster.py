"""The instances of both roles: their readiness, what they told us about themselves, and their routers.

`LocalCluster` owns that state in this process: it probes every worker's /health every
health_check_interval, reads /v1/disagg_info and /v1/models once an instance is ready, and routes with
the configured routers. One orchestrator process uses it directly; a fleet's coordinator uses it on
behalf of every orchestrator process (coordinator.py has the remote side, `RemoteCluster`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.errors import OrchestratorError
from pdserve.orchestrator.kv_cache_aware import KvCacheAwareRouter
from pdserve.orchestrator.routers import NoReadyInstance, Route, RouteRequest, Router, make_router

log = logging.getLogger(__name__)

ROLES = ("context", "generation")
_PROBE_TIMEOUT_S = 2.0
# Probes in a row that must time out before a ready worker is taken out of routing. A busy worker can
# miss one 2 s probe (a CI run on two cores once saw it, with several instances' ranks on the machine),
# and taking out a context server for one slow answer fails every request meanwhile; a worker that is
# gone refuses the connection instead, and that counts at once.
_TIMEOUTS_BEFORE_UNREADY = 2


class LocalCluster:
    def __init__(self, cfg: DisaggConfig):
        self.cfg = cfg
        self.routers: dict[str, Router] = {
            "context": make_router(cfg.context_servers.urls, cfg.context_servers.router),
            "generation": make_router(cfg.generation_servers.urls, cfg.generation_servers.router)}
        self.disagg_info: dict[str, dict | None] = {}  # url -> /v1/disagg_info (None: the worker has none)
        self.models: dict[str, dict] = {}  # url -> its /v1/models answer
        self.status: dict[str, str] = {u: "starting" for r in self.routers.values() for u in r.urls}
        self._timeouts: dict[str, int] = {}  # url -> probes in a row that timed out
        self._task: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self.started_at = time.monotonic()

    async def start(self, http: httpx.AsyncClient) -> None:
        self._http = http
        for router in self.routers.values():
            await router.start(http)
        await self.probe_all()
        self._task = asyncio.ensure_future(self._probe_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for router in self.routers.values():
            await router.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop the probing for good
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        pairs = [(role, url) for role, r in self.routers.items() for url in r.urls]
        await asyncio.gather(*(self._probe(role, url) for role, url in pairs))

    async def _probe(self, role: str, url: str) -> None:
        router = self.routers[role]
        try:
            r = await self._http.get(url + "/health", timeout=_PROBE_TIMEOUT_S)
            ok = r.status_code == 200
            reason = "ready" if ok else f"/health answered {r.status_code}"
            if ok and url not in router.ready:  # (re)joining: it may have restarted with another config
                await self._learn(url)
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e or 'no answer'}"
            timed_out = isinstance(e, httpx.TimeoutException)
            self._timeouts[url] = self._timeouts.get(url, 0) + 1 if timed_out else 0
            if timed_out and url in router.ready and self._timeouts[url] < _TIMEOUTS_BEFORE_UNREADY:
                log.warning("%s server %s did not answer /health within %g s; still routed to until %d probes "
                            "in a row time out", role, url, _PROBE_TIMEOUT_S, _TIMEOUTS_BEFORE_UNREADY)
                return
        else:
            self._timeouts[url] = 0
        if ok != (url in router.ready):
            log.info("%s server %s is %s", role, url, "ready" if ok else f"not ready ({reason})")
        if ok and isinstance(router, KvCacheAwareRouter):
            info = self.disagg_info.get(url) or {}
            if info.get("tokens_per_block"):
                router.attach_events(url, info.get("kv_events_endpoint"), int(info["tokens_per_block"]))
        self.status[url] = reason
        router.set_ready(url, ok)

    async def _learn(self, url: str) -> None:
        models = await self._http.get(url + "/v1/models", timeout=_PROBE_TIMEOUT_S)
        models.raise_for_status()
        info = await self._http.get(url + "/v1/disagg_info", timeout=_PROBE_TIMEOUT_S)
        # A worker without the endpoint (404) can still serve conditional (local) requests.
        try:
            self.disagg_info[url] = info.json() if info.status_code == 200 else None
        except ValueError:
            self.disagg_info[url] = None
        self.models[url] = models.json()

    def mark_unreachable(self, role: str, url: str, reason: str) -> None:
        self.routers[role].set_ready(url, False)
        self.status[url] = reason

    def _no_ready(self, role: str) -> OrchestratorError:
        why = "; ".join(f"{u}: {self.status.get(u, 'starting')}" for u in self.routers[role].urls)
        return OrchestratorError(503, f"no ready {role} server ({why})", "no_ready_instance")

    # -- the routing interface the orchestrator uses (RemoteCluster has the same) --------------------

    async def select(self, role: str, req: RouteRequest) -> Route:
        try:
            return self.routers[role].select(req)
        except NoReadyInstance:
            raise self._no_ready(role) from None

    async def finish(self, role: str, url: str, req: RouteRequest) -> None:
        self.routers[role].finish(url, req)

    async def unreachable(self, role: str, url: str, reason: str) -> None:
        self.mark_unreachable(role, url, reason)

    def ready_urls(self, role: str) -> list[str]:
        router = self.routers[role]
        return [u for u in router.urls if u in router.ready]

    def needs_tokens(self, role: str) -> bool:
        rc = self.routers[role].config
        return rc.type == "kv_cache_aware" or (rc.type == "load_balancing" and rc.option("metric") == "tokens")

    def model_list(self) -> dict | None:
        for url in self.ready_urls("generation") + self.ready_urls("context"):
            if url in self.models:
                return self.models[url]
        return None

    async def cluster_info(self) -> dict[str, Any]:
        def role_info(role: str) -> dict:
            snap = self.routers[role].snapshot()
            for inst in snap["instances"]:
                inst["status"] = self.status.get(inst["url"])
                inst["disagg_info"] = self.disagg_info.get(inst["url"])
            return snap

        return {"schedule_style": self.cfg.schedule_style,
                "conditional_disagg": self.cfg.conditional_disagg.model_dump() if self.cfg.conditional_disagg else None,
                "context_servers": role_info("context"), "generation_servers": role_info("generation"),
                "models": self.model_list(), "uptime_s": round(time.monotonic() - self.started_at, 3)}
