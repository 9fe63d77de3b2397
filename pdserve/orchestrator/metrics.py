"""Prometheus metrics of one orchestrator process, in their own registry.

    pdserve_orchestrator_requests_total{path}              client requests by how they were served:
                                                           disaggregated | local (conditional) |
                                                           context_finished (first token ended it)
    pdserve_orchestrator_worker_requests_total{role}       requests sent to context / generation workers
    pdserve_orchestrator_worker_errors_total{role,status}  worker calls that failed, by the client's status
    pdserve_orchestrator_retries_total{role}               another instance tried after one was unreachable or lost
    pdserve_orchestrator_stream_moves_total                streams moved to another generation instance after
                                                           theirs was lost mid-stream (migrate_streams)
    pdserve_orchestrator_client_errors_total{status}       error answers to clients
    pdserve_orchestrator_queue_latency_seconds             arrival -> first worker request sent
                                                           (tokenize + routing + coordinator hop)
    pdserve_orchestrator_context_latency_seconds           context_only request -> its answer
    pdserve_orchestrator_time_to_first_token_seconds       arrival -> first token: the first streamed
                                                           chunk, or the context answer (non-streaming)
    pdserve_orchestrator_e2e_request_latency_seconds       arrival -> last byte to the client
    pdserve_orchestrator_requests_in_flight                gauge
    pdserve_orchestrator_instances{role,state}             gauge: instances joining | ready | draining | unready
    pdserve_orchestrator_membership_events_total{role,event}  joined | left | lost | refused | discovered
                                                           (a member found in the store: joined through
                                                           another process, or before a restart)
    pdserve_orchestrator_instance_failures_total{role}     ready instances seen to fail: /health refused,
                                                           timed out twice in a row or not 200, or a
                                                           request that could not reach it (a draining
                                                           one has not failed). An instance that dies
                                                           again before it is ready is not seen here:
                                                           its supervisor's log counts every failure

In a fleet each process has its own; scrape each (they share the port, so prefer the coordinator's
/cluster_info for routing state).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class OrchestratorMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "pdserve_orchestrator_"
        self.requests = Counter(p + "requests", "Client requests by serving path.", ["path"], registry=r)
        self.worker_requests = Counter(p + "worker_requests", "Requests sent to workers.", ["role"], registry=r)
        self.worker_errors = Counter(p + "worker_errors", "Failed worker calls.", ["role", "status"], registry=r)
        self.retries = Counter(p + "retries", "Retries on another instance.", ["role"], registry=r)
        self.stream_moves = Counter(p + "stream_moves", "Streams moved after their instance was lost.", registry=r)
        self.client_errors = Counter(p + "client_errors", "Error answers to clients.", ["status"], registry=r)
        self.queue = Histogram(p + "queue_latency_seconds", "Arrival to first worker request.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.context = Histogram(p + "context_latency_seconds", "context_only request latency.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last byte.", buckets=_E2E_BUCKETS,
                             registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "Client requests being served.", registry=r)
        self.instances = Gauge(p + "instances", "Instances by role and state.", ["role", "state"], registry=r)
        self.membership_events = Counter(p + "membership_events", "Instances that joined, left, were lost or "
                                                                   "refused.", ["role", "event"], registry=r)
        self.instance_failures = Counter(p + "instance_failures", "Ready instances seen to fail.", ["role"],
                                         registry=r)
        for role in ("context", "generation"):
            self.worker_requests.labels(role)
            self.instance_failures.labels(role)
            self.retries.labels(role)
            for event in ("joined", "left", "lost", "refused", "discovered"):
                self.membership_events.labels(role, event)
        for path in ("disaggregated", "local", "context_finished"):
            self.requests.labels(path)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
