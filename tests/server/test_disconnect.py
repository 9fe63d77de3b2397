"""A client that goes away mid-request cancels it: the engine aborts it and frees its KV blocks."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, NUM_KV_BLOCKS, scrape, wait_kv_baseline

ABORTS = 'pdserve_request_success_total{finished_reason="abort"}'
LONG = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
        "ignore_eos": True}


def wait_running(http: httpx.Client, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while scrape(http)["pdserve_kv_cache_blocks_used"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {**{k: v for k, v in LONG.items() if k != "prompt"},
                              "max_tokens": 64, "messages": [{"role": "user", "content": "fox"}]}),
])
def test_streaming_disconnect_aborts_and_frees_kv(server, http, path, body):
    before = wait_kv_baseline(http)
    with httpx.Client(base_url=server.url, timeout=10) as gone:
        with gone.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {") and json.loads(first[6:])["choices"]
        # leaving both blocks closes the connection mid-stream
    after = wait_kv_baseline(http)
    assert after["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
    assert after[ABORTS] == before.get(ABORTS, 0) + 1, "the request ran to the end instead of being aborted"
    assert after["pdserve_generation_tokens_total"] - before["pdserve_generation_tokens_total"] < body["max_tokens"]


def test_nonstreaming_disconnect_aborts_and_frees_kv(server, http):
    before = wait_kv_baseline(http)
    # The client gives up (read timeout) long before 120 tokens are done and closes the connection.
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(10, read=0.05)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=LONG)
    after = wait_kv_baseline(http)
    assert after["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
    assert after[ABORTS] == before.get(ABORTS, 0) + 1, "the request ran to the end instead of being aborted"
    # and the server is fine
    r = http.post("/v1/completions", json={**LONG, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
