"""The orchestrator's side of the split, checked request by request against contract workers:
what context_only and generation_only carry, the first-token-finished path, a stream that breaks,
a worker that times out."""

from __future__ import annotations

import time

import httpx
import openai
from contract_worker import CTX_REQUEST_ID, FIRST_TOKEN, GEN_TEXT, contract_worker
from harness import AppThread, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.request_id import is_global_id
from pdserve.testing.servers import ClientGoneBeforeFirstByte

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0.0}


def run(ctx_behaviour=None, gen_behaviour=None, wrap=lambda app: app, **cfg_kw):
    """Contract workers and an orchestrator over them; `wrap` wraps the orchestrator's ASGI app."""
    ctx_app, ctx_seen = contract_worker("ctx", ctx_behaviour or {})
    gen_app, gen_seen = contract_worker("gen", gen_behaviour or {})
    ctx, gen = AppThread(ctx_app), AppThread(gen_app)
    cfg = DisaggConfig(context_servers={"urls": [ctx.url]}, generation_servers={"urls": [gen.url]}, **cfg_kw)
    return ctx, gen, AppThread(wrap(build_app(cfg))), ctx_seen, gen_seen


def wait_stream_closed(gen_seen: list[dict], timeout: float = 10) -> None:
    """Until the generation worker records that its stream was closed by the caller (or timeout)."""
    deadline = time.monotonic() + timeout
    while {"closed_stream": True} not in gen_seen and time.monotonic() < deadline:
        time.sleep(0.05)


def test_split_carries_the_contract_fields():
    ctx, gen, orch, ctx_seen, gen_seen = run()
    with ctx, gen, orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json={**BODY, "stream_options": {"include_usage": True}})
        c = openai.OpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **BODY))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["text"] == "".join(GEN_TEXT) and streamed == "".join(GEN_TEXT)
    assert "disaggregated_params" not in answer
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # the prefill's cache hit
    ctx_body, gen_body = ctx_seen[0], gen_seen[0]
    assert ctx_body["stream"] is False and "stream_options" not in ctx_body
    assert ctx_body["prompt"] == BODY["prompt"] and ctx_body["max_tokens"] == BODY["max_tokens"]
    rid = ctx_body["disaggregated_params"]["disagg_request_id"]
    assert ctx_body["disaggregated_params"]["request_type"] == "context_only" and is_global_id(rid)
    dp = gen_body["disaggregated_params"]
    assert dp["request_type"] == "generation_only" and dp["disagg_request_id"] == rid
    assert dp["first_gen_tokens"] == [FIRST_TOKEN] and dp["ctx_request_id"] == CTX_REQUEST_ID
    assert dp["ctx_info_endpoint"] == "tcp://127.0.0.1:1" and dp["schedule_style"] == "context_first"
    assert gen_body["stream_options"] == {"include_usage": True}  # the client's request, as sent
    assert gen_seen[1]["stream"] is True and ctx_seen[1]["stream"] is False
    assert ctx_seen[1]["disaggregated_params"]["disagg_request_id"] != rid


def test_client_chosen_id_is_used_as_is():
    ctx, gen, orch, ctx_seen, gen_seen = run(schedule_style="generation_first")
    with ctx, gen, orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json={**BODY, "disaggregated_params": {"disagg_request_id": 77}})
    assert r.status_code == 200, r.text
    assert ctx_seen[0]["disaggregated_params"]["disagg_request_id"] == 77
    assert gen_seen[0]["disaggregated_params"]["disagg_request_id"] == 77
    assert gen_seen[0]["disaggregated_params"]["schedule_style"] == "generation_first"


def test_first_token_that_finishes_never_reaches_generation():
    ctx, gen, orch, ctx_seen, gen_seen = run()
    with ctx, gen, orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json={**BODY, "max_tokens": 1})
        with httpx.stream("POST", orch.url + "/v1/completions",
                          json={**BODY, "max_tokens": 1, "stream": True,
                                "stream_options": {"include_usage": True}}) as s:
            lines = [line for line in s.iter_lines() if line]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A"
    assert gen_seen == [] and len(ctx_seen) == 2
    assert lines[-1] == "data: [DONE]" and '"text":"A"' in lines[0] and '"usage"' in lines[1]


def test_broken_generation_stream_ends_with_an_error_event():
    ctx, gen, orch, _, _ = run(gen_behaviour={"die_mid_stream": True})
    with ctx, gen, orch:
        wait_healthy(orch.url)
        with httpx.stream("POST", orch.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line]
        assert httpx.get(orch.url + "/health").status_code == 200
    assert '"text": "A"' in lines[0]
    # As the workers and vLLM do: the error event, then [DONE], so a client reading to [DONE] stops.
    assert lines[-2].startswith('data: {"error"') and "generation server" in lines[-2]
    assert lines[-1] == "data: [DONE]"


def test_slow_worker_is_a_504_naming_the_timeout():
    ctx, gen, orch, _, _ = run(ctx_behaviour={"delay_s": 2.0}, request_timeout=0.5)
    with ctx, gen, orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "gateway_timeout"
    assert "context server" in r.json()["error"]["message"] and "request_timeout=0.5" in r.json()["error"]["message"]


def test_generation_first_stream_is_released_when_the_context_side_fails():
    """The generation worker's stream opens before the prefill ends; when the context side then fails,
    the client gets the context's error, the open stream is closed and both routes are released."""
    ctx, gen, orch, _, gen_seen = run(ctx_behaviour={"context_error_after_s": 0.5}, gen_behaviour={"hold_stream_s": 30},
                                      schedule_style="generation_first")
    with ctx, gen, orch:
        wait_healthy(orch.url)
        r = httpx.post(orch.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
        info = httpx.get(orch.url + "/cluster_info").json()
        wait_stream_closed(gen_seen)
    assert r.status_code == 502 and "prefill failed" in r.json()["error"]["message"]
    for role in ("context_servers", "generation_servers"):
        assert [i["in_flight_requests"] for i in info[role]["instances"]] == [0], info[role]
    assert {"closed_stream": True} in gen_seen  # the worker saw the orchestrator hang up


def test_stream_whose_client_is_gone_before_the_first_byte_is_released():
    """The relay never starts, yet the worker's stream is closed, the route freed and in_flight back to 0."""
    ctx, gen, orch, _, gen_seen = run(gen_behaviour={"hold_stream_s": 30}, wrap=ClientGoneBeforeFirstByte)
    with ctx, gen, orch:
        wait_healthy(orch.url)
        try:
            httpx.post(orch.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30)
        except httpx.HTTPError:
            pass  # however the server ends the exchange, the client is not the point here
        wait_stream_closed(gen_seen)
        info = httpx.get(orch.url + "/cluster_info").json()
        metrics = httpx.get(orch.url + "/metrics").text
    assert {"closed_stream": True} in gen_seen  # the worker's stream was closed, not left to run 30 s
    for role in ("context_servers", "generation_servers"):
        assert [i["in_flight_requests"] for i in info[role]["instances"]] == [0], info[role]
    assert "pdserve_orchestrator_requests_in_flight 0.0" in metrics
