"""schemathesis against `pdserve serve`'s own OpenAPI schema, over a real server on the tiny model: any
request the schema describes, valid or not, gets an answer that is not a 5xx, and the engine keeps
serving with every KV block back."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from server_harness import NUM_KV_BLOCKS, wait_kv_baseline

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_the_schema_allows_gets_a_5xx(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)


def test_the_engine_is_whole_afterwards(http):
    assert http.get("/health").status_code == 200
    assert wait_kv_baseline(http)["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
