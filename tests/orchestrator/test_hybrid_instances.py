"""The orchestrator over hybrid-model instances (Qwen3.5: Gated DeltaNet layers 0-2, attention layer 3).

- The kv_cache_aware router: prefix caching is off for such a model (its recurrent state exists for the
  whole sequence only), so its workers publish no KV events and the router must never count a prefix of
  theirs as cached, however often it was sent. What a false count would cost shows in conditional
  disaggregation: a long prompt taken as cached would be prefilled locally, on the generation instance, as
  if most of it were there already.
- Stream migration: the generation instance streaming a long answer (its state received from the context
  instance) is killed; the stream moves to the other one, which recomputes the prompt and the tokens sent,
  the recurrent state with them, and goes on with the text the aggregated instance gives.

Real `pdserve serve` workers (one context, two generation; shm, KV events on) and an orchestrator in a
thread. The migration test kills a worker, so it comes last."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from harness import MODEL_NAME, TOKENS_PER_BLOCK, AppThread, caught_up, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing import make_tiny_model

PROMPT = list(range(40, 40 + 6 * TOKENS_PER_BLOCK))  # six whole blocks
BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
# A decode of LONG_TOKENS takes 1-4 s here (2-9 ms a token, as loaded as the machine is), so a kill after
# the first chunks lands mid-stream.
LONG_TOKENS = 400


@pytest.fixture(scope="module")
def hybrid_cluster(tmp_path_factory):
    """One context instance and two generation instances of a tiny Qwen3.5."""
    root = tmp_path_factory.mktemp("hybrid-instances")
    model = make_tiny_model(root / "qwen3_5", arch="qwen3_5", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    extra = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": 4000}, "kv_events_port": 0,
             "max_model_len": 512, "num_kv_blocks": 160}
    ws = start_each(model, root, [extra] * 3)
    yield ws
    for w in ws:
        w.stop()


def _holds_kv(worker) -> bool:
    return worker.metric("pdserve_kv_cache_blocks_free") < worker.metric("pdserve_kv_cache_blocks_total")


def _holds_nothing(worker) -> bool:
    return not _holds_kv(worker) and \
        worker.metric("pdserve_state_slots_free") == worker.metric("pdserve_state_slots_total") > 0


def test_a_hybrid_prefix_is_never_counted_as_cached(hybrid_cluster):
    ctx, *gens = hybrid_cluster
    expected = httpx.post(gens[0].url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    cfg = DisaggConfig(context_servers={"urls": [ctx.url], "router": {"type": "kv_cache_aware"}},
                       generation_servers={"urls": [g.url for g in gens], "router": {"type": "kv_cache_aware"}},
                       conditional_disagg={"max_local_prefill_length": 2 * TOKENS_PER_BLOCK})
    with AppThread(build_app(cfg)) as orch, httpx.Client(base_url=orch.url, timeout=60) as client:
        wait_healthy(orch.url)
        for n in range(3):
            out = client.post("/v1/completions", json=BODY).json()
            assert out["choices"][0]["text"] == expected
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            views = caught_up(orch.url, hybrid_cluster)
            assert {url: v["cached_blocks"] for url, v in views.items()} == dict.fromkeys(views, 0), views
        for w in hybrid_cluster:  # nothing published: the workers' own snapshots are empty
            assert httpx.get(w.url + "/v1/kv_blocks", timeout=5).json()["block_hashes"] == []
        paths = dict(re.findall(r'^pdserve_orchestrator_requests_total\{path="(\w+)"\} (\S+)$',
                                client.get("/metrics").text, re.M))
    # 48 prompt tokens, none cached: each time more than max_local_prefill_length to prefill, so split
    assert float(paths.get("disaggregated", 0)) == 3 and float(paths.get("local", 0)) == 0, paths


@pytest.mark.faults
def test_a_stream_whose_generation_instance_is_killed_moves_and_recomputes_the_state(hybrid_cluster):
    """kill -9 of the generation instance streaming a long greedy answer, after a few chunks: the survivor
    gets the request whole with the tokens sent so far (`resume`), recomputes them with the prompt (the
    DeltaNet layers' state with them) and goes on. One unbroken stream whose text is the aggregated text,
    and afterwards no instance holds a KV block or a state slot. Kills a worker: the module's last test."""
    ctx, *gens = hybrid_cluster
    body = {**BODY, "max_tokens": LONG_TOKENS}
    expected = httpx.post(gens[0].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    cfg = DisaggConfig(context_servers={"urls": [ctx.url]}, generation_servers={"urls": [g.url for g in gens]},
                       max_retries=1, health_check_interval=60)
    with AppThread(build_app(cfg)) as orch, httpx.Client(base_url=orch.url, timeout=60) as client:
        wait_healthy(orch.url)
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            events = [next(lines) for _ in range(10)]
            doomed = next(g for g in gens if _holds_kv(g))  # the one decoding it
            doomed.stop()  # SIGKILL
            events += list(lines)  # bounded: at most LONG_TOKENS + 1 events
        assert events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events), events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
        moves = re.search(r"^pdserve_orchestrator_stream_moves_total (\S+)$", client.get("/metrics").text, re.M)
        assert float(moves.group(1)) == 1  # moved, not finished before the kill
    survivor = next(g for g in gens if g is not doomed)
    deadline = time.monotonic() + 5
    while not (_holds_nothing(ctx) and _holds_nothing(survivor)):
        assert time.monotonic() < deadline, "an instance still holds KV blocks or state slots 5 s after the stream"
        time.sleep(0.05)
