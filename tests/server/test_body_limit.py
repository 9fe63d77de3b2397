"""A request body over max_request_body_mb (32 MiB by default) is refused with a 413 before it is read
into memory, on `pdserve serve`, the orchestrator and the coordinator alike; whether the client declared
its length or sent it in chunks. Before, the whole body was read first, whatever its size: a client
could grow the process until the kernel killed it."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_harness import ServerThread, wait_kv_baseline

from pdserve.config import WorkerConfig
from pdserve.orchestrator.app import build_app as build_orchestrator
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.coordinator import build_coordinator_app
from pdserve.server.app import build_app

MIB = 1 << 20
# over the default cap, and under what the server reads and throws away (4x) before it answers, so the
# client, still sending, gets the 413 rather than a reset connection
BIG = b'{"model": "tiny", "max_tokens": 1, "prompt": "' + b"a" * (40 * MIB) + b'"}'


def _chunks(data: bytes, size: int = MIB):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _refused(r: httpx.Response, limit: int = 32 * MIB) -> None:
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error", error
    assert f"over the limit of {limit} bytes" in error["message"] and "max_request_body_mb" in error["message"]


@pytest.mark.parametrize("sent", ["with its length", "in chunks"])
def test_a_body_over_the_cap_is_a_413_and_the_server_serves_on(server, http, sent):
    content = BIG if sent == "with its length" else _chunks(BIG)
    _refused(http.post("/v1/completions", content=content, headers={"content-type": "application/json"}))
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    wait_kv_baseline(http)


def test_a_client_that_waits_for_100_continue_sends_nothing(server):
    """Expect: 100-continue and a declared 64 GiB: the 413 comes at once, and nothing is asked for."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (64 << 30))
        answer = b""
        while b"request_too_large" not in answer and (chunk := s.recv(65536)):  # bounded by the timeout
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]


def test_the_cap_is_a_setting_and_auth_comes_first(engine):
    cfg = WorkerConfig(model=engine.engine.ecfg.model, max_request_body_mb=1 / 16, api_key="k")
    with ServerThread(build_app(engine, cfg)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "tiny", "prompt": "a" * (65 * 1024), "max_tokens": 1}
        assert http.post("/v1/completions", json=body).status_code == 401  # no key: 401, not 413
        _refused(http.post("/v1/completions", json=body, headers={"authorization": "Bearer k"}), 64 * 1024)
        small = {**body, "prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=small, headers={"authorization": "Bearer k"}).status_code == 200


@pytest.mark.parametrize("app", ["orchestrator", "coordinator"])
def test_the_orchestrator_and_its_coordinator_refuse_it_too(server, app):
    cfg = DisaggConfig(context_servers={"urls": [], "minimal_instances": 0}, generation_servers={"urls": [server.url]})
    built = build_orchestrator(cfg) if app == "orchestrator" else build_coordinator_app(cfg)
    path = "/v1/completions" if app == "orchestrator" else "/cluster/join"
    with ServerThread(built) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        _refused(http.post(path, content=_chunks(BIG), headers={"content-type": "application/json"}))
        if app == "orchestrator":
            r = http.post(path, json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
