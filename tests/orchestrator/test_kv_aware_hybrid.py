"""The kv_cache_aware router over hybrid-model instances (Qwen3.5): prefix caching is off for such a model
(its recurrent state exists for the whole sequence only), so its workers publish no KV events and the
router must never count a prefix of theirs as cached, however often it was sent. What a false count would
cost shows in conditional disaggregation: a long prompt taken as cached would be prefilled locally, on the
generation instance, as if most of it were there already.

Real `pdserve serve` workers (context and generation, shm, KV events on) and an orchestrator in a thread."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from harness import MODEL_NAME, TOKENS_PER_BLOCK, AppThread, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing import make_tiny_model

PROMPT = list(range(40, 40 + 6 * TOKENS_PER_BLOCK))  # six whole blocks
BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-aware-hybrid")
    model = make_tiny_model(root / "qwen3_5", arch="qwen3_5", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    extra = {"cache_transceiver_config": {"backend": "shm"}, "kv_events_port": 0}
    ws = start_each(model, root, [extra, extra])
    yield ws
    for w in ws:
        w.stop()


def _views(orch_url: str) -> dict[str, dict]:
    info = httpx.get(orch_url + "/cluster_info", timeout=5).json()
    return {i["url"]: i for role in ("context_servers", "generation_servers") for i in info[role]["instances"]}


def _caught_up(orch_url: str, workers, timeout: float = 10.0) -> dict[str, dict]:
    """The router's view of each worker once it has applied every event the worker published (its seq equal
    to the worker's own snapshot's): a count read then is the router's settled one, not one still in flight."""
    deadline = time.monotonic() + timeout
    while True:
        views = _views(orch_url)
        seqs = {w.url: httpx.get(w.url + "/v1/kv_blocks", timeout=5).json()["seq"] for w in workers}
        if all(views[url]["kv_events_seq"] == seq for url, seq in seqs.items()):
            return views
        assert time.monotonic() < deadline, f"the router's KV event seqs {views} never reached the workers' {seqs}"
        time.sleep(0.05)


def test_a_hybrid_prefix_is_never_counted_as_cached(hybrid_pair):
    ctx, gen = hybrid_pair
    expected = httpx.post(gen.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    cfg = DisaggConfig(context_servers={"urls": [ctx.url], "router": {"type": "kv_cache_aware"}},
                       generation_servers={"urls": [gen.url], "router": {"type": "kv_cache_aware"}},
                       conditional_disagg={"max_local_prefill_length": 2 * TOKENS_PER_BLOCK})
    with AppThread(build_app(cfg)) as orch, httpx.Client(base_url=orch.url, timeout=60) as client:
        wait_healthy(orch.url)
        for n in range(3):
            out = client.post("/v1/completions", json=BODY).json()
            assert out["choices"][0]["text"] == expected
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            views = _caught_up(orch.url, hybrid_pair)
            assert {url: v["cached_blocks"] for url, v in views.items()} == {ctx.url: 0, gen.url: 0}, views
        for w in hybrid_pair:  # nothing published: the workers' own snapshots are empty
            assert httpx.get(w.url + "/v1/kv_blocks", timeout=5).json()["block_hashes"] == []
        paths = dict(re.findall(r'^pdserve_orchestrator_requests_total\{path="(\w+)"\} (\S+)$',
                                client.get("/metrics").text, re.M))
    # 48 prompt tokens, none cached: each time more than max_local_prefill_length to prefill, so split
    assert float(paths.get("disaggregated", 0)) == 3 and float(paths.get("local", 0)) == 0, paths
