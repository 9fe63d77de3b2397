"""Slow clients are timed out on every listener: a worker (`pdserve serve`), an orchestrator process and
the fleet's coordinator, all real processes. Connections that send their headers a byte a second are
answered 408 and closed once `client_read_timeout_s` has passed, a body that stops arriving is cut off
the same way, and a normal request is answered meanwhile. Before, uvicorn kept such connections open
as long as the client wished (100 of them stayed 61 s and more)."""

from __future__ import annotations

import select
import signal
import socket
import threading
import time

import httpx
import pytest
from harness import MODEL_NAME, Worker, free_port_pair, log_of, run_cli

READ_TIMEOUT_S = 2.0
SLACK_S = 1.5  # the timer's own delay on a loaded 2-core machine; still far below "never"
SLOW_CLIENTS = 20
HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200  # never complete at a byte a second


@pytest.fixture(scope="module")
def listeners(tiny_model_dir, tmp_path_factory):
    """{name: port} of a worker, an orchestrator process and its coordinator, all with a 2 s read timeout."""
    tmp = tmp_path_factory.mktemp("slow-clients")
    worker = Worker(tiny_model_dir, tmp, {"client_read_timeout_s": READ_TIMEOUT_S}).wait_ready()
    port = free_port_pair()
    orch = run_cli(tmp, {"port": port, "num_workers": 2, "client_read_timeout_s": READ_TIMEOUT_S,
                         "conditional_disagg": {"max_local_prefill_length": 64},  # plain workers serve whole
                         "context_servers": {"urls": [worker.url]}, "generation_servers": {"urls": [worker.url]}})
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port) or not _healthy(port - 1):
            assert time.monotonic() < deadline and orch.poll() is None, log_of(orch)
            time.sleep(0.2)
        yield {"worker": worker.port, "orchestrator": port, "coordinator": port - 1}
    finally:
        orch.send_signal(signal.SIGTERM)
        orch.wait(timeout=30)
        worker.stop()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _slow_headers(port: int, n: int, max_s: float) -> tuple[list[float | None], list[bytes]]:
    """n connections sending HEAD a byte a second, for at most max_s: when the server closed each (s after
    it opened, None: still open), and what each received."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    closed: list[float | None] = [None] * n
    got = [b""] * n
    t0 = time.monotonic()
    try:
        for k in range(int(max_s)):
            for i, s in enumerate(socks):
                if closed[i] is None:
                    try:
                        s.send(HEAD[k:k + 1])
                    except OSError:
                        closed[i] = time.monotonic() - t0
            _read_until(socks, closed, got, t0, time.monotonic() + 1.0)
            if all(c is not None for c in closed):
                break
    finally:
        for s in socks:
            s.close()
    return closed, got


def _read_until(socks, closed, got, t0: float, end: float) -> None:
    """Take what the server sends until `end`, noting when it closes each connection."""
    while (live := [s for i, s in enumerate(socks) if closed[i] is None]) and time.monotonic() < end:
        readable, _, _ = select.select(live, [], [], max(0.0, end - time.monotonic()))
        for s in readable:
            i = socks.index(s)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            got[i] += data
            if not data:
                closed[i] = time.monotonic() - t0


def test_slow_header_senders_are_answered_408_and_closed_while_others_are_served(listeners):
    results, errors = {}, []

    def run(name, port):
        try:
            results[name] = _slow_headers(port, SLOW_CLIENTS, max_s=8)
        except Exception as e:  # noqa: BLE001 - reported below, with the listener's name
            errors.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in listeners.items()]
    for t in threads:
        t.start()
    served = []
    with httpx.Client(timeout=5) as client:
        while any(t.is_alive() for t in threads) and len(served) < 200:
            t0 = time.monotonic()
            r = client.post(f"http://127.0.0.1:{listeners['orchestrator']}/v1/completions",
                            json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
            served.append((r.status_code, time.monotonic() - t0, r.text[:300]))
            time.sleep(0.1)
    for t in threads:
        t.join(15)
    assert not errors, errors
    assert served and all(status == 200 and took < 2.0 for status, took, _ in served), served
    for name, (closed, got) in results.items():
        assert all(c is not None and c <= READ_TIMEOUT_S + SLACK_S for c in closed), (name, closed)
        assert all(g.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in g for g in got), (name, got[0])
        assert b"client_read_timeout_s" in got[0]


@pytest.mark.parametrize("name", ["worker", "orchestrator", "coordinator"])
def test_a_body_that_stops_arriving_is_cut_off(listeners, name):
    with socket.create_connection(("127.0.0.1", listeners[name]), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        closed, got = [None], [b""]
        _read_until([s], closed, got, t0, t0 + READ_TIMEOUT_S + 5)
    assert closed[0] is not None and READ_TIMEOUT_S - 0.1 <= closed[0] <= READ_TIMEOUT_S + SLACK_S, closed
    for port in listeners.values():
        assert _healthy(port)
