"""Fixtures: a tiny random-weight model, its tokenizer, and a real `pdserve serve` process over it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.host import free_port
from pdserve.testing import make_tiny_model
from pdserve.testing.servers import wait_for_health
from pdserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny-bench", num_layers=2, num_heads=4,
                           num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def bench_tokenizer(bench_model_dir):
    return Tokenizer.from_dir(bench_model_dir)


@pytest.fixture(scope="session")
def server_url(bench_model_dir, tmp_path_factory):
    """`pdserve serve` as a subprocess; its log goes to a file, so a full pipe can never block it."""
    port = free_port()
    log = tmp_path_factory.mktemp("bench-server") / "serve.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve",
                                 str(bench_model_dir), "--port", str(port), "--kv-cache-memory-gb", "0.0625"],
                                stdout=log_file, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, log.read_text)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
