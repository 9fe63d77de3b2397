"""Coordinator + fleet: N stateless orchestrator processes, one owner of the cluster state.

    client ─> :port (SO_REUSEPORT) ─> orchestrator process i ──/select /finish──> coordinator (:port-1)
                                                                                     owns the routers,
                                                                                     worker readiness,
                                                                                     KV event indexes

The coordinator is a LocalCluster behind HTTP: POST /select, /finish, /unreachable, the membership
calls /cluster/join, /cluster/heartbeat, /cluster/leave, /cluster/nonce (a member's proof checked in a
process is taken once in the whole fleet: its nonce is new to the coordinator); GET /cluster_info, /health. Orchestrator
processes reach it through `RemoteCluster`, which has LocalCluster's routing and membership interface
(a worker may join through any orchestrator process). round_robin needs no shared state, so a role
routed round-robin is routed in each process (no coordinator hop); its instances and their readiness
still come from the coordinator, synced every health_check_interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.cluster_auth import MAX_NONCE_CHARS, PROOF_WINDOW_S, NoncesFull
from pdserve.orchestrator.app import CLUSTER_TOKEN_HEADER, MEMBERSHIP_PATHS, AuthMiddleware, membership_routes
from pdserve.orchestrator.cluster import ROLES, LocalCluster
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.errors import OrchestratorError
from pdserve.orchestrator.routers import NoReadyInstance, RoundRobinRouter, Route, RouteRequest
from pdserve.orchestrator.upstream import make_client
from pdserve.server.body_limit import BodyLimitMiddleware
from pdserve.tls import client_verify

log = logging.getLogger(__name__)

COORDINATOR_PATHS = ("/select", "/finish", "/unreachable", "/cluster_info", "/cluster/nonce", *MEMBERSHIP_PATHS)


class CoordinatorUnreachable(Exception):
    pass


def build_coordinator_app(cfg: DisaggConfig) -> FastAPI:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        http = make_client(cfg.request_timeout, worker_api_key=cfg.worker_api_key,
                           verify=client_verify(cfg.ssl_ca_file))
        cluster = LocalCluster(cfg)
        await cluster.start(http)
        state["cluster"] = cluster
        try:
            yield
        finally:
            await cluster.close()
            await http.aclose()

    app = FastAPI(title="pdserve coordinator", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_mb=cfg.max_request_body_mb)
    app.add_middleware(AuthMiddleware, api_key=None, cluster_token=cfg.cluster_token, internal_paths=COORDINATOR_PATHS)
    started = time.time()

    @app.exception_handler(OrchestratorError)
    async def on_error(_: Request, e: OrchestratorError):
        return JSONResponse(e.body(), status_code=e.status)

    def role_of(data: dict) -> str:
        role = data.get("role")
        if role not in ROLES:
            raise OrchestratorError(400, f"role must be one of {ROLES}, got {role!r}", "invalid_value", "role")
        return role

    @app.post("/select")
    async def select(request: Request):
        data = await request.json()
        route = await state["cluster"].select(role_of(data), RouteRequest.from_json(data.get("request") or {}))
        return {"url": route.url, "matched_blocks": route.matched_blocks, "tokens_per_block": route.tokens_per_block}

    @app.post("/finish")
    async def finish(request: Request):
        data = await request.json()
        cluster: LocalCluster = state["cluster"]
        role, url = role_of(data), data.get("url")
        if not isinstance(url, str):
            raise OrchestratorError(400, f"url must be a string, got {url!r}", "invalid_value", "url")
        await cluster.finish(role, url, RouteRequest.from_json(data.get("request") or {}))  # one that left: no-op
        return {"status": "ok"}

    @app.post("/unreachable")
    async def unreachable(request: Request):
        data = await request.json()
        state["cluster"].mark_unreachable(role_of(data), data.get("url"), str(data.get("reason")))
        return {"status": "ok"}

    @app.post("/cluster/nonce")
    async def nonce(request: Request):
        data = await request.json()
        nonce, remember_s = data.get("nonce"), data.get("remember_s")
        if not isinstance(nonce, str) or not 0 < len(nonce) <= MAX_NONCE_CHARS:
            raise OrchestratorError(400, f"nonce must be a string of 1 to {MAX_NONCE_CHARS} characters",
                                    "invalid_value", "nonce")
        if not isinstance(remember_s, (int, float)) or not 0 < remember_s <= 2 * PROOF_WINDOW_S:
            raise OrchestratorError(400, f"remember_s must be in (0, {2 * PROOF_WINDOW_S:g}]", "invalid_value",
                                    "remember_s")
        try:
            return {"first": await state["cluster"].first_use(nonce, float(remember_s))}
        except NoncesFull as e:
            raise OrchestratorError(503, str(e), "too_many_membership_calls") from None

    @app.get("/cluster_info")
    async def cluster_info():
        info = await state["cluster"].cluster_info()
        info["coordinator"] = {"pid": os.getpid(), "started_at": started}
        return info

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.include_router(membership_routes(lambda: state["cluster"], cfg.cluster_token))
    return app


def wait_for_coordinator(url: str, timeout_s: float, cluster_token: str | None) -> dict:
    """Probe GET /cluster_info until it answers, with backoff, for at most timeout_s; its answer, or
    CoordinatorUnreachable with a message that says what to fix."""
    headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
    deadline = time.monotonic() + timeout_s
    delay, last = 0.05, "no attempt"
    while True:
        try:
            r = httpx.get(url + "/cluster_info", headers=headers, timeout=min(2.0, timeout_s), trust_env=False)
            if r.status_code == 200:
                return r.json()
            if r.status_code == 401:
                raise CoordinatorUnreachable(f"the coordinator at {url} refused our cluster token (401): "
                                             "every process must use the same cluster_token")
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e or 'no answer'}"
        if time.monotonic() + delay > deadline:
            raise CoordinatorUnreachable(
                f"cannot reach the disaggregation coordinator at {url} within server_start_timeout={timeout_s:g} s "
                f"(last error: {last}); start it first, or fix disagg_coordinator_url / the port")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


class RemoteCluster:
    """LocalCluster's routing interface, backed by the coordinator (see the module docstring)."""

    def __init__(self, cfg: DisaggConfig, url: str):
        self.cfg, self.url = cfg, url.rstrip("/")
        self.headers = {CLUSTER_TOKEN_HEADER: cfg.cluster_token} if cfg.cluster_token else {}
        groups = {"context": cfg.context_servers, "generation": cfg.generation_servers}
        self.local = {role: RoundRobinRouter(g.urls, g.router) for role, g in groups.items()
                      if g.router.type == "round_robin"}
        self.router_types = {role: g.router for role, g in groups.items()}
        self._ready: dict[str, list[str]] = {r: [] for r in ROLES}
        self._models: dict | None = None
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    async def start(self, http: httpx.AsyncClient) -> None:
        self._http = http
        await self._sync()
        self._task = asyncio.ensure_future(self._sync_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval)
            try:
                await self._sync()
            except OrchestratorError as e:
                log.warning("readiness sync with the coordinator failed: %s", e)
            except Exception:  # a bug here must not stop the syncing for good
                log.exception("readiness sync with the coordinator failed")

    async def _sync(self) -> None:
        # bounded well below the default 10 s: readiness must not go stale behind one stuck call
        info = await self._call("GET", "/cluster_info", timeout=max(1.0, 3 * self.cfg.health_check_interval))
        self._models = info.get("models")
        for role in ROLES:
            instances = [i["url"] for i in info[f"{role}_servers"]["instances"]]
            ready = [i["url"] for i in info[f"{role}_servers"]["instances"] if i["ready"]]
            self._ready[role] = ready
            if role in self.local:
                router = self.local[role]
                for u in instances:
                    router.add(u)  # joined since the last sync
                for u in [u for u in router.urls if u not in instances]:
                    await router.remove(u)  # left or lost
                for u in router.urls:
                    router.set_ready(u, u in ready)

    async def _call(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
        try:
            r = await self._http.request(method, self.url + path, json=body, headers=self.headers, timeout=timeout)
        except httpx.HTTPError as e:
            raise OrchestratorError(503, f"the coordinator at {self.url} is unreachable ({type(e).__name__}: {e})",
                                    "coordinator_unreachable") from None
        if r.status_code != 200:
            try:
                err = r.json()["error"]
                raise OrchestratorError(r.status_code, err["message"], err.get("code"))
            except (ValueError, KeyError, TypeError):
                raise OrchestratorError(502, f"the coordinator answered {path} with {r.status_code}",
                                        "coordinator_error") from None
        return r.json()

    async def select(self, role: str, req: RouteRequest) -> Route:
        if role in self.local:
            for attempt in range(2):
                try:
                    return self.local[role].select(req)
                except NoReadyInstance:
                    if attempt == 0:  # an instance may have joined since the last sync: ask once
                        await self._sync()
            raise OrchestratorError(503, f"no ready {role} server (as of the last sync with the coordinator)",
                                    "no_ready_instance")
        data = await self._call("POST", "/select", {"role": role, "request": req.to_json()})
        return Route(data["url"], int(data.get("matched_blocks") or 0), data.get("tokens_per_block"))

    async def finish(self, role: str, url: str, req: RouteRequest) -> None:
        if role in self.local:
            self.local[role].finish(url, req)
            return
        try:
            await self._call("POST", "/finish", {"role": role, "url": url, "request": req.to_json()})
        except OrchestratorError as e:  # the answer is already with the client; only load accounting drifts
            log.warning("could not report a finished %s request on %s to the coordinator: %s", role, url, e)

    async def unreachable(self, role: str, url: str, reason: str) -> None:
        if role in self.local:
            self.local[role].set_ready(url, False)
        if url in self._ready[role]:
            self._ready[role].remove(url)
        try:
            await self._call("POST", "/unreachable", {"role": role, "url": url, "reason": reason})
        except OrchestratorError as e:
            log.warning("could not report unreachable %s to the coordinator: %s", url, e)

    def ready_urls(self, role: str) -> list[str]:
        return list(self._ready[role])

    def roles_below_minimum(self) -> list[str]:
        minimal = self.cfg.minimal_instances
        return [role for role in ROLES if len(self._ready[role]) < minimal[role]]

    async def join(self, role: str, url: str) -> dict:
        answer = await self._call("POST", "/cluster/join", {"role": role, "url": url})
        await self._sync()
        return answer

    async def heartbeat(self, url: str) -> dict:
        return await self._call("POST", "/cluster/heartbeat", {"url": url})

    async def leave(self, url: str) -> bool:
        left = (await self._call("POST", "/cluster/leave", {"url": url}))["left"]
        await self._sync()
        return left

    async def first_use(self, nonce: str, remember_s: float) -> bool:
        return (await self._call("POST", "/cluster/nonce", {"nonce": nonce, "remember_s": remember_s}))["first"]

    def needs_tokens(self, role: str) -> bool:
        rc = self.router_types[role]
        return rc.type == "kv_cache_aware" or (rc.type == "load_balancing" and rc.option("metric") == "tokens")

    def model_list(self) -> dict | None:
        return self._models

    async def cluster_info(self) -> dict:
        return await self._call("GET", "/cluster_info")
