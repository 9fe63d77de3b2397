"""`run_server` in its real setting: the `pdserve serve` process answers, finishes in-flight work on
SIGTERM, then exits 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx

from pdserve.host import free_port
from pdserve.testing.servers import wait_for_health


def test_pdserve_serve_answers_and_shuts_down_gracefully(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve",
                             str(tiny_model_dir), "--port", str(port), "--kv-cache-memory-gb", "0.0625"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, proc.stdout.read)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert model == tiny_model_dir.name
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": model, "prompt": "The quick", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # SIGTERM mid-stream: the in-flight stream still runs to its end, then the process exits 0.
        body = {"model": model, "prompt": "The quick", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_a_port_in_use_is_an_error_before_the_model_loads(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", str(tiny_model_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); choose another --port" in done.stderr
    assert "loading weights" not in done.stderr  # refused before any start-up work
