"""LocalCluster's /health probes: a worker that misses one probe by timing out stays routed to; one that
times out twice in a row, or refuses the connection, is taken out; and it comes back when it answers.

The workers here are httpx.MockTransport handlers: what is under test is the readiness bookkeeping, not
HTTP (the e2e tests probe real instances)."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.orchestrator.cluster import LocalCluster
from pdserve.orchestrator.config import DisaggConfig

CTX, GEN = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def _cluster(behaviour: dict[str, str]):
    """behaviour[url]: 'ok', 'timeout' (no answer in time) or 'refused' (nothing listening)."""

    def handle(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if behaviour[url] == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        if behaviour[url] == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        if request.url.path == "/v1/disagg_info":
            return httpx.Response(404)
        return httpx.Response(200, json={"status": "ok"})

    # Probes only when the test asks (probe_all): the background loop waits an hour.
    cfg = DisaggConfig(context_servers={"urls": [CTX]}, generation_servers={"urls": [GEN]},
                       health_check_interval=3600)
    return LocalCluster(cfg), httpx.AsyncClient(transport=httpx.MockTransport(handle))


def test_one_timeout_keeps_a_worker_two_take_it_out_and_it_comes_back():
    async def run():
        behaviour = {CTX: "ok", GEN: "ok"}
        cluster, http = _cluster(behaviour)
        await cluster.start(http)  # the first probe round
        ready = lambda: CTX in cluster.routers["context"].ready  # noqa: E731
        assert ready() and cluster.status[CTX] == "ready"
        behaviour[CTX] = "timeout"
        await cluster.probe_all()
        assert ready()  # one slow answer: still routed to
        await cluster.probe_all()
        assert not ready() and cluster.status[CTX].startswith("ReadTimeout")
        behaviour[CTX] = "ok"
        await cluster.probe_all()
        assert ready()
        behaviour[CTX] = "timeout"
        await cluster.probe_all()
        behaviour[CTX] = "ok"
        await cluster.probe_all()
        behaviour[CTX] = "timeout"
        await cluster.probe_all()
        assert ready()  # timeouts that are not in a row do not add up
        await cluster.close()
        await http.aclose()

    asyncio.run(run())


def test_a_refused_connection_takes_a_worker_out_at_once():
    async def run():
        behaviour = {CTX: "ok", GEN: "ok"}
        cluster, http = _cluster(behaviour)
        await cluster.start(http)
        assert GEN in cluster.routers["generation"].ready
        behaviour[GEN] = "refused"
        await cluster.probe_all()
        assert GEN not in cluster.routers["generation"].ready
        assert cluster.status[GEN].startswith("ConnectError")
        await cluster.close()
        await http.aclose()

    asyncio.run(run())
