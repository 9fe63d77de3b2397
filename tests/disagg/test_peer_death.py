"""A context instance killed with -9 while it holds a request's KV: the orchestrator prefills again on
the surviving context instance and the client, whose response had not started, gets its answer (200),
equal to the aggregated greedy output."""

from __future__ import annotations

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
