"""Context instances leaving a cluster under load. Killed with -9 while holding a request's KV: the
orchestrator prefills again on the surviving instance and the client, whose response had not started,
gets its answer (200), equal to the aggregated greedy output. Sent SIGTERM: it drains, and no request
fails."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from harness import MODEL_NAME, AppThread, Occupied, free_port, start_workers, wait_healthy

from pdserve.disagg.app import build_app
from pdserve.disagg.config import DisaggConfig

pytestmark = pytest.mark.faults
PROMPT = list(range(100, 140))
TRANSCEIVER = {"backend": "shm", "rank_info_timeout_s": 2.0, "kv_transfer_timeout_ms": 4000}


def _holds_kv(worker) -> bool:
    return worker.metric("pdserve_kv_cache_blocks_free") < worker.metric("pdserve_kv_cache_blocks_total")


def test_a_context_instance_killed_holding_the_kv_is_replaced(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("death")
    ws = []
    try:
        for extra in ({}, {}, {"max_num_seqs": 1}):  # two context instances, one busy generation instance
            ws += start_workers(tiny_model_dir, workdir, 1, {"cache_transceiver_config": TRANSCEIVER,
                                                             "kv_events_port": free_port(), **extra})
        doomed, survivor, gen = ws
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(gen.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        cfg = DisaggConfig(context_servers={"urls": [doomed.url, survivor.url]},
                           generation_servers={"urls": [gen.url]}, max_retries=1, health_check_interval=60)
        with AppThread(build_app(cfg)) as orch, Occupied(gen, n=16):
            wait_healthy(orch.url)
            with httpx.Client(base_url=orch.url, timeout=60) as client:
                pending = client.build_request("POST", "/v1/completions", json=body)
                response = {}

                def send():
                    response["r"] = client.send(pending)

                sender = threading.Thread(target=send)
                sender.start()
                # Round robin sent it to the doomed instance first: wait for its prefill, then kill it.
                deadline = time.monotonic() + 10
                while not _holds_kv(doomed) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert time.monotonic() < deadline, "the doomed instance never held the request's KV"
                killed = time.monotonic()
                doomed.stop()  # SIGKILL
                sender.join(60)
                answered = time.monotonic() - killed
        r = response["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert not _holds_kv(survivor)
        print(f"answered {answered:.2f} s after the kill")
    finally:
        for w in ws:
            w.stop()


def test_sigterm_drains_a_context_instance_under_load(tiny_model_dir, tmp_path_factory):
    """SIGTERM to one of two context instances while it holds KV the (busy) generation instance has not
    pulled yet, with requests flowing: it answers 503 draining at once (the orchestrator routes
    elsewhere), lets the pulls finish, then exits 0. Not one request fails."""
    workdir = tmp_path_factory.mktemp("drain")
    ws = []
    try:
        for extra in ({}, {}, {"max_num_seqs": 1}):
            ws += start_workers(tiny_model_dir, workdir, 1, {"cache_transceiver_config": TRANSCEIVER,
                                                             "kv_events_port": free_port(), "drain_timeout_s": 30,
                                                             **extra})
        draining, other, gen = ws
        prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = [httpx.post(gen.url + "/v1/completions", json={**body, "prompt": p}, timeout=30)
                    .json()["choices"][0]["text"] for p in prompts]
        cfg = DisaggConfig(context_servers={"urls": [draining.url, other.url]},
                           generation_servers={"urls": [gen.url]}, max_retries=1, health_check_interval=60)
        results: list[tuple[int, str]] = []

        def load(n: int) -> None:
            with httpx.Client(base_url=orch.url, timeout=60) as client:
                for i in range(n):
                    r = client.post("/v1/completions", json={**body, "prompt": prompts[i % len(prompts)]})
                    ok = r.status_code == 200 and r.json()["choices"][0]["text"] == expected[i % len(prompts)]
                    results.append((r.status_code, "right" if ok else r.text))

        with AppThread(build_app(cfg)) as orch, Occupied(gen, n=16):
            wait_healthy(orch.url)
            threads = [threading.Thread(target=load, args=(6,)) for _ in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while not _holds_kv(draining) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _holds_kv(draining), "the instance to drain never held KV"
            draining.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            health = httpx.get(draining.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
            assert draining.proc.wait(timeout=40) == 0
            for t in threads:
                t.join(90)
        assert len(results) == 24
        assert [r for r in results if r != (200, "right")] == []
    finally:
        for w in ws:
            w.stop()
