"""Drive one benchmark run against an OpenAI-compatible /v1/completions endpoint.

One asyncio loop, one long-lived httpx.AsyncClient. A dispatcher releases request i at its arrival
offset; each request streams SSE and stamps every chunk with time.perf_counter(). With
--max-concurrency C a semaphore admits at most C requests at a time; TTFT counts from the send,
as in vLLM (the wait for a slot shows as send_time − arrival_time).

The run always stops: at most num_prompts requests, each bounded by request_timeout_s, and the
whole run by max_duration_s, after which requests still in flight are cancelled and recorded as
failed with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from pdserve.bench import server_steps
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workload import WorkloadRequest


class BenchmarkError(RuntimeError):
    """The endpoint cannot be benchmarked (unreachable, wrong model, rejects the request shape)."""


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted too)
    model: str
    api_key: str | None = None
    endpoint: str = "/v1/completions"
    # ignore_eos + min_tokens pin the output length; turn off for servers that reject them.
    fixed_output: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    # pdserve servers whose engine steps the run records (server_steps.py); empty: base_url itself. Behind
    # pdserve's orchestrator (no engine of its own), its instances.
    engine_metrics: tuple[str, ...] = ()

    def metrics_urls(self) -> list[str]:
        return list(self.engine_metrics) or [self.base_url]

    def url(self) -> str:
        base = self.base_url.rstrip("/")
        path = self.endpoint
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[len("/v1"):]
        return base + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: WorkloadRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.fixed_output:
            body |= {"ignore_eos": True, "min_tokens": req.output_len}
        return body | self.extra_body


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        msg = err.get("error", err) if isinstance(err, dict) else err
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, UnicodeDecodeError):
        msg = body[:300].decode("utf-8", "replace")
    return f"HTTP {status}: {msg}"


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE stream, split where the SSE spec ends a line (LF, CRLF) and nowhere else.
    httpx's aiter_lines splits like str.splitlines, also at U+2028, U+2029 and U+0085, which a JSON
    string in an event may hold unescaped: a generated line separator would cut the event in two."""
    rest = ""
    async for text in resp.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


async def stream_one(client: httpx.AsyncClient, ep: EndpointConfig, req: WorkloadRequest,
                     record: RequestRecord, t0: float) -> RequestRecord:
    """Send `req`, read its SSE stream and fill `record` (times relative to t0)."""
    start = time.perf_counter()
    record.send_time = start - t0
    last = start
    chunks = 0
    try:
        async with client.stream("POST", ep.url(), json=ep.body(req), headers=ep.headers()) as resp:
            if resp.status_code != 200:
                record.error = _error_text(resp.status_code, await resp.aread())
                return record
            async for line in sse_lines(resp):
                # SSE: "data: {...}" events; blank lines separate them, ":" lines are comments.
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    record.error = f"error event in stream: {event['error']}"
                    return record
                if event.get("choices"):
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    chunks += 1
                if usage := event.get("usage"):
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
                    record.prompt_len = int(usage.get("prompt_tokens") or record.prompt_len)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    except (ValueError, TypeError) as e:  # an event that is not the JSON an OpenAI stream sends
        record.error = f"malformed SSE event: {e}"
        return record
    if chunks == 0:
        record.error = "the stream ended without a single token"
        return record
    record.output_tokens = record.output_tokens or chunks
    record.e2e = last - start
    record.success = True
    return record


async def check_endpoint(client: httpx.AsyncClient, ep: EndpointConfig, req: WorkloadRequest) -> None:
    """One untimed request; raises BenchmarkError with the server's answer if it fails."""
    rec = await stream_one(client, ep, req, RequestRecord(-1, req.prompt_len, req.output_len), time.perf_counter())
    if not rec.success:
        raise BenchmarkError(f"warm-up request to {ep.url()} (model {ep.model!r}) failed: {rec.error}. "
                             "Check --base-url, --model (see GET /v1/models) and, for servers that reject "
                             "ignore_eos/min_tokens, pass --no-fixed-output")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    stopped_early: bool  # max_duration_s ran out before every request finished
    engine_steps: dict | None = None  # a pdserve server's engine steps during the run (server_steps.py)


async def run_requests(ep: EndpointConfig, requests: Sequence[WorkloadRequest], offsets: np.ndarray,
                       max_concurrency: int | None = None, max_duration_s: float = math.inf,
                       warmup: WorkloadRequest | None = None, progress: bool = True) -> RunResult:
    """Release requests[i] at offsets[i] seconds, stream them all, return their records."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} arrival offsets")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    timeout = httpx.Timeout(ep.request_timeout_s, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or len(requests))
    records = [RequestRecord(r.index, r.prompt_len, r.output_len) for r in requests]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req", desc="bench")
    try:
        return await _run(ep, requests, offsets, sem, max_duration_s, warmup, records, bar, timeout, limits)
    finally:
        bar.close()


async def _run(ep: EndpointConfig, requests: Sequence[WorkloadRequest], offsets: np.ndarray,
               sem: asyncio.Semaphore | None, max_duration_s: float, warmup: WorkloadRequest | None,
               records: list[RequestRecord], bar: tqdm, timeout: httpx.Timeout, limits: httpx.Limits) -> RunResult:
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if warmup is not None:
            await check_endpoint(client, ep, warmup)
        steps_before = await server_steps.scrape_all(client, ep.metrics_urls())
        t0 = time.perf_counter()

        released: list[asyncio.Task] = []
        started: set[int] = set()

        async def one(i: int) -> None:
            records[i].arrival_time = time.perf_counter() - t0
            try:
                async with sem or contextlib.nullcontext():
                    started.add(i)
                    await stream_one(client, ep, requests[i], records[i], t0)
            finally:
                bar.update(1)

        async def dispatch() -> None:
            for i, offset in enumerate(offsets):
                delay = t0 + float(offset) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                released.append(asyncio.create_task(one(i)))
            if released:
                await asyncio.wait(released)

        try:
            await asyncio.wait_for(dispatch(), timeout=max_duration_s if math.isfinite(max_duration_s) else None)
            stopped = False
        except asyncio.TimeoutError:
            stopped = True
        pending = [t for t in released if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        duration = time.perf_counter() - t0
        steps = server_steps.difference(steps_before, await server_steps.scrape_all(client, ep.metrics_urls()),
                                        duration, len(ep.metrics_urls()))
    if stopped:
        for i, r in enumerate(records):
            if r.success or r.error:
                continue
            if i in started:
                r.error = f"cancelled: still running when --max-duration {max_duration_s:g} s ran out"
            elif i < len(released):
                r.error = ("not sent: waited for a --max-concurrency slot until "
                           f"--max-duration {max_duration_s:g} s ran out")
            else:
                r.error = f"not sent: --max-duration {max_duration_s:g} s ran out before its arrival time"
    return RunResult(records, duration, stopped, steps)
