"""The orchestrator's HTTP surface (FastAPI) and `run_orchestrator`.

Open: GET /health (200 once each role has minimal_instances ready, else 503 naming what is missing).
Internal (the cluster token when one is set): GET /cluster_info; POST /cluster/join, /cluster/heartbeat,
/cluster/leave (membership.py: the token, or a member's proof of it, good once and within a window of
its time, pdserve/cluster_auth.py); GET
/metrics, else open.
Everything else (the API key when one is set): POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, and /cluster_info when no cluster token is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.cluster_auth import (PROOF_HEADER, TOKEN_HEADER, NoncesFull, ProofRefused, WrongToken, check_proof,
                                  token_ok)
from pdserve.config import HTTP_KEEP_ALIVE_S
from pdserve.orchestrator.cluster import ROLES, LocalCluster
from pdserve.orchestrator.config import DisaggConfig, server_url
from pdserve.orchestrator.errors import NOT_A_WORKER, NOT_A_WORKER_MESSAGE, OrchestratorError
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.orchestrator.orchestrator import CHAT, COMPLETIONS, Orchestrator
from pdserve.orchestrator.request_id import RequestIdGenerator
from pdserve.orchestrator.upstream import make_client
from pdserve.server.body_limit import BodyLimitMiddleware
from pdserve.server.json_body import MalformedBody, parse_json_body
from pdserve.server.read_timeout import http_protocol
from pdserve.server.streaming import ClosingStreamingResponse
from pdserve.tls import client_verify

log = logging.getLogger(__name__)

CLUSTER_TOKEN_HEADER = TOKEN_HEADER.lower()  # as ASGI spells header names
MEMBERSHIP_PATHS = ("/cluster/join", "/cluster/heartbeat", "/cluster/leave")
INTERNAL_PATHS = ("/cluster_info", "/metrics", *MEMBERSHIP_PATHS)
OPEN_PATHS = ("/health", "/metrics")  # /metrics: open unless a cluster token is set, as on the workers
CLIENT_CLOSED = 499


class AuthMiddleware:
    """Pure ASGI, checked before the body is read, so a 401 wins over every other error:
    - an internal path needs X-Cluster-Token when a cluster token is set (the API key is then not enough:
      it is the clients' key, and /cluster_info lists every worker and KV endpoint);
    - a membership path with a cluster token set is its route's to check (`member_auth`): a member
      proves the token with an HMAC over the body's url, so the body must be read first;
    - else an open path needs nothing;
    - else, when an API key is set, the path needs 'Authorization: Bearer <api_key>'."""

    def __init__(self, app, api_key: str | None, cluster_token: str | None, internal_paths=INTERNAL_PATHS,
                 open_paths=OPEN_PATHS):
        self.app, self.internal_paths, self.open_paths = app, internal_paths, open_paths
        self.api_key = api_key.encode() if api_key else None
        self.cluster_token = cluster_token.encode() if cluster_token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self._refusal(scope["path"], dict(scope["headers"]))
            if err is not None:
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> OrchestratorError | None:
        if self.cluster_token is not None and path in MEMBERSHIP_PATHS:
            return None
        if self.cluster_token is not None and path in self.internal_paths:
            if secrets.compare_digest(headers.get(CLUSTER_TOKEN_HEADER.encode(), b""), self.cluster_token):
                return None
            return OrchestratorError(401, "missing or incorrect cluster token: send the header "
                                          "'X-Cluster-Token: <cluster_token>'", "invalid_cluster_token")
        if self.api_key is None or path in self.open_paths:
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key):
            return None
        return OrchestratorError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                                 "invalid_api_key")


def build_app(cfg: DisaggConfig, *, process_id: int = 0, cluster=None) -> FastAPI:
    """The orchestrator app. `cluster` defaults to a LocalCluster (one process owns routing); a fleet
    worker passes a RemoteCluster. The pooled HTTP client lives as long as the app."""
    metrics = OrchestratorMetrics()
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        http = make_client(cfg.request_timeout, worker_api_key=cfg.worker_api_key,
                           verify=client_verify(cfg.ssl_ca_file))
        c = cluster if cluster is not None else LocalCluster(cfg, metrics)
        await c.start(http)
        state["cluster"] = c
        state["orchestrator"] = Orchestrator(cfg, c, http, RequestIdGenerator(cfg.node_id, process_id), metrics)
        try:
            yield
        finally:
            await c.close()
            await http.aclose()

    app = FastAPI(title="pdserve orchestrator", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_mb=cfg.max_request_body_mb)
    app.add_middleware(AuthMiddleware, api_key=cfg.api_key, cluster_token=cfg.cluster_token)
    app.state.metrics = metrics

    @app.exception_handler(OrchestratorError)
    async def on_error(_: Request, e: OrchestratorError):
        metrics.client_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception):
        log.exception("unhandled error in a request")
        metrics.client_errors.labels("500").inc()
        err = OrchestratorError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
        return JSONResponse(err.body(), status_code=500)

    async def proxy(api: str, request: Request):
        try:
            body = await parse_json_body(await request.body())
        except MalformedBody as e:
            raise OrchestratorError(400, e.message, e.code, e.param) from None
        if not isinstance(body.get("stream", False), bool):
            raise OrchestratorError(400, f"invalid value for 'stream': expected a boolean, got {body['stream']!r}",
                                    "invalid_value", "stream")
        metrics.in_flight.inc()
        work = state["orchestrator"].serve(api, body, request.headers.get("x-conversation-id"))
        try:
            result = await _unless_disconnected(request, work)
        except BaseException:
            metrics.in_flight.dec()
            raise
        if result is None:
            metrics.in_flight.dec()
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(result, dict):
            metrics.in_flight.dec()
            return JSONResponse(result)
        # Closes the relay (worker stream, route) and counts the request out however the client leaves.
        return ClosingStreamingResponse(result, on_close=metrics.in_flight.dec)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await proxy(COMPLETIONS, request)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await proxy(CHAT, request)

    @app.get("/v1/models")
    async def models():
        listing = state["cluster"].model_list()
        if listing is None:
            raise OrchestratorError(503, "no worker is ready yet, so the served model is unknown", "no_ready_instance")
        return listing

    @app.get("/v1/disagg_info")
    async def not_a_worker():
        """What a worker answers with its KV layout, an orchestrator answers with this: an orchestrator
        listed (or joined) as a member of another, or of itself, is refused by name."""
        raise OrchestratorError(404, NOT_A_WORKER_MESSAGE, NOT_A_WORKER)

    @app.get("/health")
    async def health():
        missing = state["cluster"].roles_below_minimum()
        if missing:
            err = OrchestratorError(503, f"not enough ready {' or '.join(missing)} servers yet", "no_ready_instance")
            return JSONResponse(err.body(), status_code=503, headers=err.headers())
        return {"status": "ok"}

    app.include_router(membership_routes(lambda: state["cluster"], cfg.cluster_token))

    @app.get("/cluster_info")
    async def cluster_info():
        return JSONResponse(await state["cluster"].cluster_info(),
                            headers={"X-Pdserve-Process": f"{os.getpid()}:{process_id}"})

    @app.get("/metrics")
    async def prometheus():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app


def membership_routes(cluster, cluster_token: str | None) -> APIRouter:
    """POST /cluster/join {role, url}, /cluster/heartbeat {url}, /cluster/leave {url} over `cluster()`
    (a LocalCluster, or a fleet worker's RemoteCluster, which forwards them to the coordinator). With a
    `cluster_token`, each needs it (X-Cluster-Token) or a member's proof of it for that url (X-Cluster-Proof)."""
    router = APIRouter()

    async def fields(request: Request, *names: str) -> list:
        if cluster_token is not None and not (request.headers.get(TOKEN_HEADER) or request.headers.get(PROOF_HEADER)):
            raise _no_cluster_token(request.url.path)  # before the body: a 401 wins over a 400
        try:
            body = await parse_json_body(await request.body())
        except MalformedBody as e:
            raise OrchestratorError(400, e.message, e.code, e.param) from None
        out = []
        for name in names:
            value = body.get(name)
            if name == "role" and value not in ROLES:
                raise OrchestratorError(400, f"role must be one of {ROLES}, got {value!r}", "invalid_value", "role")
            if name == "url":
                try:
                    value = server_url(value)
                except ValueError as e:
                    raise OrchestratorError(400, str(e), "invalid_value", "url") from None
            out.append(value)
        return out

    async def member_auth(request: Request, purpose: str, *parts: str) -> None:
        """The token itself (an operator, a fleet process), or a member's proof that is good and never
        taken before (its nonce new to the store that every process of this cluster shares)."""
        if cluster_token is None or token_ok(cluster_token, request.headers.get(TOKEN_HEADER)):
            return
        path = request.url.path
        if not request.headers.get(PROOF_HEADER):  # another X-Cluster-Token
            raise _no_cluster_token(path)
        try:
            fresh = check_proof(cluster_token, request.headers, purpose, *parts)
        except WrongToken:
            raise _no_cluster_token(path) from None
        except ProofRefused as e:
            raise _bad_proof(path, str(e)) from None
        try:
            first = await cluster().first_use(fresh.nonce, fresh.remember_s)
        except NoncesFull as e:
            raise OrchestratorError(503, str(e), "too_many_membership_calls") from None
        if not first:
            raise _bad_proof(path, "this proof was taken already (a replay): a member signs every call with a "
                                   "fresh nonce")

    @router.post("/cluster/join")
    async def join(request: Request):
        role, url = await fields(request, "role", "url")
        await member_auth(request, "join", role, url)
        return await cluster().join(role, url)

    @router.post("/cluster/heartbeat")
    async def heartbeat(request: Request):
        (url,) = await fields(request, "url")
        await member_auth(request, "heartbeat", url)
        return await cluster().heartbeat(url)

    @router.post("/cluster/leave")
    async def leave(request: Request):
        (url,) = await fields(request, "url")
        await member_auth(request, "leave", url)
        return {"left": await cluster().leave(url)}

    return router


def _bad_proof(path: str, why: str) -> OrchestratorError:
    """A member's proof refused for its use (time, nonce, replay), not for its token."""
    return OrchestratorError(401, f"{path} refused a member's proof: {why}", "invalid_cluster_proof")


def _no_cluster_token(path: str) -> OrchestratorError:
    return OrchestratorError(
        401, f"{path} needs the cluster's cluster_token, and this request holds none or another: a worker proves it "
             "when its cache_transceiver_config.cluster_token is the orchestrator's cluster_token (pdserve launch "
             "writes the one it made to the file cluster_token in its log directory); an operator may send "
             "'X-Cluster-Token: <cluster_token>'", "invalid_cluster_token")


async def _unless_disconnected(request: Request, work):
    """Await `work`; None if the client went away first (the work is cancelled, which closes any
    worker connection and so aborts the worker's request)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The listening socket; with reuse_port every fleet worker binds the same port and the kernel
    spreads connections across them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (choose another port)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def run_app(app, sock: socket.socket, client_read_timeout_s: float, *, graceful_shutdown_s: float = 5.0,
            ssl: dict | None = None) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM (uvicorn handles both and returns); `ssl`: uvicorn's
    keyword arguments for https (pdserve/tls.py)."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_shutdown_s,
                                           timeout_keep_alive=HTTP_KEEP_ALIVE_S,
                                           http=http_protocol(client_read_timeout_s), **(ssl or {})))
    server.run(sockets=[sock])
