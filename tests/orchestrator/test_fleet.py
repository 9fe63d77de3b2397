"""`pdserve disaggregated` as a process: a fleet of 2 orchestrator processes sharing one port with a
coordinator on port-1, and a fleet worker that cannot reach its coordinator."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
from harness import MODEL_NAME, free_port_pair, log_of, run_cli, wait_healthy

PROMPT = [5, 17, 42, 99, 7, 123]


def test_fleet_of_two_serves_and_reports_one_cluster_state(workers, tmp_path):
    port = free_port_pair()
    cfg = {"port": port, "num_workers": 2, "health_check_interval": 0.5,
           "context_servers": {"urls": [workers[0].url]},
           "generation_servers": {"urls": [workers[0].url, workers[1].url], "router": {"type": "load_balancing"}},
           "conditional_disagg": {"max_local_prefill_length": 64}}
    proc = run_cli(tmp_path, cfg)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=60)
        processes, coordinators = set(), set()
        n = 0
        for _ in range(40):  # new connection each time: SO_REUSEPORT spreads them over both processes
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
            n += 1
            info = httpx.get(url + "/cluster_info", timeout=10)
            processes.add(info.headers["x-pdserve-process"])
            coordinators.add(info.json()["coordinator"]["pid"])
            selected = sum(i["selected"] for i in info.json()["generation_servers"]["instances"])
            assert selected == n  # every process's requests went through the one coordinator
            if len(processes) == 2 and n >= 4:
                break
        assert len(processes) == 2, f"all requests hit one process: {processes}"
        assert len(coordinators) == 1
        coord = httpx.get(f"http://127.0.0.1:{port - 1}/health", timeout=5)
        assert coord.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log_of(proc)


def test_fleet_worker_exits_when_the_coordinator_is_unreachable(tmp_path):
    dead = free_port_pair()  # nothing listens there
    cfg = {"port": free_port_pair(), "num_workers": 2, "disagg_coordinator_url": f"http://127.0.0.1:{dead}",
           "server_start_timeout": 1.0,
           "context_servers": {"urls": ["127.0.0.1:1"]}, "generation_servers": {"urls": ["127.0.0.1:2"]}}
    start = time.monotonic()
    proc = run_cli(tmp_path, cfg)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log_of(proc)
    assert proc.returncode != 0
    assert f"cannot reach the disaggregation coordinator at http://127.0.0.1:{dead}" in err
    assert "server_start_timeout=1 s" in err
    assert time.monotonic() - start < 30
