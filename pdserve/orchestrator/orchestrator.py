"""The request flow: split one client request into a context_only and a generation_only request.

    client ─> tokenize? ─> no context instance ready and none required (minimal_instances: 0)? or
                           conditional: uncached <= max_local_prefill_length?
                 yes: generation instance, request_type context_and_generation ─> client
                 no:  context instance, context_only (stream false)
                         answer.disaggregated_params is null: the first token finished it ─> client
                         else: generation instance, generation_only + those params (stream proxied) ─> client

A request with n > 1 is split the same way under context_first (the context answer carries each choice's
first token); under generation_first it is served whole on a generation instance.

context_first (default) chooses the generation instance after the context answer (conditional
disaggregation, whose decision needs the generation instance's cache, chooses it first and holds the
reservation during the prefill). generation_first sends both at once: the generation instance gets
generation_only with the context instance's KV endpoint and no first token, asks for the KV before
the prefill ends and receives the first token with it; with pipelined_transfer on the context worker,
each prefill chunk's KV moves while the next is computed. The context answer then only matters when
it is an error, which cancels the generation request.

A worker that cannot be reached is marked not ready and another instance is tried (max_retries). An
instance lost before the client's response started costs the client nothing, under either schedule
style: a context instance lost while it prefills or holds a request's KV (killed, restarted, draining)
or whose KV transfer failed, and a generation instance lost mid-request (its connection dropped) before
its answer or stream began. A context_and_generation request is sent again to another instance; a
disaggregated one runs both halves again, under a fresh id (_run_again). Each costs one of max_retries,
so a request that kills every instance it reaches kills at most max_retries + 1. Every other failure
ends the request with an OpenAI-style error (errors.py); mid-stream, an error event and [DONE]: what a
streaming client already received cannot be taken back. Workers' bodies are forwarded as they are: they
validate the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterable, Awaitable, Callable, TypeVar

import httpx

from pdserve.cluster_auth import TOKEN_HEADER
from pdserve.orchestrator import sse
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.errors import OrchestratorError, WorkerUnreachable
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.orchestrator.relay import Relay, Streamed
from pdserve.orchestrator.request import Request
from pdserve.orchestrator.request_id import RequestIdGenerator
from pdserve.orchestrator.routers import Route, RouteRequest, session_key
from pdserve.orchestrator.upstream import get_json, open_stream, post_json

T = TypeVar("T")
log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 5.0
ALIVE_TIMEOUT_S = 1.0  # a context instance that lost a transfer: is it gone, or was the failure transient?
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Orchestrator:
    """`cluster` is a LocalCluster or a RemoteCluster: select / finish / unreachable / ready_urls."""

    def __init__(self, cfg: DisaggConfig, cluster, http: httpx.AsyncClient, ids: RequestIdGenerator,
                 metrics: OrchestratorMetrics):
        self.cfg, self.cluster, self.http, self.ids, self.metrics = cfg, cluster, http, ids, metrics
        self.needs_tokens = cfg.conditional_disagg is not None or any(cluster.needs_tokens(r) for r in
                                                                      ("context", "generation"))
        self._kv_endpoints: dict[str, str] = {}  # context url -> its KV control endpoint (generation_first)
        self._releases: set[asyncio.Task] = set()  # fire-and-forget release_kv calls (kept from the GC)
        # what a member asks of a request that carries disaggregated_params or releases KV; sent only to
        # instances the cluster routes to, each of which proved it holds the token (cluster.py, _learn)
        self.member_headers = {TOKEN_HEADER: cfg.cluster_token} if cfg.cluster_token else None

    async def serve(self, api: str, body: dict, conversation_id: str | None = None) -> dict | AsyncIterable[bytes]:
        """A JSON answer, or the SSE bytes of a streaming one. Whatever the way out, the request gives back
        the routes and the KV it still holds (request.py)."""
        if "resume" in body:  # a disaggregated request's generation half would refuse it after the prefill
            raise OrchestratorError(400, "resume is set by the orchestrator when it moves a stream; a client may "
                                         "not send it", "invalid_value", "resume")
        req = Request(api, body, self._request_id(body), self.cluster, self._release_kv)
        tokens = await self._tokens(req) if self.needs_tokens else None
        req.route_req = RouteRequest(num_tokens=len(tokens) if tokens else 0, token_ids=tokens,
                                     session_key=session_key(body, conversation_id, self._session_router()))
        try:
            if self._aggregated() or (_choices(body) > 1 and self.cfg.schedule_style == "generation_first"):
                return await self._whole(req)
            if self.cfg.conditional_disagg is not None or self.cfg.schedule_style == "generation_first":
                # conditional disaggregation decides by this instance's cache, so it is chosen first and
                # stays reserved during the prefill
                if self._is_local(req, await req.reserve("generation")):
                    return await self._whole(req)
            if self.cfg.schedule_style == "generation_first":
                return await self._generation_first(req)
            return await self._context_first(req)
        finally:
            await req.let_go()

    # -- steps ---------------------------------------------------------------------------------------

    async def _context_first(self, req: Request) -> dict | AsyncIterable[bytes]:
        """Prefill on a context instance, then decode on a generation instance. When the instance holding
        the KV is lost before the generation side pulled it (killed, restarted), or the transfer failed,
        nothing has reached the client yet: the prefill runs again (at most max_retries times), on another
        context instance when that one does not answer /health."""
        for attempt in range(self.cfg.max_retries + 1):
            answer = await self._context(req)
            params = answer.get("disaggregated_params")
            if params is None:
                self.metrics.requests.labels("context_finished").inc()
                answer.pop("disaggregated_params", None)
                return self._finished(req, answer)
            params = {**params, "request_type": "generation_only", "schedule_style": self.cfg.schedule_style}
            cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            ctx_url = req.kv_at
            try:
                if (await req.reserve("generation")).url == ctx_url:
                    return await self._whole_where_prefilled(req)
                if attempt == 0:
                    self.metrics.requests.labels("disaggregated").inc()
                answered = await self._generate(req, params, cached)
            except OrchestratorError as e:
                await req.let_go()  # nobody pulls this KV now, should its instance still be alive
                if not await self._run_again(req, ctx_url, "generation", e, attempt):
                    raise
                continue
            req.kv_pulled()
            return answered
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _whole(self, req: Request) -> dict | AsyncIterable[bytes]:
        """One generation instance serves the request whole (context_and_generation): the one the request
        holds, else any."""
        self.metrics.requests.labels("local").inc()
        return await self._generate(req, {"request_type": "context_and_generation",
                                          "disagg_request_id": req.disagg_id})

    async def _whole_where_prefilled(self, req: Request) -> dict | AsyncIterable[bytes]:
        """The generation instance chosen is the one that prefilled (an instance listed in both roles):
        it serves the request whole, under a fresh id, from its prefix cache, and the context_only
        request's KV is released. Sent generation_only, it would meet its own id still in flight (409)."""
        req.release_kv()
        req.renew(self.ids.next_id())
        return await self._whole(req)

    async def _run_again(self, req: Request, ctx_url: str, role: str, e: BaseException, attempt: int) -> bool:
        """Whether a request whose half on `role` failed with `e` runs both halves again (the caller has
        stopped this attempt and let go of what it held; the client's response has not started). Yes when an instance
        was lost (_lost) and retries are left. A lost context instance at ctx_url leaves routing when it
        does not answer /health (a transient failure keeps it); a lost generation instance has left it
        already (_call). The request gets a fresh id, since the old one may still be in flight there."""
        lost = _lost(role, e)
        if lost is None or attempt == self.cfg.max_retries:
            return False
        if lost == "context" and not await self._alive(ctx_url):
            await self.cluster.unreachable("context", ctx_url, str(e))
            self._kv_endpoints.pop(ctx_url, None)  # it may come back with another endpoint
        self.metrics.retries.labels(lost).inc()
        req.renew(self.ids.next_id())
        return True

    async def _alive(self, url: str) -> bool:
        try:
            return (await self.http.get(url + "/health", timeout=ALIVE_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    def _request_id(self, body: dict) -> int:
        given = body.get("disaggregated_params")
        if given is None:
            return self.ids.next_id()
        if not isinstance(given, dict) or set(given) - {"disagg_request_id"}:
            raise OrchestratorError(400, "the orchestrator sets disaggregated_params itself; a client may only "
                                         "send {'disagg_request_id': <positive int>}", "invalid_value",
                                    "disaggregated_params")
        rid = given.get("disagg_request_id")
        if not isinstance(rid, int) or isinstance(rid, bool) or rid <= 0 or rid >= 1 << 63:
            raise OrchestratorError(400, f"disaggregated_params.disagg_request_id must be a positive 63-bit "
                                         f"integer, got {rid!r}", "invalid_value",
                                    "disaggregated_params.disagg_request_id")
        return rid

    def _session_router(self):
        ctx, gen = self.cfg.context_servers.router, self.cfg.generation_servers.router
        return gen if gen.type == "conversation" else ctx

    async def _tokens(self, req: Request) -> list[int]:
        prompt = req.body.get("prompt")
        if req.api == COMPLETIONS and isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if req.api == COMPLETIONS and isinstance(prompt, str):
            payload: dict = {"prompt": prompt}
        elif req.api == CHAT and isinstance(req.body.get("messages"), list):
            payload = {"messages": req.body["messages"]}
        else:
            return []  # a malformed body: the worker answers it with the precise 400
        urls = self.cluster.ready_urls("generation") or self.cluster.ready_urls("context")
        if not urls:
            raise OrchestratorError(503, "no ready worker to tokenize the prompt with", "no_ready_instance")
        url = urls[req.disagg_id % len(urls)]
        try:
            answer = await post_json(self.http, "tokenizer", url, "/tokenize", payload, self.cfg.request_timeout)
        except OrchestratorError as e:
            if e.status in (400, 413):
                raise
            raise OrchestratorError(502, f"POST {url}/tokenize failed ({e.status}: {e.message}); routing by prompt "
                                         "tokens (conditional_disagg, kv_cache_aware, load_balancing by tokens) "
                                         "needs pdserve workers with /tokenize", "tokenize_failed") from None
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise OrchestratorError(502, f"{url}/tokenize answered without a 'tokens' list", "worker_bad_answer")
        return tokens

    def _aggregated(self) -> bool:
        """No context instance is ready and none is required (context_servers.minimal_instances: 0): the
        generation instances serve each request whole, as aggregated instances behind this router."""
        return self.cfg.context_servers.minimal_instances == 0 and not self.cluster.ready_urls("context")

    def _is_local(self, req: Request, gen_route: Route) -> bool:
        if self.cfg.conditional_disagg is None:
            return False
        cached = gen_route.matched_blocks * (gen_route.tokens_per_block or 0)
        uncached = max(req.route_req.num_tokens - cached, 0)
        return uncached <= self.cfg.conditional_disagg.max_local_prefill_length

    async def _call(self, role: str, req: Request, send: Callable[[str], Awaitable[T]],
                    whole: bool = True) -> tuple[Route, T]:
        """send(url) on the instance of `role` the request holds, else a newly reserved one; an unreachable
        one is retried elsewhere, and so is one lost mid-request when the request is `whole` (it needs no
        other instance: not generation_only). On success the request still holds the route; on failure
        it is finished here."""
        retries = 0
        while True:
            route = await req.reserve(role)
            if not req.dispatched:
                req.dispatched = True
                self.metrics.queue.observe(time.monotonic() - req.arrival)
            self.metrics.worker_requests.labels(role).inc()
            try:
                return route, await send(route.url)
            except asyncio.CancelledError:  # the client went away
                await req.finish(role)
                raise
            except OrchestratorError as e:
                self.metrics.worker_errors.labels(role, str(e.status)).inc()
                await req.finish(role)
                # An instance lost mid-request (connection dropped; a streaming answer had not begun)
                # answered nothing the client saw, and a dropped connection aborts the request on the
                # worker. A draining instance refused the request before doing anything with it.
                lost = e.code == "worker_failed"
                if not (isinstance(e, WorkerUnreachable) or lost or e.code == "draining"):
                    raise
                await self.cluster.unreachable(role, route.url, e.message)
                if retries >= self.cfg.max_retries or (lost and not whole):
                    raise
                retries += 1
                self.metrics.retries.labels(role).inc()

    def _context_body(self, req: Request) -> dict:
        body = {k: v for k, v in req.body.items() if k != "stream_options"}
        body["stream"] = False
        body["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": req.disagg_id,
                                        "schedule_style": self.cfg.schedule_style}
        return body

    async def _context(self, req: Request) -> dict:
        body = self._context_body(req)
        start = time.monotonic()
        route, answer = await self._call("context", req, lambda url: post_json(
            self.http, "context", url, req.api, body, self.cfg.request_timeout, self.member_headers))
        await req.finish("context")
        self.metrics.context.observe(time.monotonic() - start)
        if not req.stream:  # a streaming client's first token is the generation worker's first chunk
            self.metrics.ttft.observe(time.monotonic() - req.arrival)
        if "disaggregated_params" not in answer:
            raise OrchestratorError(502, f"context server {route.url} answered without 'disaggregated_params': it "
                                         "must be a pdserve worker with cache_transceiver_config.backend set "
                                         "(docs/disaggregation.md)", "worker_not_disaggregated")
        params = answer["disaggregated_params"]
        if params is not None and not (isinstance(params, dict) and params.get("first_gen_tokens")):
            raise OrchestratorError(502, f"context server {route.url} answered with disaggregated_params "
                                         f"lacking first_gen_tokens: {params!r}", "worker_bad_answer")
        if params is not None:
            req.kv_at = route.url
        return answer

    async def _generation_first(self, req: Request) -> dict | AsyncIterable[bytes]:
        """Both halves at once. When the context instance is lost (its request dropped or refused, or the
        generation side's pull from it failed), or the generation instance before its stream opened,
        nothing has reached the client: both halves run again, as under context_first (_run_again)."""
        for attempt in range(self.cfg.max_retries + 1):
            ctx_route, endpoint = await self._call("context", req, self._kv_endpoint)
            if (await req.reserve("generation")).url == ctx_route.url:  # in both roles: nothing sent to it yet
                await req.finish("context")
                return await self._whole(req)
            if attempt == 0:
                self.metrics.requests.labels("disaggregated").inc()
            params = {"request_type": "generation_only", "disagg_request_id": req.disagg_id,
                      "first_gen_tokens": [], "ctx_info_endpoint": endpoint, "ctx_dp_rank": 0,
                      "schedule_style": "generation_first"}
            ctx = asyncio.create_task(self._context_part(req))
            gen = asyncio.create_task(self._generate(req, params))
            try:
                await asyncio.wait({ctx, gen}, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:  # the client went away: neither side may keep KV waiting for the other
                await _cancel_both(ctx, gen)
                raise
            # The context side's reason first: it is the one a client can act on.
            failed = [(role, t.exception()) for role, t in (("context", ctx), ("generation", gen))
                      if t.done() and t.exception() is not None]
            if not failed:
                req.kv_pulled()
                return gen.result()
            await _cancel_both(ctx, gen)
            await req.let_go()
            role, e = failed[0]
            if not await self._run_again(req, ctx_route.url, role, e, attempt):
                raise e
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _kv_endpoint(self, url: str) -> str:
        """The context instance's KV control endpoint, which the generation instance asks for the KV."""
        if url not in self._kv_endpoints:
            try:
                info = await get_json(self.http, "context", url, "/v1/disagg_info", self.cfg.request_timeout)
            except OrchestratorError as e:
                if isinstance(e, WorkerUnreachable) or e.status >= 500:
                    raise
                info = {}  # a 4xx: not a pdserve worker, said below
            endpoint = info.get("ctx_info_endpoint")
            if not endpoint:
                raise OrchestratorError(502, f"context server {url} has no KV endpoint in /v1/disagg_info: it must be "
                                             "a pdserve worker with cache_transceiver_config.backend set",
                                        "worker_not_disaggregated")
            self._kv_endpoints[url] = endpoint
        return self._kv_endpoints[url]

    def _release_kv(self, url: str, disagg_id: int) -> None:
        """Ask the context instance at `url` to free the KV it holds for `disagg_id` now, not after its
        kv_transfer_timeout_ms (Request.release_kv). In the background: a client that left must not wait
        for it. (A context_only request that never answered holds nothing: closing it aborted it.)"""
        body = {"disagg_request_id": disagg_id}
        call = post_json(self.http, "context", url, "/v1/disagg/release", body, RELEASE_TIMEOUT_S, self.member_headers)
        task = asyncio.get_running_loop().create_task(call)
        self._releases.add(task)
        task.add_done_callback(self._release_done)

    def _release_done(self, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not release a request's KV on its context instance (it frees it after its "
                        "kv_transfer_timeout_ms): %s", task.exception())

    async def _context_part(self, req: Request) -> None:
        """generation_first: the context_only request (on the context route the request holds), whose
        answer matters only when it fails."""
        start, url = time.monotonic(), req.held("context").url
        try:
            await post_json(self.http, "context", url, req.api, self._context_body(req), self.cfg.request_timeout,
                            self.member_headers)
            req.kv_at = url
        except OrchestratorError as e:
            self.metrics.worker_errors.labels("context", str(e.status)).inc()
            self._kv_endpoints.pop(url, None)  # it may have restarted with another endpoint
            raise
        finally:
            await req.finish("context")
        self.metrics.context.observe(time.monotonic() - start)

    def _finished(self, req: Request, answer: dict) -> dict | AsyncIterable[bytes]:
        self.metrics.e2e.observe(time.monotonic() - req.arrival)
        if req.stream:
            return sse.finished_answer_as_stream(answer, req.api == CHAT, req.include_usage)
        return answer

    async def _generate(self, req: Request, params: dict,
                        prefill_cached_tokens: int | None = None) -> dict | AsyncIterable[bytes]:
        """`prefill_cached_tokens`: the context worker's prefix-cache hit, which is the one the client
        cares about (the generation worker received the whole KV); it replaces the generation worker's
        count in a non-streaming answer's usage."""
        body = {**req.body, "disaggregated_params": params}
        timeout = self.cfg.request_timeout
        whole = params["request_type"] == "context_and_generation"  # sent again as it is, if its instance is lost
        if not req.stream:
            _, answer = await self._call("generation", req, lambda url: post_json(
                self.http, "generation", url, req.api, body, timeout, self.member_headers), whole)
            await req.finish("generation")
            answer.pop("disaggregated_params", None)
            details = (answer.get("usage") or {}).get("prompt_tokens_details")
            if prefill_cached_tokens is not None and isinstance(details, dict):
                details["cached_tokens"] = prefill_cached_tokens
            self.metrics.e2e.observe(time.monotonic() - req.arrival)
            return answer
        if self.cfg.migrate_streams:  # what a move needs: the ids of the tokens streamed so far
            body["return_token_ids"] = True
        return Relay(req, *await self._open_stream(req, body, whole), timeout=timeout, metrics=self.metrics,
                     move=self.move_stream)

    async def _open_stream(self, req: Request, body: dict, whole: bool = True) -> tuple[Route, httpx.Response]:
        """`body` sent streaming to a generation instance (the one the request holds, or any), through
        _call; its route passes to the caller's Relay, which finishes it when the stream ends."""
        timeout = self.cfg.request_timeout
        _, response = await self._call("generation", req, lambda url: open_stream(
            self.http, "generation", url, req.api, body, timeout, self.member_headers), whole)
        return req.hand_over("generation"), response

    async def move_stream(self, req: Request, route: Route, e: OrchestratorError, so_far: Streamed,
                     moves: int) -> tuple[Route, httpx.Response] | None:
        """A stream whose generation instance at `route` was lost mid-stream (`e`), opened again on another
        instance, which goes on from the output `so_far` (served whole there: prompt and output recomputed);
        None when it may not move (migrate_streams off, moves used up, or `e` not a lost instance)."""
        if not self.cfg.migrate_streams or moves >= self.cfg.max_retries or e.code != "worker_failed":
            return None
        if not await self._alive(route.url):  # (a dropped connection alone leaves the instance in routing)
            await self.cluster.unreachable("generation", route.url, e.message)
        body = {k: v for k, v in req.body.items() if k != "disaggregated_params"}
        body["return_token_ids"] = True
        if so_far.id is not None:  # the client has had some of the stream (perhaps only chat's role chunk)
            body["resume"] = {"token_ids": so_far.token_ids, "sent_chars": so_far.chars, "id": so_far.id,
                              "created": so_far.created}
        try:
            opened = await self._open_stream(req, body)
        except OrchestratorError as failed:
            log.warning("a stream lost with %s could not move: %s", route.url, failed.message)
            return None
        self.metrics.stream_moves.inc()
        return opened


def _lost(role: str, e: BaseException) -> str | None:
    """Which instance `e`, from a request's half on `role`, says was lost, if one was: the context
    instance (or the KV it holds) when the context request could not be sent, dropped its connection
    or was refused by a draining instance, or when the generation side's KV pull failed or found the KV
    gone (a restarted context instance holds none); the generation instance when its request dropped its
    connection before the answer began."""
    if not isinstance(e, OrchestratorError):
        return None
    if role == "generation":
        return {"kv_transfer_failed": "context", "kv_not_found": "context", "worker_failed": "generation"}.get(e.code)
    return "context" if isinstance(e, WorkerUnreachable) or e.code in ("worker_failed", "draining") else None


def _choices(body: dict) -> int:
    """The request's `n`. More than one goes through context_first like any request: the context instance
    computes the prompt once and answers with every choice's first token, and the generation instance forks
    the choices from the KV (engine: forks.py). generation_first serves it whole on a generation instance
    (its first token rides with the KV, and there is one). A malformed `n` counts as 1: the instance's 400
    names it."""
    n = body.get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


async def _cancel_both(ctx: asyncio.Task, gen: asyncio.Task) -> None:
    """Stop both halves of a generation_first request; close the stream if it had opened."""
    for task in (ctx, gen):
        task.cancel()
    _, opened = await asyncio.gather(ctx, gen, return_exceptions=True)
    if isinstance(opened, Relay):
        await opened.aclose()
