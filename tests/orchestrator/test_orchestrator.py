"""The orchestrator against real `pdserve serve` workers (plain ones: no transceiver needed here).

Conditional disaggregation sends short prompts straight to a generation instance as
context_and_generation, so these paths work with any worker. The full context_only -> generation_only
split is in test_disagg_flow.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from harness import MODEL_NAME, AppThread, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig

PROMPT = [5, 17, 42, 99, 7, 123, 64, 31]  # token ids: no /tokenize needed to count them
LONG_PROMPT = list(range(10, 40))
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def make_cfg(ctx: list[str], gen: list[str], **kw) -> DisaggConfig:
    router = kw.pop("router", "round_robin")
    return DisaggConfig(context_servers={"urls": ctx}, generation_servers={"urls": gen, "router": {"type": router}},
                        **kw)


def orchestrator(cfg: DisaggConfig) -> AppThread:
    return AppThread(build_app(cfg))


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, timeout=30, max_retries=0)


def direct(worker_url: str, prompt, stream: bool = False) -> str:
    out = client(worker_url).completions.create(model=MODEL_NAME, prompt=prompt, extra_body={"ignore_eos": True},
                                                temperature=0.0, max_tokens=6, stream=stream)
    return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text


def test_conditional_goes_straight_to_generation(workers):
    ctx, gen = workers[0], workers[1]
    cfg = make_cfg([ctx.url], [gen.url], conditional_disagg={"max_local_prefill_length": 64})
    expected = direct(gen.url, PROMPT)
    ctx_before, gen_before = ctx.metric("pdserve_request_success_total"), gen.metric("pdserve_request_success_total")
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
        assert out.choices[0].text == expected
        assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 6
        streamed = c.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                        stream=True, stream_options={"include_usage": True}, **GREEDY)
        chunks = list(streamed)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
        assert chunks[-1].usage.completion_tokens == 6
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="local"} 2.0' in metrics
    assert 'pdserve_orchestrator_worker_requests_total{role="context"} 0.0' in metrics
    assert gen.metric("pdserve_request_success_total") == gen_before + 2
    assert ctx.metric("pdserve_request_success_total") == ctx_before


def test_no_context_instance_and_none_required_serves_aggregated(workers):
    """context_servers.minimal_instances: 0 and no context instance (`pdserve launch` with `context: []`):
    the generation instances serve whole requests, routed round robin, with no tokenize hop; the
    orchestrator is healthy without any context instance. With the default minimal_instances (1) the
    same config is a 503 that names the missing role."""
    gens = [workers[0].url, workers[1].url]
    expected = direct(gens[0], PROMPT)
    cfg = DisaggConfig(context_servers={"urls": [], "minimal_instances": 0}, generation_servers={"urls": gens})
    before = [w.metric("pdserve_request_success_total") for w in workers[:2]]
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for _ in range(2):
            out = c.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
            assert out.choices[0].text == expected and out.usage.completion_tokens == 6
        streamed = c.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == expected
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_requests_total{path="local"} 3.0' in metrics
    assert 'pdserve_orchestrator_worker_requests_total{role="context"} 0.0' in metrics
    after = [w.metric("pdserve_request_success_total") for w in workers[:2]]
    assert sum(after) - sum(before) == 3 and all(a > b for a, b in zip(after, before))  # both served
    with orchestrator(make_cfg([], gens)) as orch:
        r = httpx.get(orch.url + "/health", timeout=5)
        assert r.status_code == 503 and "context" in r.text


def test_chat_conditional_needs_tokenize_or_says_why(workers):
    """A text prompt must be tokenized by a worker to count its tokens; without /tokenize the client
    gets a 502 that says so, never a silent guess."""
    cfg = make_cfg([workers[0].url], [workers[1].url], conditional_disagg={"max_local_prefill_length": 64})
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        has_tokenize = httpx.post(workers[1].url + "/tokenize", json={"prompt": "hi"}).status_code == 200
        if has_tokenize:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        else:
            assert r.status_code == 502 and "/tokenize" in r.json()["error"]["message"]


def test_round_robin_spreads_over_two_generation_instances(workers):
    w0, w1 = workers[0], workers[1]
    cfg = make_cfg([w0.url], [w0.url, w1.url], conditional_disagg={"max_local_prefill_length": 64})
    before = [w.metric("pdserve_request_success_total") for w in (w0, w1)]
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        c = client(orch.url)
        for i in range(4):
            c.completions.create(model=MODEL_NAME, prompt=PROMPT[: 4 + i], **GREEDY)
        info = httpx.get(orch.url + "/cluster_info").json()
    after = [w.metric("pdserve_request_success_total") for w in (w0, w1)]
    assert [a - b for a, b in zip(after, before)] == [2, 2]
    assert [i["selected"] for i in info["generation_servers"]["instances"]] == [2, 2]
    assert all(i["in_flight_requests"] == 0 for i in info["generation_servers"]["instances"])


def test_worker_errors_pass_through_and_bad_input_is_400(workers):
    cfg = make_cfg([workers[0].url], [workers[1].url], conditional_disagg={"max_local_prefill_length": 64})
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json={"model": "nope", "prompt": PROMPT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # the worker's answer
        r = httpx.post(orch.url + "/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(orch.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                                          "disaggregated_params": {"request_type": "context_only"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"
        r = httpx.post(orch.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "stream": True,
                                                          "resume": {"token_ids": [5], "sent_chars": 0}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume"
        assert httpx.get(orch.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME


def test_context_worker_without_transceiver_is_a_clear_502(workers):
    """A context worker that ignores disaggregated_params (or refuses it with a 4xx naming the missing
    cache_transceiver_config) never leads to a silent aggregated answer."""
    cfg = make_cfg([workers[0].url], [workers[1].url])
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": PROMPT,
                                                                       "max_tokens": 3})
    assert r.status_code in (400, 502), r.text
    message = r.json()["error"]["message"]
    assert "cache_transceiver_config" in message


def test_api_key_and_cluster_token(tiny_model_dir, tmp_path):
    """With a cluster token, the orchestrator routes only to instances that prove they hold it (one
    instance in both roles here, with the token)."""
    (member,) = start_each(tiny_model_dir, tmp_path, [{"cache_transceiver_config": {"cluster_token": "inside"}}])
    cfg = make_cfg([member.url], [member.url], conditional_disagg={"max_local_prefill_length": 64},
                   api_key="sekret", cluster_token="inside")
    try:
        with orchestrator(cfg) as orch:
            wait_healthy(orch.url)  # /health stays open for load balancers
            with pytest.raises(openai.AuthenticationError):
                client(orch.url).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
            out = client(orch.url, api_key="sekret").completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
            assert out.usage.completion_tokens >= 1
            assert httpx.get(orch.url + "/cluster_info").status_code == 401
            assert httpx.get(orch.url + "/metrics").status_code == 401
            assert httpx.get(orch.url + "/cluster_info", headers={"X-Cluster-Token": "inside"}).status_code == 200
            # The cluster token guards the internal pages: the clients' key is not enough for them.
            assert httpx.get(orch.url + "/cluster_info", headers={"Authorization": "Bearer sekret"}).status_code == 401
    finally:
        member.stop()


def test_api_key_alone_guards_every_page_but_health_and_metrics(workers):
    """Without a cluster token, /cluster_info (every worker url and KV endpoint) needs the API key."""
    cfg = make_cfg([workers[0].url], [workers[1].url], conditional_disagg={"max_local_prefill_length": 64},
                   api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        for path in ("/cluster_info", "/openapi.json", "/docs", "/no-such-page"):
            r = httpx.get(orch.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        info = httpx.get(orch.url + "/cluster_info", headers=key)
        assert info.status_code == 200 and workers[0].url in info.text
        assert httpx.get(orch.url + "/metrics").status_code == 200  # open, as on the workers and in vLLM


def test_dead_worker_gives_clear_error_and_orchestrator_keeps_serving(workers):
    doomed, alive = workers[2], workers[0]
    # Probes are slow here on purpose: the orchestrator must notice the death from the failed request.
    cfg = make_cfg([doomed.url], [doomed.url, alive.url], conditional_disagg={"max_local_prefill_length": 16},
                   health_check_interval=60)
    with orchestrator(cfg) as orch:
        wait_healthy(orch.url)
        doomed.stop()
        r = httpx.post(orch.url + "/v1/completions", timeout=30,
                       json={"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 3})
        assert r.status_code in (502, 503), r.text
        err = r.json()["error"]
        assert doomed.url in err["message"] and "context" in err["message"]
        assert err["type"] in ("bad_gateway", "service_unavailable")
        # Short prompts stay local: the dead generation instance is skipped by a retry, then by routing.
        for _ in range(3):
            r = httpx.post(orch.url + "/v1/completions", timeout=30,
                           json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
        health = httpx.get(orch.url + "/health")
        assert health.status_code == 503 and "context" in health.json()["error"]["message"]
        metrics = httpx.get(orch.url + "/metrics").text
    assert 'pdserve_orchestrator_retries_total{role="generation"} 1.0' in metrics
    assert 'pdserve_orchestrator_worker_errors_total{role="context",status="502"} 1.0' in metrics
