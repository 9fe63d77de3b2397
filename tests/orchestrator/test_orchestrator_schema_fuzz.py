"""schemathesis through the orchestrator: requests generated from the workers' OpenAPI schema of
/v1/completions and /v1/chat/completions (the orchestrator forwards bodies it does not model), valid
or not, sent to an orchestrator over a real transceiver pair. None may get a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from harness import AppThread, start_workers, wait_healthy
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    ws = start_workers(tiny_model_dir, tmp_path_factory.mktemp("fuzz"), 2,
                       {"cache_transceiver_config": {"backend": "shm"}, "kv_events_port": 0})
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def orchestrator(pair):
    ctx, gen = pair
    cfg = DisaggConfig(context_servers={"urls": [ctx.url]}, generation_servers={"urls": [gen.url]},
                       conditional_disagg={"max_local_prefill_length": 8})
    with AppThread(build_app(cfg)) as orch:
        wait_healthy(orch.url)
        yield orch


@pytest.fixture(scope="module")
def api_schema(pair):
    return schemathesis.openapi.from_url(pair[1].url + "/openapi.json").include(
        path_regex=r"^/v1/(chat/)?completions$")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_through_the_orchestrator_gets_a_5xx(case, orchestrator):
    case.call_and_validate(base_url=orchestrator.url, checks=[not_a_server_error], timeout=60)


def test_the_cluster_is_whole_afterwards(orchestrator, pair):
    assert httpx.get(orchestrator.url + "/health", timeout=5).status_code == 200
    for w in pair:
        assert w.metric("pdserve_kv_cache_blocks_free") == w.metric("pdserve_kv_cache_blocks_total")
