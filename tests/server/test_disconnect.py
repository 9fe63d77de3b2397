"""A client that goes away mid-request cancels it: the engine aborts it and frees its KV blocks.

The engine is held right after the request's first output, so the request provably holds KV blocks
and is unfinished when the client leaves; on release the abort is applied before any further step,
so exactly one token was ever generated."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_harness import (MAX_MODEL_LEN, NUM_KV_BLOCKS, EngineHold, ServerThread, scrape, wait_for,
                            wait_kv_baseline)

from pdserve.config import WorkerConfig
from pdserve.server.app import build_app
from pdserve.testing.servers import ClientGoneBeforeFirstByte

ABORTS = 'pdserve_request_success_total{finished_reason="abort"}'
LONG = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
        "ignore_eos": True}


# A long streaming request on each API (chat gets fewer tokens: its template takes part of the window).
STREAMS = [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {**{k: v for k, v in LONG.items() if k != "prompt"},
                              "max_tokens": 64, "messages": [{"role": "user", "content": "fox"}]}),
]


def aborts(http: httpx.Client) -> float:
    return scrape(http).get(ABORTS, 0.0)


@pytest.mark.parametrize("path,body", STREAMS)
def test_streaming_disconnect_aborts_and_frees_kv(server, engine, http, path, body):
    before = wait_kv_baseline(http)
    with EngineHold(engine) as hold, httpx.Client(base_url=server.url, timeout=10) as gone:
        with gone.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line)
            assert first.startswith("data: {") and json.loads(first[6:])["choices"]
            assert hold.paused.wait(10)
            r.close()  # the client hangs up mid-stream
        wait_for(lambda: aborts(http) == before.get(ABORTS, 0) + 1, "the server to cancel the stream")
        hold.release()
        after = wait_kv_baseline(http)
        assert hold.tokens_of(json.loads(first[6:])["id"]) == 1
    assert after["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS


def test_nonstreaming_disconnect_aborts_and_frees_kv(server, engine, http):
    before = wait_kv_baseline(http)
    outcome: list[str] = []

    def impatient_client():
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(10, read=0.3)) as impatient:
            try:
                impatient.post("/v1/completions", json=LONG)
                outcome.append("answered")
            except httpx.ReadTimeout:
                outcome.append("gave up")  # and closed the connection

    with EngineHold(engine) as hold:
        client = threading.Thread(target=impatient_client)
        client.start()
        assert hold.paused.wait(10)
        client.join(timeout=10)
        assert outcome == ["gave up"]
        wait_for(lambda: aborts(http) == before.get(ABORTS, 0) + 1, "the server to cancel the request")
        hold.release()
        after = wait_kv_baseline(http)
        assert hold.tokens_of(hold.outputs[0].request_id) == 1
    assert after["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
    r = http.post("/v1/completions", json={**LONG, "max_tokens": 4})  # and the server is fine
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", STREAMS)
def test_stream_whose_client_is_gone_before_the_first_byte_aborts_and_frees_kv(server, engine, http, path, body):
    """The SSE generator never starts, so only the response's own cleanup can abort the request."""
    wait_kv_baseline(http)  # start from an idle server
    app = ClientGoneBeforeFirstByte(build_app(engine, WorkerConfig(model=engine.engine.ecfg.model)))
    with EngineHold(engine) as hold, ServerThread(app) as gone_server, \
            httpx.Client(base_url=gone_server.url, timeout=10) as gone_http:
        try:
            gone_http.post(path, json={**body, "stream": True})
        except httpx.HTTPError:
            pass  # however the server ends the exchange; the client is not the point here
        assert hold.paused.wait(10)
        wait_for(lambda: aborts(gone_http) == 1, "the server to abort the request")  # this app's own metrics
        hold.release()
        after = wait_kv_baseline(http)
        assert hold.tokens_of(hold.outputs[0].request_id) == 1
    assert after["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS
