"""Helpers for the server tests: a real uvicorn server in a thread, the tiny engine, /metrics scraping."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from pdserve.config import EngineConfig, WorkerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.server.app import build_app
from pdserve.testing.servers import UvicornThread

MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 48
TOKENS_PER_BLOCK = 8


class ServerThread(UvicornThread):
    def __init__(self, app):
        super().__init__(app, name="uvicorn")


def tiny_engine(model_dir) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(
        model=str(model_dir), served_model_name="tiny", device="cpu", max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS, tokens_per_block=TOKENS_PER_BLOCK, max_num_tokens=256))


@contextmanager
def served(model_dir, **engine) -> Iterator[ServerThread]:
    """A real server in a thread over its own engine of `model_dir` (served as "tiny", on the CPU, `engine`'s
    EngineConfig keys beside); the engine shut down after."""
    eng = AsyncEngine.from_config(EngineConfig(model=str(model_dir), served_model_name="tiny", device="cpu", **engine))
    try:
        with ServerThread(build_app(eng, WorkerConfig(model=str(model_dir)))) as srv:
            yield srv
    finally:
        eng.shutdown()


def openai_client(srv: ServerThread):
    """The official client, pointed at `srv`, one try per call."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def scrape(http_client: httpx.Client) -> dict[str, float]:
    """Unlabelled samples of /metrics as {name: value}; labelled ones keyed as name{labels}."""
    text = http_client.get("/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+\deE.naNinf]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_kv_baseline(http_client: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until every KV block is free and nothing runs or waits; return the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(http_client)
        idle = (m["pdserve_kv_cache_blocks_free"] == m["pdserve_kv_cache_blocks_total"] == NUM_KV_BLOCKS
                and m["pdserve_num_requests_running"] == 0 and m["pdserve_num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


class EngineHold:
    """Holds the engine's step thread in its on_step hook right after the first step that produced
    output (already delivered to the request), until `release()`. Lets a test act while a request
    provably holds KV blocks and is unfinished; commands queued meanwhile (aborts) are applied on
    release, before the next step. Records every output it sees until the `with` block exits."""

    def __init__(self, engine: AsyncEngine, timeout: float = 30.0):
        self.engine, self.timeout = engine, timeout
        self.paused, self._release = threading.Event(), threading.Event()
        self.outputs: list = []
        self._previous = None

    def _hook(self, outputs) -> None:
        if self._previous is not None:
            self._previous(outputs)
        self.outputs += outputs
        if not self.paused.is_set():
            self.paused.set()
            self._release.wait(self.timeout)

    def release(self) -> None:
        self._release.set()

    def tokens_of(self, request_id: str) -> int:
        return sum(len(o.new_token_ids) for o in self.outputs if o.request_id == request_id)

    def __enter__(self) -> "EngineHold":
        self._previous = self.engine.on_step
        self.engine.on_step = self._hook
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.engine.on_step = self._previous


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
