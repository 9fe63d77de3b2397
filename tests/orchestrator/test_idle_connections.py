"""An idle keep-alive connection outlives the clients' own idle limit (httpx and the OpenAI client drop
theirs after 5 s). uvicorn closed its connections after 5 s too, and a client that reused one at that
moment lost its request ("Server disconnected without sending a response"), as a few requests in
benchmarks/membership_churn.py did. Both real servers, the worker and the orchestrator."""

from __future__ import annotations

import http.client
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from harness import free_port_pair, log_of, run_cli

CLIENT_IDLE_S = 5.0  # httpx.Limits().keepalive_expiry


def _two_requests_idle_between(port: int, idle_s: float) -> list[str]:
    """GET /health, stay idle, GET /health again on the same connection: the statuses (or the error)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    try:
        for i in range(2):
            if i:
                time.sleep(idle_s)
            try:
                conn.request("GET", "/health")
                r = conn.getresponse()
                r.read()
                out.append(str(r.status))
            except (OSError, http.client.HTTPException) as e:
                out.append(type(e).__name__)
    finally:
        conn.close()
    return out


def test_idle_connections_stay_open_longer_than_clients_keep_them(workers, tmp_path):
    port = free_port_pair()
    orch = run_cli(tmp_path, {"port": port, "context_servers": {"urls": [workers[0].url]},
                              "generation_servers": {"urls": [workers[1].url]}})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and orch.poll() is None, log_of(orch)
                time.sleep(0.1)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: _two_requests_idle_between(p, CLIENT_IDLE_S + 0.5),
                                    [workers[0].port, port]))
        for name, lines in zip(("worker", "orchestrator"), answers):
            assert all(status.isdigit() for status in lines), (name, lines)
    finally:
        orch.send_signal(signal.SIGTERM)
        orch.wait(timeout=30)
