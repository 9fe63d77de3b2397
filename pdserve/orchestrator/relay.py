"""A generation worker's SSE stream relayed to the client (`Relay`), and what the client has had of it
(`Streamed`): the piece of the request flow (orchestrator.py) that moves a stream to another instance when
its worker is lost mid-stream (migrate_streams)."""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import httpx

from pdserve.orchestrator import sse
from pdserve.orchestrator.errors import OrchestratorError
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.orchestrator.request import Request
from pdserve.orchestrator.routers import Route
from pdserve.orchestrator.upstream import iter_stream

log = logging.getLogger(__name__)


class Streamed:
    """What a relayed stream has sent its client: the token ids and characters of its text, and the id
    and created time of its chunks. The ids come from the worker's return_token_ids, which the relay
    takes out again unless the client asked for them."""

    def __init__(self, client_wants_ids: bool):
        self.client_wants_ids = client_wants_ids
        self.token_ids: list[int] = []
        self.chars = 0
        self.id: str | None = None
        self.created: int | None = None

    def take(self, events: bytes) -> bytes:
        """`events` (whole ones), counted, as the client gets them."""
        out = []
        for raw in events.split(sse.EVENT_END)[:-1]:
            if not raw.startswith(b"data: {"):
                out.append(raw)
                continue
            data = json.loads(raw[len(b"data: "):])
            choices = data.get("choices")
            if "error" in data or not isinstance(choices, list):
                out.append(raw)
                continue
            self.id, self.created = data.get("id", self.id), data.get("created", self.created)
            stripped = False
            for choice in choices[:1]:
                ids = choice.get("token_ids") if self.client_wants_ids else choice.pop("token_ids", None)
                stripped = ids is not None and not self.client_wants_ids
                self.token_ids += ids or []
                delta = choice.get("delta")
                self.chars += len((delta.get("content") if isinstance(delta, dict) else choice.get("text")) or "")
            out.append(b"data: " + json.dumps(data, separators=(",", ":")).encode() if stripped else raw)
        return sse.EVENT_END.join(out) + sse.EVENT_END


# (request, its route that was lost, the error, what the client has had, moves so far) -> the stream opened on
# another instance, or None where it may not move
Move = Callable[[Request, Route, OrchestratorError, Streamed, int], Awaitable[tuple[Route, httpx.Response] | None]]


class Relay:
    """A generation worker's open SSE stream, relayed to the client.

    Iterating it yields the worker's events, whole; `aclose` releases the worker connection and the
    route exactly once, whether or not the relay ever started. (A plain async generator that was never
    iterated skips its `finally` on close, which leaked both when a generation_first request's
    context side failed after the generation stream had opened.)

    When the worker is lost mid-stream (killed, connection lost), the stream moves to another instance,
    which goes on from the tokens sent so far (migrate_streams, up to max_retries moves). When it cannot
    move, or the worker failed otherwise (silent for request_timeout), the status line is long gone: the
    client gets an error event, then `data: [DONE]`, as a worker ends a stream that failed. Events are
    relayed only once their blank line has arrived, so the half of one that a dying worker sent never
    runs into what follows."""

    def __init__(self, req: Request, route: Route, response: httpx.Response, *, timeout: float,
                 metrics: OrchestratorMetrics, move: Move):
        """`req` handed `route` over to this relay (Request.hand_over), which finishes it; `timeout` is the
        longest a worker may stay silent; `move` opens the stream again on another instance
        (Orchestrator.move_stream)."""
        self.req, self.route, self.response = req, route, response
        self.timeout, self.metrics, self.move = timeout, metrics, move
        self._released = False  # this route's worker connection and reservation
        self._ended = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        req = self.req
        first, moves = True, 0
        streamed = Streamed(bool(req.body.get("return_token_ids")))
        try:
            while True:
                tail = b""
                try:
                    async for chunk in iter_stream(self.response, "generation", self.route.url, self.timeout):
                        events, end, tail = (tail + chunk).rpartition(sse.EVENT_END)
                        if not end:
                            continue
                        if first:
                            first = False
                            self.metrics.ttft.observe(time.monotonic() - req.arrival)
                        yield streamed.take(events + end)
                    if tail:
                        yield tail
                    return
                except OrchestratorError as e:
                    self.metrics.worker_errors.labels("generation", str(e.status)).inc()
                    await self._release()
                    moved = await self.move(req, self.route, e, streamed, moves)
                    if moved is None:
                        yield sse.event(e.body())
                        yield sse.DONE
                        return
                    lost = self.route.url
                    (self.route, self.response), self._released, moves = moved, False, moves + 1
                    log.info("a stream lost with %s moved to %s after %d tokens", lost, self.route.url,
                             len(streamed.token_ids))
        finally:
            await self.aclose()

    async def _release(self) -> None:
        """Close the current worker's response and finish its route, once."""
        if self._released:
            return
        self._released = True
        try:
            await self.response.aclose()
        finally:
            await self.req.finish_handed("generation", self.route)

    async def aclose(self) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            await self._release()
        finally:
            self.metrics.e2e.observe(time.monotonic() - self.req.arrival)
