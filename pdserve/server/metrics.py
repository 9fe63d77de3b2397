"""Prometheus metrics for one server, in their own registry (two apps in one process never clash).

Latencies are taken on the engine thread, in the engine's `on_step` hook, at the moment each step's
outputs exist; they do not include the event loop's delay in forwarding them. A request's clock
starts when the HTTP layer hands it to the engine (`request_started`).

    pdserve_time_to_first_token_seconds   histogram  arrival -> first output token
    pdserve_inter_token_latency_seconds   histogram  gap between consecutive output steps of a request
    pdserve_time_per_output_token_seconds histogram  per request: (e2e - ttft) / (output tokens - 1)
    pdserve_e2e_request_latency_seconds   histogram  arrival -> finish
    pdserve_prompt_tokens_total           counter    prompt tokens of requests that got a first token
    pdserve_generation_tokens_total       counter    output tokens produced
    pdserve_request_success_total         counter    finished requests, label finished_reason
                                                     (stop, length, abort, error)
    pdserve_engine_step_seconds           histogram  one forward step, label kind: prefill, decode, or mixed
                                                     (prompt tokens and decoding requests in one step)
    pdserve_engine_step_tokens_total      counter    tokens computed by steps, label kind: prefill, decode
    pdserve_num_requests_running          gauge      requests in the running batch
    pdserve_num_requests_waiting          gauge      requests queued for admission
    pdserve_kv_cache_blocks_used / _free / _total    gauges  KV cache blocks (rank 0's pool)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pdserve.engine.llm_engine import StepRecord
from pdserve.engine.output import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 1.5, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class _Live:
    arrival: float
    first: float | None = None
    last: float | None = None
    open: int = 1  # choices not finished (n > 1: one request, timed per choice, counted once)
    others: dict[int, "_Live"] = field(default_factory=dict)  # choices 1..n-1's timing


class _EngineStats:
    """Reads the engine's stats snapshot at scrape time (gauges that are never stale)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        yield GaugeMetricFamily("pdserve_num_requests_running", "Requests in the running batch.", value=s["running"])
        yield GaugeMetricFamily("pdserve_num_requests_waiting", "Requests waiting for admission.", value=s["waiting"])
        yield GaugeMetricFamily("pdserve_kv_cache_blocks_total", "KV cache blocks in the pool.",
                                value=s["kv_blocks_total"])
        yield GaugeMetricFamily("pdserve_kv_cache_blocks_free", "KV cache blocks free.", value=s["kv_blocks_free"])
        yield GaugeMetricFamily("pdserve_kv_cache_blocks_used", "KV cache blocks in use.",
                                value=s["kv_blocks_total"] - s["kv_blocks_free"])
        # Hybrid models' recurrent-state slots, one per running sequence (0 for a model without state)
        yield GaugeMetricFamily("pdserve_state_slots_total", "Recurrent-state slots in the pool.",
                                value=s["state_slots_total"])
        yield GaugeMetricFamily("pdserve_state_slots_free", "Recurrent-state slots free.", value=s["state_slots_free"])


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between consecutive output steps.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Per-request mean time per output token "
                              "after the first.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to finish.", buckets=_E2E_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Output tokens generated.", registry=r)
        self.success = Counter("pdserve_request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.step = Histogram("pdserve_engine_step_seconds", "One forward step of the engine, by what it ran.",
                              ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("pdserve_engine_step_tokens", "Tokens computed by forward steps.", ["kind"],
                                   registry=r)
        r.register(_EngineStats(engine))
        # request id -> timing; written by the event loop (start/end) and the engine thread (on_step).
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()

    def request_started(self, request_id: str, n: int = 1) -> None:
        with self._lock:
            self._live[request_id] = _Live(time.monotonic(), open=n)

    def request_ended(self, request_id: str, how: str) -> None:
        """The HTTP layer stopped listening. `how`: "finished" (a step finished it; on_step records
        it), "refused" (the engine never took it; not counted), or "abort" / "error" (ended outside
        a step: client gone / step loop died; counted here)."""
        if how == "finished":
            return
        with self._lock:
            live = self._live.pop(request_id, None)
        if live is not None and how != "refused":
            self.success.labels(how).inc()
            self.e2e.observe(time.monotonic() - live.arrival)

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """The engine's step hook (engine thread)."""
        now = time.monotonic()
        with self._lock:
            for out in outputs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue  # not an HTTP request of this server
                choice = live.others.setdefault(out.index, _Live(live.arrival)) if out.index else live
                live.open -= out.finished
                self._observe(choice, out, now, first_choice=not out.index, last_choice=not live.open)
                if not live.open:
                    del self._live[out.request_id]

    def on_step_record(self, step: StepRecord) -> None:
        """The engine's step-record hook (engine thread)."""
        self.step.labels(step.kind).observe(step.seconds)
        if step.prefill_tokens:
            self.step_tokens.labels("prefill").inc(step.prefill_tokens)
        if step.decode_rows:
            self.step_tokens.labels("decode").inc(step.decode_rows)

    def _observe(self, live: _Live, out: RequestOutput, now: float, first_choice: bool = True,
                 last_choice: bool = True) -> None:
        """One choice's output (`live` its timing). The request's first token and prompt are counted by its
        first choice, its end by the last to finish; inter-token gaps and TPOT are each choice's own."""
        n_new = len(out.new_token_ids)
        self.generation_tokens.inc(n_new)
        if live.first is None and n_new:
            live.first = now
            if first_choice:
                self.ttft.observe(now - live.arrival)
                self.prompt_tokens.inc(out.num_prompt_tokens)
        elif n_new and live.last is not None:
            self.itl.observe(now - live.last)
        if n_new:
            live.last = now
        if out.finished and last_choice:
            self.success.labels(out.finish_reason or "stop").inc()
            self.e2e.observe(now - live.arrival)
        if out.finished:
            if live.first is not None and out.num_output_tokens > 1:
                self.tpot.observe((now - live.first) / (out.num_output_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
