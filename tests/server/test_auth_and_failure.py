"""API key enforcement, and what clients see when the engine's step loop dies."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerThread, tiny_engine

from pdserve.config import WorkerConfig
from pdserve.server.app import build_app

BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


def test_api_key_required_everywhere_but_health_and_metrics(engine):
    openai = pytest.importorskip("openai")
    with ServerThread(build_app(engine, WorkerConfig(api_key="sekret"))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = http.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        # The tokenizer, the API description and unknown paths are closed too; with the key they answer.
        key = {"Authorization": "Bearer sekret"}
        for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/openapi.json", None), ("GET", "/docs", None)):
            r = http.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert http.request(method, path, json=body, headers=key).status_code == 200, path
        assert http.get("/no-such-page").status_code == 401
        assert http.get("/no-such-page", headers=key).status_code == 404
        # a 401 wins over a malformed body: nothing about the request leaks to an unauthenticated client
        assert http.post("/v1/completions", content=b"{",
                         headers={"content-type": "application/json"}).status_code == 401

        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=30)
        assert good.completions.create(**BODY).usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(**BODY)


@pytest.fixture()
def broken_engine(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)

    def forward_fails(spec):  # fault injection: the model forward pass raises, as a device error would
        raise RuntimeError("simulated device failure")

    eng.engine.runner.step = forward_fails
    yield eng
    eng.shutdown()


def test_dead_engine_is_503_with_reason(broken_engine):
    with ServerThread(build_app(broken_engine, WorkerConfig())) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "simulated device failure" in r.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503
        assert "simulated device failure" in health.json()["error"]["message"]
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"model": "tiny", "stream": stream,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and "engine is not running" in r.json()["error"]["message"]
        metrics = http.get("/metrics").text
        assert 'pdserve_request_success_total{finished_reason="error"} 1.0' in metrics
