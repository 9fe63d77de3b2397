"""Fixtures: a real uvicorn server on 127.0.0.1 (free port, own thread) over a tiny random-weight model,
the official openai client and an httpx client pointed at it."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerThread, tiny_engine

from pdserve.config import WorkerConfig
from pdserve.server.app import build_app
from pdserve.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", num_layers=2, num_heads=4,
                           num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    with ServerThread(build_app(engine, WorkerConfig(model=engine.engine.ecfg.model))) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture()
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)


