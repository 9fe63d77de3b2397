"""Legal but extreme sampling requests against a real server: none may stop the engine, and
`max_tokens` means what docs/server.md says whether it is omitted, null or set."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, NUM_KV_BLOCKS, ServerThread, tiny_engine, wait_kv_baseline

from pdserve.config import EngineConfig, WorkerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.server.app import build_app

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
DEGENERATE = [{"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 1e-300}, {"repetition_penalty": 1e-300},
              {"temperature": 100, "top_p": 1e-300}, {"min_p": 1e-300}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fields", DEGENERATE, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_degenerate_sampling_values_are_answered(http, fields, stream):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": stream, **fields}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    else:
        assert r.json()["usage"]["completion_tokens"] == 5
    assert http.get("/health").status_code == 200
    assert wait_kv_baseline(http)["pdserve_kv_cache_blocks_free"] == NUM_KV_BLOCKS


def test_a_vanishing_temperature_is_greedy(http):
    def text(**fields):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **fields}
        return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

    assert text(temperature=1e-300) == text(temperature=0) == text(temperature=1e-6, seed=4)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_omitted_null_or_set(http, path):
    """Omitted: 16 on completions (OpenAI's default), the rest of the window on chat. null: the rest of
    the context window on both (as vLLM does). A number: that many."""
    if path == "/v1/completions":
        base = {"model": "tiny", "prompt": PROMPT, "ignore_eos": True, "temperature": 0}
    else:
        base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                "temperature": 0}

    def usage(**fields):
        r = http.post(path, json={**base, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    omitted, null, three = usage(), usage(max_tokens=None), usage(max_tokens=3)
    rest = MAX_MODEL_LEN - null["prompt_tokens"]
    assert null["completion_tokens"] == rest
    assert omitted["completion_tokens"] == (16 if path == "/v1/completions" else rest)
    assert three["completion_tokens"] == 3


def test_the_checkpoints_recommended_defaults_apply_to_fields_left_out(tiny_model_dir, tmp_path, caplog):
    """generation_config.json recommends greedy decoding and at most 5 new tokens: a chat request that
    names neither gets both; one that sets its own wins; generation_config: none ignores the file."""
    model = tmp_path / "recommending"
    shutil.copytree(tiny_model_dir, model)
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen_cfg, "temperature": 0.0, "max_new_tokens": 5,
                                                              "top_k": 0, "do_sample": True}))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    with caplog.at_level("INFO", logger="pdserve.engine.llm_engine"):
        engine = tiny_engine(model)
    try:
        assert "temperature=0.0, top_k=-1, max_tokens=5" in caplog.text
        with ServerThread(build_app(engine, WorkerConfig(model=str(model)))) as srv:
            answers = [httpx.post(srv.url + "/v1/chat/completions", json={**chat, "seed": s}, timeout=30).json()
                       for s in range(4)]
            assert {a["usage"]["completion_tokens"] for a in answers} == {5}
            assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1  # greedy: seed-independent
            own = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 7}, timeout=30).json()
            assert own["usage"]["completion_tokens"] == 7
    finally:
        engine.shutdown()
    plain = AsyncEngine.from_config(EngineConfig(model=str(model), served_model_name="tiny", device="cpu",
                                                 max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                                                 generation_config="none"))
    try:
        assert plain.sampling_defaults == {}
    finally:
        plain.shutdown()
