"""The full split against transceiver-enabled workers: context_only on a context instance, then
generation_only with its disaggregated_params on a generation instance (docs/disaggregation.md).

Every test here starts workers with cache_transceiver_config; one that does not start, or does not
answer /v1/disagg_info with a backend, fails the test."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from harness import (
    MODEL_NAME,
    TOKENS_PER_BLOCK,
    AppThread,
    Occupied,
    free_port,
    start_workers,
    wait_healthy,
    worker_supports_disagg,
)

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing.wait import wait_until

PROMPT_TEXT = "Disaggregated serving runs the prefill on one instance and the decode on another"
PROMPT_IDS = list(range(30, 70))
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def _transceiver_workers(model_dir, workdir, n: int) -> list:
    ws = start_workers(model_dir, workdir, n, {"cache_transceiver_config": {"backend": "shm"}, "kv_events_port": 0})
    without = [w.url for w in ws if not worker_supports_disagg(w.url)]
    if without:
        for w in ws:
            w.stop()
        pytest.fail(f"workers {without} run with cache_transceiver_config but do not answer /v1/disagg_info "
                    "with a backend")
    return ws


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    ws = _transceiver_workers(tiny_model_dir, tmp_path_factory.mktemp("pair"), 2)
    yield ws
    for w in ws:
        w.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)


def cfg_for(ctx: list[str], gen: list[str], **kw) -> DisaggConfig:
    ctx_router = kw.pop("ctx_router", "round_robin")
    return DisaggConfig(context_servers={"urls": ctx, "router": {"type": ctx_router}},
                        generation_servers={"urls": gen}, **kw)


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_completions_equal_aggregated_streaming_and_not(pair, schedule_style):
    ctx, gen = pair
    aggregated = client(gen.url)
    expected = {p: aggregated.completions.create(model=MODEL_NAME, prompt=p, **GREEDY).choices[0].text
                for p in (PROMPT_TEXT, tuple(PROMPT_IDS))}
    with AppThread(build_app(cfg_for([ctx.url], [gen.url], schedule_style=schedule_style))) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for prompt, text in expected.items():
            prompt = list(prompt) if isinstance(prompt, tuple) else prompt
            out = c.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
            assert out.choices[0].text == text
            assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
            chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
            assert chunks[-1].usage.completion_tokens == 8
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="disaggregated"} 4.0' in metrics
    assert 'pdserve_orchestrator_worker_requests_total{role="context"} 4.0' in metrics
    assert 'pdserve_orchestrator_worker_requests_total{role="generation"} 4.0' in metrics


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_an_instance_in_both_roles_serves_its_own_requests_whole(pair, schedule_style):
    """A worker listed as a context and a generation server: a request prefilled there and routed there
    for decode as well is served there whole (context_and_generation), not sent its own id a second
    time. Before, half of these requests (round robin) failed with a 409 (duplicate request id)."""
    ctx, gen = pair
    expected = client(gen.url).completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, **GREEDY).choices[0].text
    cfg = cfg_for([ctx.url], [ctx.url, gen.url], schedule_style=schedule_style)
    with AppThread(build_app(cfg)) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for stream in (False, True, False, True):
            out = c.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, stream=stream, **GREEDY)
            text = "".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text
            assert text == expected
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="local"} 2.0' in metrics, metrics
    assert wait_until(lambda: all(w.metric("pdserve_kv_cache_blocks_free") == w.metric("pdserve_kv_cache_blocks_total")
                                  for w in pair), timeout_s=5), "a worker still holds KV"


def test_chat_equals_aggregated_streaming_and_not(pair):
    ctx, gen = pair
    messages = [{"role": "user", "content": "Where is Paris?"}]
    expected = client(gen.url).chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    with AppThread(build_app(cfg_for([ctx.url], [gen.url]))) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        out = c.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
        assert out.choices[0].message.content == expected.choices[0].message.content
        assert out.usage.prompt_tokens == expected.usage.prompt_tokens
        chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            expected.choices[0].message.content


# int64 seeds in pairs that differ by 2**32, in the sign bit, and by 2**63: each once drew its partner's tokens.
SEED_PAIRS = [(7, (1 << 32) + 7), (-1, (1 << 63) - 1), (0, -(1 << 63))]


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_seeded_draws_equal_aggregated_and_each_int64_seed_draws_its_own(pair, schedule_style):
    """The context instance draws the first token and the generation instance the rest; a draw depends on
    (seed, position) alone, so the split output is the aggregated one, streamed or not."""
    ctx, gen = pair
    kw = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    seeds = [s for p in SEED_PAIRS for s in p]
    aggregated = client(gen.url)
    expected = {s: aggregated.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, seed=s, **kw).choices[0].text
                for s in seeds}
    assert all(expected[a] != expected[b] for a, b in SEED_PAIRS), expected
    with AppThread(build_app(cfg_for([ctx.url], [gen.url], schedule_style=schedule_style))) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for s in seeds:
            assert c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, seed=s, **kw).choices[0].text == expected[s]
        chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, seed=seeds[1], stream=True, **kw))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected[seeds[1]]
        metrics = httpx.get(orch.url + "/metrics").text
    assert f'pdserve_orchestrator_requests_total{{path="disaggregated"}} {len(seeds) + 1}.0' in metrics, metrics


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_degenerate_sampling_values_keep_the_cluster_serving(pair, schedule_style):
    """temperature/top_p/repetition_penalty of 1e-300 once stopped the context worker's engine (and with
    it the cluster): each is now a normal answer, streamed or not, and greedy output is unchanged."""
    ctx, gen = pair
    expected = client(gen.url).completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, **GREEDY).choices[0].text
    with AppThread(build_app(cfg_for([ctx.url], [gen.url], schedule_style=schedule_style))) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for kw in ({"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 1e-300},
                   {"extra_body": {"repetition_penalty": 1e-300, "ignore_eos": True}}):
            kw = {"max_tokens": 6, "extra_body": {"ignore_eos": True}} | kw
            assert c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, **kw).usage.completion_tokens == 6
            chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, stream=True, **kw))
            assert chunks[-1].choices[0].finish_reason == "length"
        assert c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, **GREEDY).choices[0].text == expected
    for w in (ctx, gen):
        assert httpx.get(w.url + "/health", timeout=5).status_code == 200


def test_first_token_that_finishes_is_answered_by_the_context_worker(pair):
    ctx, gen = pair
    gen_before = gen.metric("pdserve_request_success_total")
    with AppThread(build_app(cfg_for([ctx.url], [gen.url]))) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        out = c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, temperature=0.0)
        assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "length"
        chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, temperature=0.0,
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == out.choices[0].text
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="context_finished"} 2.0' in metrics
    assert gen.metric("pdserve_request_success_total") == gen_before


def test_conditional_splits_long_text_prompts_only(pair):
    """Text prompts are counted with the worker's /tokenize: short ones stay on the generation instance."""
    ctx, gen = pair
    cfg = cfg_for([ctx.url], [gen.url], conditional_disagg={"max_local_prefill_length": 4})
    with AppThread(build_app(cfg)) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        c.completions.create(model=MODEL_NAME, prompt="Hi", **GREEDY)
        c.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, **GREEDY)
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="local"} 1.0' in metrics
    assert 'pdserve_orchestrator_requests_total{path="disaggregated"} 1.0' in metrics


@pytest.mark.slow
def test_kv_cache_aware_sends_a_repeated_prefix_to_its_holder(pair, tiny_model_dir, tmp_path_factory):
    """Two context instances; a prompt sharing a cached prefix goes back to the one that holds it, where
    it is a prefix-cache hit."""
    ctx, gen = pair
    (ctx2,) = _transceiver_workers(tiny_model_dir, tmp_path_factory.mktemp("ctx2"), 1)
    try:
        cfg = cfg_for([ctx.url, ctx2.url], [gen.url], ctx_router="kv_cache_aware")
        with AppThread(build_app(cfg)) as orch:
            wait_healthy(orch.url)
            c = client(orch.url)
            base = list(range(100, 100 + 6 * TOKENS_PER_BLOCK))
            c.completions.create(model=MODEL_NAME, prompt=base, **GREEDY)
            first = [i["selected"] for i in httpx.get(orch.url + "/cluster_info").json()
                     ["context_servers"]["instances"]]
            holder = [ctx, ctx2][first.index(1)]
            for suffix in range(3):
                # KV events travel asynchronously: give the 'stored' event a moment to arrive.
                _wait_cached(orch.url, holder.url)
                out = c.completions.create(model=MODEL_NAME, prompt=base + [200 + suffix, 7], **GREEDY)
                # The context worker's prefix-cache hit, reported in the usage the client gets.
                assert out.usage.prompt_tokens_details.cached_tokens >= len(base) - TOKENS_PER_BLOCK
            counts = [i["selected"] for i in httpx.get(orch.url + "/cluster_info").json()
                      ["context_servers"]["instances"]]
        assert counts == ([4, 0] if holder is ctx else [0, 4])
    finally:
        ctx2.stop()


def _wait_cached(orch_url: str, holder_url: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(orch_url + "/cluster_info").json()["context_servers"]["instances"]
        if any(i["url"] == holder_url and i["cached_blocks"] > 0 for i in info):
            return
        time.sleep(0.05)
    raise AssertionError(f"the orchestrator never saw KV events from {holder_url}")


def test_a_client_gone_or_a_timeout_between_the_halves_frees_the_context_kv_at_once(pair, tiny_model_dir,
                                                                                    tmp_path_factory):
    """The context instance answered, the generation instance has not pulled the KV yet (it is busy:
    max_num_seqs 1 and a queue of long requests), and the client goes away: the orchestrator tells the
    context instance to free the KV, which it does within a second, not after kv_transfer_timeout_ms
    (30 s). The same when the orchestrator's own request_timeout ends the request."""
    ctx = pair[0]
    busy = start_workers(tiny_model_dir, tmp_path_factory.mktemp("busy"), 1,
                         {"cache_transceiver_config": {"backend": "shm"}, "max_num_seqs": 1,
                          "kv_events_port": free_port()})[0]
    total = ctx.metric("pdserve_kv_cache_blocks_total")

    def freed_within_a_second(since: float) -> bool:
        while ctx.metric("pdserve_kv_cache_blocks_free") < total and time.monotonic() - since < 5:
            time.sleep(0.05)
        return ctx.metric("pdserve_kv_cache_blocks_free") == total and time.monotonic() - since < 1.0

    try:
        with Occupied(busy) as hogs:
            with AppThread(build_app(cfg_for([ctx.url], [busy.url]))) as orch:
                wait_healthy(orch.url)
                for stream in (False, True):
                    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS[:30], "max_tokens": 8, "stream": stream}
                    with pytest.raises(httpx.ReadTimeout):
                        with httpx.stream("POST", orch.url + "/v1/completions", json=body, timeout=0.5) as r:
                            r.read()
                    assert freed_within_a_second(time.monotonic())
            # The orchestrator's own timeout: a non-streaming answer must come whole within
            # request_timeout; past it the client gets a 504 saying what to do, and the KV is freed.
            with AppThread(build_app(cfg_for([ctx.url], [busy.url], request_timeout=0.5))) as orch:
                wait_healthy(orch.url)
                r = httpx.post(orch.url + "/v1/completions", timeout=30,
                               json={"model": MODEL_NAME, "prompt": PROMPT_IDS[:30], "max_tokens": 8})
                assert r.status_code == 504 and "request_timeout=0.5 s" in r.text and "stream: true" in r.text
                assert freed_within_a_second(time.monotonic())
            assert set(hogs.statuses()) == {200}
    finally:
        busy.stop()


def test_workers_with_their_own_api_key(tiny_model_dir, tmp_path_factory):
    """Keyed workers become ready, and serve both halves, only behind an orchestrator given their key."""
    keyed = {"cache_transceiver_config": {"backend": "shm"}, "api_key": "worker-secret"}
    ws = []
    try:
        ws = start_workers(tiny_model_dir, tmp_path_factory.mktemp("keyed"), 2, {**keyed, "kv_events_port": 0})
        ctx, gen = ws
        with AppThread(build_app(cfg_for([ctx.url], [gen.url], health_check_interval=0.2))) as orch:
            time.sleep(1.0)
            assert httpx.get(orch.url + "/health", timeout=5).status_code == 503  # 401s: never ready
        cfg = cfg_for([ctx.url], [gen.url], worker_api_key="worker-secret", api_key="client-secret")
        with AppThread(build_app(cfg)) as orch:
            wait_healthy(orch.url)
            out = openai.OpenAI(base_url=orch.url + "/v1", api_key="client-secret", max_retries=0).completions \
                .create(model=MODEL_NAME, prompt=PROMPT_IDS, **GREEDY)
            assert out.usage.completion_tokens == 8
            metrics = httpx.get(orch.url + "/metrics").text
        assert 'pdserve_orchestrator_requests_total{path="disaggregated"} 1.0' in metrics
    finally:
        for w in ws:
            w.stop()
