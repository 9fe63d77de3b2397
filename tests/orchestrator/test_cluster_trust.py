"""The cluster's trust boundary (issue 39, cases 5 and 6): a `pdserve launch` cluster with default
settings has a cluster token of its own, and nobody without it joins, removes a member, or sends a
worker disaggregated_params. One real cluster (`pdserve launch` over the tiny model) for the module;
the fake member is a small FastAPI app that answers as a real worker does."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from harness import MODEL_NAME, AppThread, start_each

from pdserve.cluster_auth import PROOF_HEADER, TOKEN_HEADER, signed_headers
from pdserve.host import free_port
from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing.servers import UvicornThread
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line, wait_until

BODY = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
INSTANCE = {"served_model_name": MODEL_NAME, "tokens_per_block": 8, "num_kv_blocks": 64, "max_model_len": 256,
            "max_num_tokens": 256}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """`pdserve launch` with no cluster_token in its file: (orchestrator url, context url, generation url,
    the log directory)."""
    tmp = tmp_path_factory.mktemp("trust")
    port, ctx_port, gen_port = free_port(), free_port(), free_port()
    spec = {"model": str(tiny_model_dir), "port": port, "log_dir": str(tmp / "logs"),
            "orchestrator": {"health_check_interval": 0.2, "lease_ttl_s": 3},
            "context": [{"port": ctx_port, "config": INSTANCE}], "generation": [{"port": gen_port, "config": INSTANCE}]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with reaped(proc):
        banner = wait_for_line(proc, "ready: OpenAI API", timeout=180)
        yield (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ctx_port}", f"http://127.0.0.1:{gen_port}",
               tmp / "logs", banner)
        stop_cleanly(proc)


def _token(log_dir) -> str | None:
    """The token launch wrote (None where it wrote none: then these tests fail at what it guards)."""
    path = log_dir / "cluster_token"
    return path.read_text().strip() if path.exists() else None


def _holder(token: str | None) -> dict[str, str]:
    return {TOKEN_HEADER: token} if token else {}


def _instances(orch: str, role: str, token: str | None) -> dict[str, dict]:
    info = httpx.get(orch + "/cluster_info", headers=_holder(token), timeout=5).json()
    return {i["url"]: i for i in info[f"{role}_servers"]["instances"]}


def test_launch_makes_a_token_that_is_on_no_command_line_and_in_no_log(cluster):
    orch, _, _, log_dir, banner = cluster
    token_file = log_dir / "cluster_token"
    token = _token(log_dir)
    assert token is not None and len(token) >= 32, f"pdserve launch wrote no {token_file}"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    for name in ("disagg.yaml", "ctx0.yaml", "gen0.yaml"):
        assert stat.S_IMODE(os.stat(log_dir / name).st_mode) == 0o600, name
    assert token not in banner and str(token_file) in banner
    for log in log_dir.glob("*.log"):
        assert token not in log.read_text(errors="replace"), log
    import psutil
    for p in psutil.process_iter(["cmdline"]):
        assert token not in " ".join(p.info["cmdline"] or ()), p.info["cmdline"]
    assert httpx.get(orch + "/cluster_info", timeout=5).status_code == 401
    assert httpx.get(orch + "/cluster_info", headers={TOKEN_HEADER: token}, timeout=5).status_code == 200
    r = httpx.post(orch + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _fake_worker(real: str, relay_nonce: bool) -> tuple[FastAPI, list]:
    """An HTTP server that answers /health, /v1/models and /v1/disagg_info as the real worker at `real`
    does (with `relay_nonce`, it even passes the orchestrator's challenge on to it and answers with the
    real worker's proof), and answers every completion with "PWNED", keeping the bodies it received."""
    app, received = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return httpx.get(real + "/v1/models", timeout=5).json()

    @app.get("/v1/disagg_info")
    async def disagg_info(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-cluster")} if relay_nonce else {}
        return httpx.get(real + "/v1/disagg_info", headers=headers, timeout=5).json()

    @app.post("/v1/completions")
    async def completions(request: Request):
        received.append(await request.json())
        return JSONResponse({"id": "x", "object": "text_completion", "model": MODEL_NAME,
                             "choices": [{"index": 0, "text": "PWNED", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    return app, received


def test_a_server_that_echoes_a_real_worker_cannot_join_and_never_sees_a_request(cluster):
    """Case 5. Before, the fake was admitted as a generation member (it presents the same model) and got
    the orchestrator's generation_only requests, with the clients' bodies, and its "PWNED" reached them."""
    orch, _, gen, log_dir, _ = cluster
    app, received = _fake_worker(gen, relay_nonce=True)
    with UvicornThread(app, name="fake worker") as fake:
        join = {"role": "generation", "url": fake.url}
        for headers in ({}, signed_headers("guessed", "join", "generation", fake.url),
                        {**signed_headers("guessed", "join", "generation", fake.url), PROOF_HEADER: "00" * 32},
                        {TOKEN_HEADER: "guessed"}):
            r = httpx.post(orch + "/cluster/join", json=join, headers=headers, timeout=10)
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_cluster_token" and "cluster_token" in err["message"], err
        assert fake.url not in _instances(orch, "generation", _token(log_dir))
        for _ in range(4):
            r = httpx.post(orch + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200 and "PWNED" not in r.text, r.text
        assert received == []


def test_an_instance_that_cannot_prove_the_token_is_never_routed_to_even_when_listed(cluster):
    """The orchestrator challenges every instance, those of its YAML too: one that echoes a real
    worker but holds no token stays out of routing, saying why."""
    _, ctx, gen, log_dir, _ = cluster
    app, received = _fake_worker(gen, relay_nonce=False)
    with UvicornThread(app, name="fake worker") as fake, AppThread(build_app(DisaggConfig(
            health_check_interval=0.2, cluster_token=_token(log_dir), context_servers={"urls": [ctx]},
            generation_servers={"urls": [fake.url]}))) as orch:
        token = _token(log_dir)
        assert wait_until(lambda: "did not prove" in _instances(orch.url, "generation", token)[fake.url]["status"], 5)
        assert not _instances(orch.url, "generation", token)[fake.url]["ready"]
        r = httpx.post(orch.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and received == [], r.text
    # the other way round: an orchestrator without the token would have every request refused by the
    # workers, so it routes to none and says why
    with AppThread(build_app(DisaggConfig(health_check_interval=0.2, context_servers={"urls": [ctx]},
                                          generation_servers={"urls": [gen]}))) as orch:
        why = lambda: _instances(orch.url, "generation", None)[gen].get("status") or ""  # noqa: E731
        assert wait_until(lambda: "has a cluster_token and this orchestrator has none" in why(), 5), why()
        assert httpx.post(orch.url + "/v1/completions", json=BODY, timeout=30).status_code == 503


def _wire_tap(orch: str) -> tuple[FastAPI, list]:
    """A relay that a member joins through (its --join url): it forwards every membership call to `orch`
    and keeps what it saw on the wire, (path, body, the X-Cluster-* headers), as an observer would."""
    app, seen = FastAPI(), []

    @app.post("/cluster/{call}")
    async def relay(call: str, request: Request):
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-cluster")}
        seen.append(("/cluster/" + call, body, headers))
        r = httpx.post(orch + "/cluster/" + call, json=body, headers=headers, timeout=10)
        return JSONResponse(r.json(), status_code=r.status_code)

    return app, seen


def test_a_member_joined_by_hand_cannot_be_removed_without_the_token_nor_by_a_replay(cluster, tiny_model_dir,
                                                                                      tmp_path):
    """Case 6 of issue 39: an instance started by hand with the token launch wrote joins and serves; a
    leave (or a heartbeat) without the token is refused and the member stays. Case 4 of issue 51: its
    join and heartbeat, as its own code sent them and an observer saw them on the wire, are each a 401
    naming the replay when sent again; so is its leave once taken: it joins again, and the same leave
    replayed leaves it routed. Before, each replay was taken: the leave removed the live worker until
    its next heartbeat, every time."""
    orch, _, _, log_dir, _ = cluster
    token = _token(log_dir)
    assert token is not None, "pdserve launch wrote no cluster_token"
    app, seen = _wire_tap(orch)
    with UvicornThread(app, name="wire tap") as tap:
        (member,) = start_each(tiny_model_dir, tmp_path, [{"join": tap.url, "role": "generation",
                                                           "cache_transceiver_config": {"backend": "shm",
                                                                                        "cluster_token": token}}])
        try:
            ready = lambda: _instances(orch, "generation", token).get(member.url, {}).get("ready")  # noqa: E731
            assert wait_until(ready, 20), member.log_path.read_text()[-2000:]
            for path in ("/cluster/leave", "/cluster/heartbeat"):
                for headers in ({}, signed_headers("guessed", path.rsplit("/", 1)[1], member.url)):
                    r = httpx.post(orch + path, json={"url": member.url}, headers=headers, timeout=10)
                    assert r.status_code == 401 and "cluster_token" in r.json()["error"]["message"], r.text
            assert wait_until(lambda: any(path == "/cluster/heartbeat" for path, _, _ in seen), 10)
            for path in ("/cluster/join", "/cluster/heartbeat"):
                _, body, headers = next(call for call in seen if call[0] == path)
                r = httpx.post(orch + path, json=body, headers=headers, timeout=10)
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert err["code"] == "invalid_cluster_proof" and "a replay" in err["message"], err
            time.sleep(0.5)  # a probe round: a leave taken would have dropped it by now
            assert ready()
            leave = signed_headers(token, "leave", member.url)  # what the member sends when it drains
            r = httpx.post(orch + "/cluster/leave", json={"url": member.url}, headers=leave, timeout=10)
            assert r.status_code == 200 and r.json() == {"left": True}, r.text  # the member's own leave is taken
            assert wait_until(ready, 10), "the member did not join again after its leave"
            for _ in range(3):
                r = httpx.post(orch + "/cluster/leave", json={"url": member.url}, headers=leave, timeout=10)
                assert r.status_code == 401 and "a replay" in r.json()["error"]["message"], r.text
            time.sleep(0.5)
            assert ready()
            r = httpx.post(orch + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            member.stop()


def test_join_without_the_token_is_refused_naming_it(cluster, tiny_model_dir, tmp_path):
    """A `pdserve serve --join` with no cluster_token: it warns that its internal endpoints are open, the
    orchestrator refuses it (401 naming cluster_token) and it is never a member."""
    orch, _, _, log_dir, _ = cluster
    (stranger,) = start_each(tiny_model_dir, tmp_path, [{"join": orch, "role": "generation",
                                                         "cache_transceiver_config": {"backend": "shm"}}])
    try:
        log = lambda: stranger.log_path.read_text()  # noqa: E731
        assert wait_until(lambda: "refused /cluster/join (401)" in log(), 20), log()
        assert "cluster_token" in log().split("refused /cluster/join (401)")[1]
        assert "NO cluster_token" in log() and "open to anyone" in log()
        assert stranger.url not in _instances(orch, "generation", _token(log_dir))
    finally:
        stranger.stop()


def test_a_clients_own_disaggregated_params_are_refused_without_the_token(cluster):
    """A worker of the cluster takes disaggregated_params, and /v1/disagg/*, from the holder of its
    token only: 401 naming the header. Before, a client could send them straight to a worker."""
    _, ctx, gen, log_dir, _ = cluster
    token = _token(log_dir)
    half = {**BODY, "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1 << 41}}
    for url, body in ((ctx, half), (gen, {**BODY, "disaggregated_params": {"request_type": "context_and_generation"}})):
        for headers in ({}, {TOKEN_HEADER: "guessed"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_cluster_token" and TOKEN_HEADER in err["message"], err
    r = httpx.post(ctx + "/v1/disagg/release", json={"disagg_request_id": 1 << 41}, timeout=10)
    assert r.status_code == 401 and TOKEN_HEADER in r.json()["error"]["message"], r.text
    r = httpx.post(ctx + "/v1/completions", json=half, headers=_holder(token), timeout=30)
    assert r.status_code == 200 and r.json()["disaggregated_params"] is not None, r.text
    r = httpx.post(ctx + "/v1/disagg/release", json={"disagg_request_id": 1 << 41}, headers=_holder(token),
                   timeout=10)
    assert r.status_code == 200 and r.json()["released"], r.text
    assert httpx.post(gen + "/v1/completions", json=BODY, timeout=30).status_code == 200  # plain requests: open
