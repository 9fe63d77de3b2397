"""The FastAPI app: routes, API-key check, error handlers, and `run_server`.

Routes only parse, delegate to `OpenAIServing`, and wrap the answer; every failure leaves as an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` (see errors.py for the codes).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import signal
import socket
import threading
import time
from typing import Any, Awaitable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.cluster_auth import NONCE_HEADER, TOKEN_HEADER, member_proof, token_ok
from pdserve import tls
from pdserve.config import HTTP_KEEP_ALIVE_S, WorkerConfig
from pdserve.host import host_id
from pdserve.server.body_limit import BodyLimitMiddleware
from pdserve.server.errors import APIError
from pdserve.server.json_body import MalformedBody, parse_json_body
from pdserve.server.read_timeout import http_protocol
from pdserve.server.membership import ClusterMember
from pdserve.server.metrics import ServerMetrics
from pdserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ReleaseKVRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.server.serving import OpenAIServing
from pdserve.server.streaming import ClosingStreamingResponse

log = logging.getLogger(__name__)

# Status for a client that went away before its non-streaming answer was ready (nginx's convention;
# nobody receives it, it only shows in the access log).
CLIENT_CLOSED = 499
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Open even with an API key: load balancers probe /health, Prometheus scrapes /metrics (as vLLM leaves
# it open). Everything else, /tokenize and /detokenize included, needs the key.
OPEN_PATHS = ("/health", "/metrics")
# With a cluster token, only a holder of it may use these (and send disaggregated_params): the cluster's
# orchestrator. They read and free other requests' KV (docs/deploy.md, "Trust model").
CLUSTER_PATH_PREFIX = "/v1/disagg/"


def build_app(engine, cfg: WorkerConfig) -> FastAPI:
    """An app over a running `AsyncEngine`. The app never shuts the engine down; its owner does."""
    app = FastAPI(title="pdserve", summary="OpenAI-compatible LLM server")
    app.router.route_class = StrictJSONRoute
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, metrics)
    app.state.metrics = metrics
    app.state.serving = serving
    _chain_step_hook(engine, "on_step", metrics.on_step)
    _chain_step_hook(engine, "on_step_record", metrics.on_step_record)

    app.add_middleware(BodyLimitMiddleware, max_mb=cfg.max_request_body_mb)
    cluster_token = cfg.cache_transceiver_config.cluster_token
    if cluster_token:  # outside the body limit: a 401 wins over a 413
        app.add_middleware(ClusterTokenMiddleware, cluster_token=cluster_token)
    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key)

    def authorize_disagg(body, request: Request) -> None:
        """A request's own disaggregated_params reach into other requests' KV: the cluster's only."""
        if cluster_token and body.disaggregated_params is not None \
                and not token_ok(cluster_token, request.headers.get(TOKEN_HEADER)):
            raise _cluster_token_refusal("disaggregated_params")
    v1 = APIRouter(prefix="/v1", route_class=StrictJSONRoute)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(MalformedBody)
    async def on_malformed_body(_: Request, e: MalformedBody):
        return JSONResponse(APIError(400, e.message, e.param, e.code).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError):
        return JSONResponse(validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception):
        log.exception("unhandled error in a request")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorize_disagg(body, request)
        return await _answer(request, serving.completions(body))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        authorize_disagg(body, request)
        return await _answer(request, serving.chat(body))

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)])

    @v1.get("/disagg_info")
    async def disagg_info(request: Request):
        """What an orchestrator needs to route to this worker (docs/disaggregation.md); with a cluster
        token, and the orchestrator's challenge in X-Cluster-Nonce, also the proof that it holds the token."""
        ecfg = engine.ecfg
        nonce = request.headers.get(NONCE_HEADER)
        proof = {"holds_cluster_token": True, "cluster_proof": member_proof(cluster_token, nonce) if nonce else None} \
            if cluster_token else {}
        return {**proof, "model": engine.model_name, "tokens_per_block": ecfg.tokens_per_block,
                "ctx_info_endpoint": engine.kv_endpoint,
                "kv_events_endpoint": engine.kv_events.endpoint if engine.kv_events else None,
                "backend": ecfg.cache_transceiver_config.backend,
                "tensor_parallel_size": ecfg.tensor_parallel_size,
                "pipeline_parallel_size": ecfg.pipeline_parallel_size, "max_model_len": engine.max_model_len,
                "host_id": host_id()}

    @v1.post("/disagg/release")
    async def release_kv(body: ReleaseKVRequest):
        """Free an answered context_only request's KV now rather than after kv_transfer_timeout_ms: its
        client went away or its generation half failed. Idempotent; released is false when this worker
        holds nothing for the id (already pulled, never here, or its context_only answer is still due)."""
        released = await engine.call(lambda e: e.release_kv(body.disagg_request_id))
        return {"disagg_request_id": body.disagg_request_id, "released": released}

    @v1.get("/kv_blocks")
    async def kv_blocks():
        if engine.kv_events is None:
            raise APIError(404, "KV events are off on this worker: set kv_events_port in its config")
        seq, hashes = engine.kv_events.snapshot()
        return {"seq": seq, "block_hashes": hashes}

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return serving.detokenize(body)

    @app.get("/health")
    async def health():
        if engine.error:
            return JSONResponse(APIError(503, f"engine is not running: {engine.error}").body(), status_code=503)
        if serving.draining:
            body = APIError(503, "draining: finishing its requests before it shuts down", code="draining").body()
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `parse_json_body` (json_body.py) before FastAPI reads it,
    so NaN, lone surrogates or deep nesting are a 400 naming the field, whatever the content type. A
    JSON body is taken under any content type (none, `curl -d`'s form type, text/plain), as the
    orchestrator takes it: FastAPI would hand such a body on as bytes, and the client would read that
    its JSON object is not one."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def parse_first(request: Request):
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
            request = _ParsedRequest(scope, request.receive)
            request.parsed = await parse_json_body(await request.body())
            return await handler(request)

        return parse_first


class _ParsedRequest(Request):
    parsed: dict[str, Any]

    async def json(self) -> dict[str, Any]:
        return self.parsed


class ApiKeyMiddleware:
    """Pure ASGI (it never touches the body or the stream): every path but OPEN_PATHS needs
    'Authorization: Bearer <key>', checked before the body is parsed, so a 401 wins over every other error."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                err = APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClusterTokenMiddleware:
    """Pure ASGI: every path under CLUSTER_PATH_PREFIX needs 'X-Cluster-Token: <cluster_token>'."""

    def __init__(self, app, cluster_token: str):
        self.app, self.token = app, cluster_token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(CLUSTER_PATH_PREFIX):
            if not token_ok(self.token, dict(scope["headers"]).get(TOKEN_HEADER.lower().encode())):
                err = _cluster_token_refusal(scope["path"])
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _cluster_token_refusal(what: str) -> APIError:
    return APIError(401, f"{what} is for the cluster's orchestrator only: this worker has a cluster_token, and the "
                         f"request holds none or another in the header '{TOKEN_HEADER}: <cluster_token>'",
                    TOKEN_HEADER if what.startswith("/") else what, "invalid_cluster_token")


# pydantic names the members of a union in the error location ("prompt", "list[int]", 0).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|\w+\[.*\])$")


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Pydantic's error list -> one 400 naming the first bad field and what was expected."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "a JSON decode error")
        where = f" at character {loc[0]}" if loc else ""
        return APIError(400, f"the request body is not valid JSON: {detail}{where}", code="invalid_json")
    tag_at = next((i for i, part in enumerate(loc) if _UNION_TAG.match(part)), None)
    if tag_at is not None:  # a union field: list the accepted shapes instead of the first member's complaint
        field = ".".join(loc[:tag_at])
        shapes = []
        for e in errors:
            parts = [str(p) for p in e.get("loc", ()) if p != "body"]
            if parts[:tag_at] == loc[:tag_at] and len(parts) > tag_at and parts[tag_at] not in shapes:
                shapes.append(parts[tag_at])
        return APIError(400, f"invalid value for '{field}': expected one of {', '.join(shapes)}, got "
                             f"{_show(err.get('input'))}", field, "invalid_value")
    field = ".".join(loc)
    if err.get("type") == "missing":
        return APIError(400, f"missing required field '{field}'", field or None, "missing_field")
    if not field:
        return APIError(400, f"the request body must be a JSON object: {err.get('msg')}", code="invalid_body")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, f"invalid value for '{field}': {err.get('msg')}, got {_show(err.get('input'))}{more}",
                    field, "invalid_value")


def _show(value: Any) -> str:
    if isinstance(value, (str, list, dict)) and len(value) > 80:  # not repr'd: it may be 30 MiB of JSON
        return f"{type(value).__name__} of length {len(value)}"
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"{type(value).__name__} of length {len(value)}" if hasattr(value, "__len__") else text[:77] + "..."


async def _answer(request: Request, work: Awaitable):
    """Await the serving call; a stream becomes SSE. A non-streaming call is cancelled (aborting the
    engine request) if the client disconnects first: Starlette does that for streams, not for these."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown): never leave work running
        disconnect.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)  # let the abort run to completion
        return Response(status_code=CLIENT_CLOSED)
    result = task.result()
    if hasattr(result, "__aiter__"):
        return ClosingStreamingResponse(result)  # closing it aborts the request, even if it never streamed
    return result


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _chain_step_hook(engine, name: str, hook) -> None:
    """Install `hook` as the engine's hook `name`, keeping any hook already there (e.g. a second app)."""
    previous = getattr(engine, name)

    def both(arg):
        previous(arg)
        hook(arg)

    setattr(engine, name, both if previous is not None else hook)


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads: a port in use is then an error at
    once, not after the whole start-up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None
    return sock


class DrainingServer(uvicorn.Server):
    """The first SIGTERM or SIGINT drains: /health and new requests answer 503 `draining` (an
    orchestrator routes elsewhere at once), while running requests, and the KV transfers they started,
    finish, for at most `drain_timeout_s`. Then uvicorn shuts down as usual. A second signal, or a
    drain_timeout_s of 0, stops at once."""

    def __init__(self, config: uvicorn.Config, serving, engine, drain_timeout_s: float):
        super().__init__(config)
        self.serving, self.engine, self.drain_timeout_s = serving, engine, drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.serving.draining or self.drain_timeout_s <= 0:
            super().handle_exit(sig, frame)
            return
        self.serving.draining = True
        self._captured_signals.append(sig)  # re-raised after run(), as uvicorn does for its own
        threading.Thread(target=self.drain, name="pdserve-drain", daemon=True).start()

    def drain(self) -> None:
        start = time.monotonic()
        log.info("draining: no new requests; waiting up to %g s for running requests and KV transfers",
                 self.drain_timeout_s)
        while time.monotonic() - start < self.drain_timeout_s and _busy(self.engine.stats):
            time.sleep(0.05)
        left = self.engine.stats
        if _busy(left):
            log.warning("drain timed out after %g s with %s; shutting down anyway", self.drain_timeout_s, left)
        else:
            log.info("drained in %.2f s", time.monotonic() - start)
        self.should_exit = True


def _own_url(host: str, port: int, scheme: str = "http") -> str:
    """This server's url as seen from this machine (a wildcard bind is reached on the loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _busy(stats: dict) -> bool:
    return bool(stats.get("running") or stats.get("waiting") or stats.get("parked"))


def _stop_when_the_engine_dies(engine, server: uvicorn.Server) -> None:
    """A dead step loop is not recovered in place: the server stops (its clients have had their errors)
    rather than answer 503 for as long as the process lives, which no supervisor would restart."""
    def stop(error: str) -> None:
        log.error("the engine's step loop died (%s): stopping the server", error)
        server.should_exit = True

    engine.on_death = stop
    if engine.error:  # it died before the hook was in place
        stop(engine.error)


def run_server(engine, cfg: WorkerConfig, *, graceful_shutdown_s: float = 10.0,
               sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM, or until the engine's step loop dies (the caller then exits non-zero,
    see `engine.error`); then stop accepting, give in-flight requests `graceful_shutdown_s`
    to finish, and return normally. The caller owns the engine and shuts it down afterwards (with TP/PP
    that stops the other ranks' processes, so the signal must not kill this process first). `sock`: a
    socket from `bind_listener` (else uvicorn binds cfg.host:cfg.port itself)."""
    app = build_app(engine, cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info",
                            timeout_graceful_shutdown=graceful_shutdown_s, timeout_keep_alive=HTTP_KEEP_ALIVE_S,
                            http=http_protocol(cfg.client_read_timeout_s),
                            **tls.uvicorn_ssl(cfg.ssl_keyfile, cfg.ssl_certfile))
    server = DrainingServer(config, app.state.serving, engine, cfg.drain_timeout_s)
    _stop_when_the_engine_dies(engine, server)
    sockets = [sock] if sock is not None else None
    port = sock.getsockname()[1] if sock is not None else cfg.port
    log.info("serving %s on %s://%s:%d", engine.model_name, tls.scheme(cfg.ssl_certfile), cfg.host, port)
    _warn_if_open(cfg)
    member = None
    if cfg.join is not None:  # joins once its own /health answers, leaves when it drains
        own_url = _own_url(cfg.host, port, tls.scheme(cfg.ssl_certfile))
        member = ClusterMember(cfg, own_url, lambda: app.state.serving.draining)
        member.start()
    try:
        _serve(server, sockets)
    finally:
        if member is not None:
            member.stop()


def _warn_if_open(cfg: WorkerConfig) -> None:
    """A cluster member without a cluster token takes disaggregated requests from anyone who reaches it."""
    transceiver = cfg.cache_transceiver_config
    if transceiver.cluster_token or (transceiver.backend is None and cfg.join is None):
        return
    log.warning("!!! NO cluster_token: this worker's internal endpoints are open to anyone who can reach "
                "%s:%d: requests carrying disaggregated_params (they read other requests' KV), /v1/disagg/* "
                "(KV release), and its KV control plane. Set cache_transceiver_config.cluster_token to the "
                "cluster's token (pdserve launch makes one); docs/deploy.md, \"Trust model\" !!!", cfg.host, cfg.port)


def _serve(server: uvicorn.Server, sockets) -> None:
    if threading.current_thread() is not threading.main_thread():
        server.run(sockets=sockets)  # no signals off the main thread; the owner sets server.should_exit
        return
    # uvicorn handles the signal during run(), then re-raises it into the handlers it found, which by
    # default would kill the process (SIGTERM) or raise KeyboardInterrupt (SIGINT). Ours note it instead.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _frame: received.append(s)) for sig in _STOP_SIGNALS}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("stopped by %s", signal.Signals(received[0]).name)
