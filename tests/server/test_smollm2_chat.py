"""The real default model through the real server: SmolLM2 knows the capital of France."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerThread

from pdserve.config import EngineConfig, WorkerConfig
from pdserve.server.app import build_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_chat_says_paris(smollm2_path, pdserve_cache):
    pytest.importorskip("pdserve.weights.resolve", reason="pdserve.weights.resolve (the default model) is missing")
    openai = pytest.importorskip("openai")
    from pdserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=None, cache_dir=str(pdserve_cache), device="cpu",
                                                  max_model_len=512))
    try:
        with ServerThread(build_app(engine, WorkerConfig())) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0)
            assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content
            assert reply.usage.prompt_tokens > 5 and reply.usage.completion_tokens >= 1
            chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0,
                                                    stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == reply.choices[0].message.content
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        engine.shutdown()
