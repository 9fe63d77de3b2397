"""While a role has no live instance (all crashed, restarting), the orchestrator says when to come back:
every 503 no_ready_instance carries Retry-After; and each ready instance it sees fail is counted in
/metrics (issue 51). No worker runs here: the instances' ports have nothing listening."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.host import free_port
from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.cluster import LocalCluster
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.testing.servers import UvicornThread


def _dead_cluster(**kw) -> DisaggConfig:
    return DisaggConfig(context_servers={"urls": [f"http://127.0.0.1:{free_port()}"]},
                        generation_servers={"urls": [f"http://127.0.0.1:{free_port()}"]}, **kw)


def test_every_no_ready_instance_503_says_when_to_retry():
    """Before, these 503s had no Retry-After, so a client could only guess (or hammer the orchestrator)."""
    with UvicornThread(build_app(_dead_cluster(health_check_interval=60)), name="orchestrator") as orch:
        answers = {"/health": httpx.get(orch.url + "/health", timeout=10),
                   "/v1/models": httpx.get(orch.url + "/v1/models", timeout=10),
                   # token ids: no worker needed to count the prompt, so routing is what fails
                   "/v1/completions": httpx.post(orch.url + "/v1/completions", timeout=10,
                                                 json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}),
                   # text: the orchestrator finds no worker to tokenize it with
                   "/v1/chat/completions": httpx.post(orch.url + "/v1/chat/completions", timeout=10,
                                                      json={"model": "m", "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "hi"}]})}
    for path, r in answers.items():
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_instance", (path, r.text)
        assert r.headers.get("retry-after") == "2", (path, dict(r.headers))


def test_a_ready_instance_that_fails_is_counted_once_by_role():
    """A ready context instance whose /health is refused counts one failure, however many rounds still find
    it down; a generation instance found unreachable by a request counts one for its role."""
    cfg = _dead_cluster(health_check_interval=60)
    metrics = OrchestratorMetrics()
    cluster = LocalCluster(cfg, metrics)

    def failures(role: str) -> float:
        return metrics.instance_failures.labels(role)._value.get()

    async def scenario() -> None:
        async with httpx.AsyncClient() as http:
            await cluster.start(http)  # never ready: not a failure
            assert failures("context") == failures("generation") == 0
            ctx, gen = cfg.context_servers.urls[0], cfg.generation_servers.urls[0]
            cluster.routers["context"].set_ready(ctx, True)  # as if it had served until now
            for _ in range(3):
                await cluster.probe_all()
            cluster.routers["generation"].set_ready(gen, True)
            for _ in range(2):
                await cluster.unreachable("generation", gen, "ConnectError")
            await cluster.close()

    asyncio.run(scenario())
    assert failures("context") == 1 and failures("generation") == 1
    text = metrics.render()[0].decode()
    assert 'pdserve_orchestrator_instance_failures_total{role="context"} 1.0' in text
