"""Failures of the split, each giving the client a clear error and leaving no KV block allocated on either
side (every worker's pdserve_kv_cache_blocks_free returns to its total): a worker without a transceiver,
a duplicate in-flight disagg_request_id, a generation request pointed at a dead context endpoint, a
context instance that dies between its answer and the generation request, and a context answer whose
generation request never comes."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from e2e_checks import CASES, PROMPT_IDS, check_pair
from e2e_cluster import MODEL_NAME, TINY_BASE, Orchestrator, Spec, free_port, start_instances, stop_instances

KV_TIMEOUT_S = 4.0
RANK_INFO_TIMEOUT_S = 2.0
SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": int(KV_TIMEOUT_S * 1000),
                                    "rank_info_timeout_s": RANK_INFO_TIMEOUT_S},
       "kv_layout": "HND", "tokens_per_block": 16}
BODY = {"model": MODEL_NAME, "prompt": list(PROMPT_IDS), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fail_group(tiny_kv2, e2e_dir, plain):
    """fail-ctx is killed by the last test of this module; fail-gen lives through all of them."""
    insts = start_instances([Spec("fail-ctx", tiny_kv2, SHM), Spec("fail-gen", tiny_kv2, {**SHM,
                                                                                         "tensor_parallel_size": 2})],
                            e2e_dir / "fail", TINY_BASE)
    yield insts
    stop_instances(insts.values())


def _post(url: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _context_only(ctx_url: str, disagg_id: int) -> dict:
    r = _post(ctx_url, {**BODY, "disaggregated_params": {"request_type": "context_only",
                                                         "disagg_request_id": disagg_id}})
    assert r.status_code == 200, r.text
    return r.json()["disaggregated_params"]


def _unused_id() -> int:
    return (1 << 41) + time.monotonic_ns() % (1 << 40)


@pytest.mark.parametrize("request_type", ["context_only", "generation_only"])
def test_worker_without_backend_refuses_with_400(plain, request_type):
    worker = plain["plain-kv2"]
    params = {"request_type": request_type, "disagg_request_id": _unused_id()}
    if request_type == "generation_only":
        params |= {"first_gen_tokens": [5], "ctx_request_id": params["disagg_request_id"],
                   "ctx_info_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    r = _post(worker.url, {**BODY, "disaggregated_params": params})
    assert r.status_code == 400, r.text
    assert "cache_transceiver_config.backend" in r.json()["error"]["message"], r.text
    worker.wait_blocks_free(timeout=5.0)


def test_orchestrator_over_a_worker_without_backend(plain, fail_group, e2e_dir):
    """The worker's 400 reaches the openai client unchanged; neither instance keeps a block."""
    with Orchestrator(plain["plain-kv2"].url, fail_group["fail-gen"].url, e2e_dir / "fail", "no-backend") as orch:
        with pytest.raises(openai.BadRequestError, match="cache_transceiver_config.backend"):
            orch.client().completions.create(model=MODEL_NAME, prompt=list(PROMPT_IDS), max_tokens=4)
    plain["plain-kv2"].wait_blocks_free(timeout=5.0)
    fail_group["fail-gen"].wait_blocks_free(timeout=5.0)


def test_split_works_before_the_failures(fail_group, reference_kv2, e2e_dir):
    """The failure instances serve a correct split, and fail-gen now knows fail-ctx's ranks, so the dead
    context test below exercises the transfer itself, not only the first contact."""
    with Orchestrator(fail_group["fail-ctx"].url, fail_group["fail-gen"].url, e2e_dir / "fail", "ok") as orch:
        check_pair(orch.client(), reference_kv2, CASES[:1])
    for inst in fail_group.values():
        inst.wait_blocks_free(timeout=5.0)


def _generation_only(gen_url: str, disagg_id: int, endpoint: str, ctx_request_id: int | None = None,
                     generation_first: bool = False) -> httpx.Response:
    """generation_first: asked before the context instance has the request, which it waits for (context_first
    asks after the context answer, so a context instance without the request says so at once: a 404)."""
    params = {"request_type": "generation_only", "first_gen_tokens": [] if generation_first else [7],
              "disagg_request_id": disagg_id, "ctx_info_endpoint": endpoint,
              "ctx_request_id": disagg_id if ctx_request_id is None else ctx_request_id,
              "schedule_style": "generation_first" if generation_first else "context_first"}
    return _post(gen_url, {**BODY, "disaggregated_params": params})


class _InThread:
    """Run `fn` in a thread; `result()` joins it and returns (value, monotonic time it finished)."""

    def __init__(self, fn):
        self._out: list = []
        self._t = threading.Thread(target=lambda: self._out.append((fn(), time.monotonic())), daemon=True)
        self._t.start()

    def result(self, timeout: float = 30.0):
        self._t.join(timeout)
        assert self._out, f"the request did not finish within {timeout} s"
        return self._out[0]


def _ctx_endpoint(inst) -> str:
    return httpx.get(inst.url + "/v1/disagg_info", timeout=5).json()["ctx_info_endpoint"]


def test_duplicate_inflight_id_is_409(fail_group):
    """A generation_first request for a KV the (live) context instance does not hold yet waits, without
    blocking the engine, until kv_transfer_timeout_ms. Meanwhile:
    a second request with the same id is a 409 and an aggregated request is served; then the first fails
    with a 503 naming the transfer, and both instances hold no block."""
    ctx, gen = fail_group["fail-ctx"], fail_group["fail-gen"]
    disagg_id = _unused_id()
    t0 = time.monotonic()
    first = _InThread(lambda: _generation_only(gen.url, disagg_id, _ctx_endpoint(ctx), generation_first=True))
    time.sleep(0.3)  # let the first one be admitted (a 409 for the first would fail below, not pass)
    second = _generation_only(gen.url, disagg_id, _ctx_endpoint(ctx), generation_first=True)
    plain_answer = _post(gen.url, {**BODY, "max_tokens": 2})
    plain_done = time.monotonic()
    r, first_done = first.result()
    assert second.status_code == 409, second.text
    assert str(disagg_id) in second.json()["error"]["message"], second.text
    assert second.json()["error"]["param"] == "disaggregated_params.disagg_request_id"
    assert plain_answer.status_code == 200 and plain_done < first_done, "an aggregated request waited for the KV"
    assert r.status_code == 503, r.text
    assert "KV transfer" in r.json()["error"]["message"], r.text
    assert first_done - t0 >= KV_TIMEOUT_S * 0.9, "the first request failed before its transfer timed out"
    gen.wait_blocks_free(timeout=5.0)
    ctx.wait_blocks_free(timeout=5.0)


def test_duplicate_client_id_through_the_orchestrator_is_409(fail_group, e2e_dir):
    """Two client requests with the same disaggregated_params.disagg_request_id: while the first decodes on
    the generation instance, the second gets the generation worker's 409; the first still completes; the
    KV the second left on the context instance is freed (at the latest by kv_transfer_timeout_ms)."""
    ctx, gen = fail_group["fail-ctx"], fail_group["fail-gen"]
    disagg_id = _unused_id()
    extra = {"ignore_eos": True, "disaggregated_params": {"disagg_request_id": disagg_id}}
    with Orchestrator(ctx.url, gen.url, e2e_dir / "fail", "dup") as orch:
        client = orch.client()
        first = client.completions.create(model=MODEL_NAME, prompt=list(PROMPT_IDS), max_tokens=200, temperature=0.0,
                                          stream=True, extra_body=extra)
        try:
            next(iter(first))  # the first is now decoding on the generation instance
            with pytest.raises(openai.ConflictError, match=str(disagg_id)):
                client.completions.create(model=MODEL_NAME, prompt=list(PROMPT_IDS), max_tokens=4, temperature=0.0,
                                          extra_body=extra)
            rest = list(first)
        finally:
            first.close()
    assert rest and rest[-1].choices[0].finish_reason == "length"
    gen.wait_blocks_free(timeout=5.0)
    ctx.wait_blocks_free(timeout=KV_TIMEOUT_S + 5)


def test_generation_pointed_at_a_dead_endpoint_is_503(fail_group):
    gen = fail_group["fail-gen"]
    dead = f"tcp://127.0.0.1:{free_port()}"
    r = _generation_only(gen.url, _unused_id(), dead)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert dead in message and "RANK_INFO" in message, message
    gen.wait_blocks_free(timeout=5.0)


def test_first_contact_with_a_dead_endpoint_does_not_stall_other_requests(fail_group):
    """Learning a context instance (RANK_INFO) happens off the engine's step loop: while one request waits
    for an unreachable endpoint, an aggregated request on the same instance is served."""
    gen = fail_group["fail-gen"]
    waiting = _InThread(lambda: _generation_only(gen.url, _unused_id(), f"tcp://127.0.0.1:{free_port()}"))
    time.sleep(0.3)
    plain_answer = _post(gen.url, {**BODY, "max_tokens": 2})
    plain_done = time.monotonic()
    r, waiting_done = waiting.result()
    assert r.status_code == 503 and plain_answer.status_code == 200
    assert plain_done < waiting_done - RANK_INFO_TIMEOUT_S / 4, (
        f"the aggregated request finished {plain_done - waiting_done:+.2f} s after the stalled one failed")


def test_duplicate_id_while_the_first_waits_on_an_unreachable_endpoint_is_409(fail_group):
    """The first request is in flight while its context instance is being looked up: a duplicate is refused."""
    gen = fail_group["fail-gen"]
    disagg_id, dead = _unused_id(), f"tcp://127.0.0.1:{free_port()}"
    first = _InThread(lambda: _generation_only(gen.url, disagg_id, dead))
    time.sleep(0.3)
    second = _generation_only(gen.url, disagg_id, dead)
    first.result()
    gen.wait_blocks_free(timeout=5.0)
    assert second.status_code == 409, second.text


def test_context_answer_without_generation_request_frees_by_timeout(fail_group):
    ctx = fail_group["fail-ctx"]
    total = ctx.metrics()["pdserve_kv_cache_blocks_total"]
    _context_only(ctx.url, _unused_id())
    assert ctx.metrics()["pdserve_kv_cache_blocks_free"] < total, "the context worker did not keep the KV"
    ctx.wait_blocks_free(timeout=KV_TIMEOUT_S + 5)


def test_dead_context_instance_between_answer_and_generation(fail_group, e2e_dir):
    """Runs last: it kills fail-ctx. The KV of the answered context request dies with it; the generation
    worker, told to pull it, answers 503 naming the failed transfer and frees its blocks. An orchestrator
    that still believes the instance ready (its health probe has not run since) gives the openai client a
    5xx naming the context server."""
    ctx, gen = fail_group["fail-ctx"], fail_group["fail-gen"]
    with Orchestrator(ctx.url, gen.url, e2e_dir / "fail", "dead-ctx", health_check_interval=600) as orch:
        params = _context_only(ctx.url, _unused_id())
        ctx.kill()
        t0 = time.monotonic()
        r = _post(gen.url, {**BODY, "disaggregated_params": params})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "KV transfer" in message and params["ctx_info_endpoint"] in message, message
        assert time.monotonic() - t0 < KV_TIMEOUT_S + 5
        gen.wait_blocks_free(timeout=5.0)
        with pytest.raises(openai.APIStatusError) as e:
            orch.client().completions.create(model=MODEL_NAME, prompt=list(PROMPT_IDS), max_tokens=4)
    assert e.value.status_code in (502, 503), e.value
    assert "context" in str(e.value) and ctx.url in str(e.value), e.value
    gen.wait_blocks_free(timeout=5.0)
