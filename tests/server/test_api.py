"""The OpenAI API through the official client against a real server: streaming == non-streaming,
usage, logprobs, stops, seeds, extensions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model

from server_harness import MAX_MODEL_LEN, TOKENS_PER_BLOCK, scrape, served, wait_kv_baseline

PROMPTS = ["The capital of France is", "def forward(self, hidden_states):", "Numbers: 1 2 3",
           "Unicode: café naïve 日本語"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def engine_run(engine, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Ground truth straight from the engine, bypassing HTTP."""
    async def go():
        ids, text = [], ""
        async for out in engine.generate(prompt_ids, params):
            ids += out.new_token_ids
            text += out.new_text
        return ids, text
    return asyncio.run(go())


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_models_and_health(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_equals_nonstream_equals_engine(client, engine, prompt):
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
    streamed, chunks = stream_text(client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                                             stream=True, **GREEDY))
    ids = engine.tokenizer.encode(prompt)
    _, truth = engine_run(engine, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert full.choices[0].text == streamed == truth
    assert full.choices[0].finish_reason == "length" == chunks[-1].choices[0].finish_reason
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == len(ids) + 12


def test_completion_accepts_token_ids(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_stream_equals_nonstream_with_usage(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == text
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == full.usage.completion_tokens == 10
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens == len(
        engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_max_completion_tokens_and_content_parts(client):
    parts = [{"type": "text", "text": "Tensor parallelism"}, {"type": "text", "text": "splits weights"}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                       max_completion_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_prefix_cache_hit_is_reported(client, http):
    wait_kv_baseline(http)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # several full blocks
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % TOKENS_PER_BLOCK == 0 and cached < second.usage.prompt_tokens
    assert first.choices[0].text == second.choices[0].text


def test_completion_logprobs(client):
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=8, logprobs=3, **GREEDY)
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4 and top[tok] == logprob
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert streamed == pytest.approx(lp.token_logprobs, rel=1e-4)  # prefix-cache hit: ulp-level drift


def test_chat_logprobs(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
              top_logprobs=2, **GREEDY)
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes is None if entry.token.startswith("token_id:") else entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], rel=1e-4)
    no_lp = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert no_lp.choices[0].logprobs is None


def test_stop_string_stream_and_not(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, **GREEDY).choices[0].text
    stop = base[5:8]
    assert stop.strip(), f"pick a visible stop string from {base!r}"
    expected = base[:base.index(stop)]
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, stop=[stop], **GREEDY)
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop" and full.choices[0].model_extra["stop_reason"] == stop
    streamed, _ = stream_text(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                                        stop=stop, stream=True, **GREEDY))
    assert streamed == expected


def test_stop_token_ids_extension(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[2])
    tokens, _ = engine_run(engine, ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    at = tokens.index(tokens[4])  # first occurrence of the 5th token
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10,
                                  temperature=0.0, extra_body={"ignore_eos": True, "stop_token_ids": [tokens[at]]})
    assert r.usage.completion_tokens == at + 1
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == tokens[at]
    # the same id repeated, among others the output never holds, and kept back by min_tokens at first
    absent = [t for t in range(engine.engine.model_cfg.vocab_size) if t not in tokens][:50]
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=0.0,
                                  extra_body={"ignore_eos": True, "min_tokens": at,
                                              "stop_token_ids": (absent + [tokens[at]]) * 200})
    assert r.usage.completion_tokens == at + 1 and r.choices[0].model_extra["stop_reason"] == tokens[at]


def test_seed_reproducible_and_sampling_extensions(client):
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_logit_bias_and_openai_penalties_reach_the_sampler(client, engine):
    """A +100 bias makes greedy decoding pick one token every time, a -100 bias on greedy's first token
    moves it, and the openai client gets what the engine gives for the same SamplingParams, penalties
    included."""
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=24, logprobs=0, **GREEDY)
    ids = engine.engine.tokenizer.encode(PROMPTS[0])

    def engine_side(**params):
        return engine_run(engine, ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **params))

    plain_ids, _ = engine_side()
    forced_ids, forced_text = engine_side(logit_bias={42: 100.0})
    assert forced_ids == [42] * 24
    assert client.completions.create(**kw, logit_bias={"42": 100}).choices[0].text == forced_text
    banned_ids, banned_text = engine_side(logit_bias={plain_ids[0]: -100.0})
    assert banned_ids[0] != plain_ids[0]
    assert client.completions.create(**kw, logit_bias={str(plain_ids[0]): -100}).choices[0].text == banned_text
    penalised_ids, penalised_text = engine_side(presence_penalty=2.0, frequency_penalty=1.0)
    assert penalised_ids != plain_ids  # the penalties change this output, so dropping them would show
    penalised = client.completions.create(**kw, presence_penalty=2.0, frequency_penalty=1.0).choices[0]
    assert penalised.text == penalised_text


def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[3]}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith(PROMPTS[3])
    bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenize_counts_past_the_window_but_refuses_what_its_length_proves_too_long(http, engine):
    """A prompt longer than the context window is still counted (as vLLM counts it); one whose length in
    characters alone proves it longer is refused before it is encoded: a megabyte holds the event loop
    for about a second, and an orchestrator tokenizing a 30 MiB prompt to route it found this instance's
    /health silent for 34 s and took it out of routing (measured by hand, 2026-12-06)."""
    window = engine.max_model_len
    counted = http.post("/tokenize", json={"prompt": "fox " * window})
    assert counted.status_code == 200 and counted.json()["count"] > window
    refused = http.post("/tokenize", json={"prompt": "fox " * (1 << 18)})
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"] and error["param"] == "prompt"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "fox " * (1 << 18)}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def long_window_url(tmp_path_factory):
    """A server whose context window (65536 positions) lets a prompt of 850 K characters past the
    length bound, so that it is encoded."""
    model = make_tiny_model(tmp_path_factory.mktemp("long") / "m", num_layers=1, num_heads=2, num_kv_heads=1,
                            max_position_embeddings=1 << 16)
    with served(model, max_model_len=1 << 16, num_kv_blocks=16, tokens_per_block=8) as srv:
        yield srv.url


def test_a_long_prompt_is_encoded_without_holding_the_event_loop(long_window_url):
    """A prompt of 800 K characters is encoded (its length does not prove it too long), which takes about
    half a second. The event loop answers /health meanwhile: before, it waited for the whole encode (and so
    did every stream of every other client)."""
    prompt = "fox " * 200_000
    answer: dict = {}
    sender = threading.Thread(target=lambda: answer.update(r=httpx.post(
        long_window_url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=120)))
    longest = 0.0
    with httpx.Client(base_url=long_window_url, timeout=120) as http:
        start = time.monotonic()
        sender.start()
        while sender.is_alive():
            asked = time.monotonic()
            assert http.get("/health").status_code == 200
            longest = max(longest, time.monotonic() - asked)
            time.sleep(0.01)
        took = time.monotonic() - start
    r = answer["r"]
    assert r.status_code == 400, r.text[:300]
    assert "your prompt has 400001 tokens" in r.json()["error"]["message"]  # encoded, not refused by its length
    assert longest < took / 2, f"/health waited {longest:.2f} s while the prompt took {took:.2f} s"


def test_concurrent_streams_match_sequential(client):
    kw = dict(model="tiny", max_tokens=16, **GREEDY)
    sequential = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        parallel = list(pool.map(lambda p: stream_text(client.completions.create(prompt=p, stream=True, **kw))[0],
                                 PROMPTS))
    assert parallel == sequential


def test_metrics_count_requests(client, http):
    before = scrape(http)
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, **GREEDY)
    after = wait_kv_baseline(http)
    assert after["pdserve_kv_cache_blocks_used"] == 0
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_e2e_request_latency_seconds_count",
                 "pdserve_time_per_output_token_seconds_count"):
        assert after[name] == before.get(name, 0) + 1, name
    assert (after["pdserve_inter_token_latency_seconds_count"]
            == before.get("pdserve_inter_token_latency_seconds_count", 0) + 4)
    assert after["pdserve_generation_tokens_total"] == before.get("pdserve_generation_tokens_total", 0) + 5
    assert after["pdserve_prompt_tokens_total"] > before.get("pdserve_prompt_tokens_total", 0)
    key = 'pdserve_request_success_total{finished_reason="length"}'
    assert after[key] == before.get(key, 0) + 1
    # The engine's steps: the prompt in one prefill step (256-token steps), then four decode steps.
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew['pdserve_engine_step_seconds_count{kind="prefill"}'] == 1
    assert grew['pdserve_engine_step_seconds_count{kind="decode"}'] == 4
    assert grew['pdserve_engine_step_tokens_total{kind="decode"}'] == 4
    assert grew['pdserve_engine_step_tokens_total{kind="prefill"}'] >= 1
    assert grew['pdserve_engine_step_seconds_sum{kind="decode"}'] > 0


def _events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _text(event: dict) -> str:
    choice = event["choices"][0]
    return choice["text"] if "text" in choice else (choice["delta"].get("content") or "")


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 20}),
    ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 20, "temperature": 1.0, "seed": 11,
                         "presence_penalty": 0.7}),
], ids=["completions", "chat", "seeded"])
def test_a_stream_resumed_from_another_instances_output_goes_on_as_it_would_have(http, path, extra):
    """What the orchestrator sends when a stream's instance is lost: the output so far (token ids, from
    return_token_ids) and how much of its text the client has. The rest of the stream is the rest of the
    stream the lost instance would have sent: same ids, text, id, usage, seeded draws included."""
    body = {"model": "tiny", "stream": True, "return_token_ids": True, "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, **extra}
    full = _events(http, path, body)
    rows = [e for e in full if e["choices"]]
    opening = "delta" in rows[0]["choices"][0]  # chat's role chunk: no token
    assert all("token_ids" in e["choices"][0] for e in rows[opening:])
    ids = [t for e in rows[opening:] for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 20
    for cut in (0, 1, 7, 15):  # 0: chat's role chunk only, or nothing
        head = rows[:cut + opening]
        done = [t for e in head[opening:] for t in e["choices"][0]["token_ids"]]
        sent = sum(len(_text(e)) for e in head)
        rest = _events(http, path, {**body, "resume": {"token_ids": done, "sent_chars": sent, "id": full[0]["id"],
                                                       "created": full[0]["created"]}})
        rest_rows = [e for e in rest if e["choices"]]
        assert done + [t for e in rest_rows for t in e["choices"][0]["token_ids"]] == ids
        assert "".join(map(_text, head + rest_rows)) == "".join(map(_text, rows))
        assert {(e["id"], e["created"]) for e in rest} == {(full[0]["id"], full[0]["created"])}
        usage = {k: v for k, v in full[-1]["usage"].items() if k != "prompt_tokens_details"}  # (its cache hits)
        assert {k: v for k, v in rest[-1]["usage"].items() if k != "prompt_tokens_details"} == usage
        assert rest_rows[-1]["choices"][0]["finish_reason"] == "length"
    plain = _events(http, path, {k: v for k, v in body.items() if k != "return_token_ids"})
    assert all("token_ids" not in e["choices"][0] for e in plain if e["choices"])


@pytest.mark.parametrize("resume,says,param", [
    ({"token_ids": [5] * 8, "sent_chars": 0}, "nothing is left to generate", "resume.token_ids"),
    ({"token_ids": [5, 6], "sent_chars": 10**6}, "characters resume.token_ids stand for", "resume.sent_chars"),
    ({"token_ids": [5, 10**6], "sent_chars": 0}, "resume.token_ids must be in", "resume.token_ids"),
], ids=["all-of-max-tokens", "more-text-than-ids", "out-of-vocab"])
def test_a_resume_that_cannot_be_is_a_400(http, resume, says, param):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "stream": True, "resume": resume}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    r = http.post("/v1/completions", json={**body, "stream": False, "resume": {"token_ids": [5], "sent_chars": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume"
