"""Forged halves of a disaggregated request, sent straight to real context and generation workers (as
a client that can reach them can): each gets a clear 4xx naming what is wrong, and afterwards the pair
still serves a real split whose text equals the aggregated greedy text, and neither worker holds a KV block.

- ids past int64 (2**63, 2**64 + 1, 2**200) in either half, token ids outside the vocabulary, a
  ctx_dp_rank or an endpoint no worker could have sent: a 400 naming the field. Before, a
  generation_only with disagg_request_id 2**64 + 1 made msgpack raise inside the receiver and stopped
  the engine's step loop for good; first_gen_tokens [-1] was a 500; a context_only with such an id was
  a 200 whose KV stayed held until the process died.
- a generation_only for KV the context worker does not hold (never had, already pulled, released): a
  404 kv_not_found within a second, where before it waited kv_transfer_timeout_ms for a 503.
- generation_first still waits for a context half that comes after the generation half."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from e2e_checks import PROMPT_IDS
from e2e_cluster import MODEL_NAME, TINY_BASE, Spec, free_port, start_instances, stop_instances

KV_TIMEOUT_S = 6.0
SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": int(KV_TIMEOUT_S * 1000)},
       "kv_layout": "HND", "tokens_per_block": 16}
BODY = {"model": MODEL_NAME, "prompt": list(PROMPT_IDS), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
VOCAB = 512  # make_tiny_model's vocabulary
NOT_FOUND_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def pair(tiny_kv2, e2e_dir):
    insts = start_instances([Spec("forged-ctx", tiny_kv2, SHM), Spec("forged-gen", tiny_kv2, SHM)],
                            e2e_dir / "forged", TINY_BASE)
    yield insts["forged-ctx"], insts["forged-gen"]
    stop_instances(insts.values())


@pytest.fixture(scope="module")
def aggregated(pair) -> str:
    """The greedy text of BODY served whole (the context worker serves aggregated requests too)."""
    r = _post(pair[0].url, BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _post(url: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _with(params: dict) -> dict:
    return {**BODY, "disaggregated_params": params}


_ids = iter(range(1 << 45, 1 << 46))


def _fresh_id() -> int:
    return next(_ids) + time.monotonic_ns() % (1 << 40)


def _context_only(ctx, disagg_id: int, body: dict = BODY, **extra) -> dict:
    params = {"request_type": "context_only", "disagg_request_id": disagg_id, **extra}
    r = _post(ctx.url, {**body, "disaggregated_params": params})
    assert r.status_code == 200, r.text
    return r.json()["disaggregated_params"]


def _endpoint(ctx) -> str:
    return httpx.get(ctx.url + "/v1/disagg_info", timeout=5).json()["ctx_info_endpoint"]


def _still_serves(pair, aggregated: str) -> None:
    """A real split (context_only, then generation_only with its answer) gives the aggregated text, and
    neither worker keeps a block."""
    ctx, gen = pair
    r = _post(gen.url, _with(_context_only(ctx, _fresh_id())))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == aggregated
    assert httpx.get(gen.url + "/health", timeout=5).status_code == 200
    for inst in pair:
        inst.wait_blocks_free(timeout=5.0)


def _generation_only(endpoint: str, **params) -> dict:
    return {"request_type": "generation_only", "disagg_request_id": _fresh_id(), "first_gen_tokens": [7],
            "ctx_info_endpoint": endpoint, **params}


# (which worker, the forged disaggregated_params as a function of the context worker's endpoint, the field
# the 400 must name)
FORGED = {
    "context-id-2to64plus1": ("ctx", lambda ep: {"request_type": "context_only", "disagg_request_id": 2**64 + 1},
                           "disaggregated_params.disagg_request_id"),
    "context-id-2to63": ("ctx", lambda ep: {"request_type": "context_only", "disagg_request_id": 2**63},
                         "disaggregated_params.disagg_request_id"),
    "context-id-2to200": ("ctx", lambda ep: {"request_type": "context_only", "disagg_request_id": 2**200},
                          "disaggregated_params.disagg_request_id"),
    "generation-id-2to64plus1": ("gen", lambda ep: _generation_only(ep, disagg_request_id=2**64 + 1),
                              "disaggregated_params.disagg_request_id"),
    "generation-ctx-request-id-2to64": ("gen", lambda ep: _generation_only(ep, ctx_request_id=2**64),
                                        "disaggregated_params.ctx_request_id"),
    "first-gen-token-minus1": ("gen", lambda ep: _generation_only(ep, first_gen_tokens=[-1]),
                           "disaggregated_params.first_gen_tokens"),
    "first-gen-token-vocab": ("gen", lambda ep: _generation_only(ep, first_gen_tokens=[VOCAB]),
                              "disaggregated_params.first_gen_tokens"),
    "first-gen-token-2to64": ("gen", lambda ep: _generation_only(ep, first_gen_tokens=[2**64]),
                              "disaggregated_params.first_gen_tokens"),
    "draft-token-minus1": ("gen", lambda ep: _generation_only(ep, draft_tokens=[-1]),
                       "disaggregated_params.draft_tokens"),
    "ctx-dp-rank-2to70": ("gen", lambda ep: _generation_only(ep, ctx_dp_rank=2**70),
                          "disaggregated_params.ctx_dp_rank"),
    "endpoint-port-99999": ("gen", lambda ep: _generation_only("tcp://127.0.0.1:99999"),
                            "disaggregated_params.ctx_info_endpoint"),
    "endpoint-not-tcp": ("gen", lambda ep: _generation_only("ipc:///tmp/pdserve-kv"),
                         "disaggregated_params.ctx_info_endpoint"),
}


@pytest.mark.parametrize("name", FORGED)
def test_a_forged_half_is_a_400_naming_its_field_and_the_pair_still_serves(pair, aggregated, name):
    ctx, gen = pair
    side, params, field = FORGED[name]
    worker = ctx if side == "ctx" else gen
    r = _post(worker.url, _with(params(_endpoint(ctx))))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field), r.text
    assert field.rpartition(".")[2] in r.json()["error"]["message"], r.text
    _still_serves(pair, aggregated)


def test_the_first_forged_pair_of_the_issue_stops_nothing(pair, aggregated):
    """A context_only with id 2**64 + 1, then (as its answer would have said) the generation_only with
    that id: both refused, and both engines go on."""
    ctx, gen = pair
    r = _post(ctx.url, _with({"request_type": "context_only", "disagg_request_id": 2**64 + 1}))
    assert r.status_code == 400, r.text
    params = _generation_only(_endpoint(ctx), disagg_request_id=2**64 + 1, ctx_request_id=2**64 + 1)
    r = _post(gen.url, _with(params))
    assert r.status_code == 400, r.text
    _still_serves(pair, aggregated)


def _not_found_in_time(gen, params: dict) -> None:
    t0 = time.monotonic()
    r = _post(gen.url, _with(params))
    took = time.monotonic() - t0
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_not_found" and err["param"] == "disaggregated_params.disagg_request_id", r.text
    assert str(params["disagg_request_id"]) in err["message"], r.text
    assert took < NOT_FOUND_WITHIN_S, f"the 404 took {took:.2f} s"


def test_kv_that_never_existed_is_a_404_within_a_second(pair, aggregated):
    ctx, gen = pair
    _not_found_in_time(gen, _generation_only(_endpoint(ctx)))
    _still_serves(pair, aggregated)


def test_kv_already_pulled_is_a_404_within_a_second(pair, aggregated):
    ctx, gen = pair
    params = _context_only(ctx, _fresh_id())
    assert _post(gen.url, _with(params)).status_code == 200
    _not_found_in_time(gen, params)
    _still_serves(pair, aggregated)


def test_kv_released_is_a_404_within_a_second(pair, aggregated):
    ctx, gen = pair
    params = _context_only(ctx, _fresh_id())
    r = httpx.post(ctx.url + "/v1/disagg/release", json={"disagg_request_id": params["disagg_request_id"]},
                   timeout=10)
    assert r.status_code == 200 and r.json()["released"], r.text
    _not_found_in_time(gen, params)
    _still_serves(pair, aggregated)


def test_a_context_answer_nobody_pulls_is_released_at_the_timeout(pair, aggregated):
    """The largest id there is (2**63 - 1) held past its answer, then freed by kv_transfer_timeout_ms."""
    ctx, _ = pair
    t0 = time.monotonic()
    _context_only(ctx, 2**63 - 1)
    m = ctx.metrics()
    assert m["pdserve_kv_cache_blocks_free"] < m["pdserve_kv_cache_blocks_total"], "the KV was not kept"
    ctx.wait_blocks_free(timeout=KV_TIMEOUT_S + 5)
    assert time.monotonic() - t0 > KV_TIMEOUT_S * 0.8, "freed before the timeout: was it held at all?"
    _still_serves(pair, aggregated)


def test_generation_first_still_waits_for_a_context_half_that_comes_later(pair, aggregated):
    """generation_first asks for the KV before the context worker has the request: that is no unknown KV."""
    ctx, gen = pair
    disagg_id, answer = _fresh_id(), []
    params = {"request_type": "generation_only", "disagg_request_id": disagg_id, "first_gen_tokens": [],
              "ctx_info_endpoint": _endpoint(ctx), "schedule_style": "generation_first"}
    asking = threading.Thread(target=lambda: answer.append(_post(gen.url, _with(params))), daemon=True)
    asking.start()
    time.sleep(1.5)  # the generation side has asked (it allocates and asks at once) and waits
    _context_only(ctx, disagg_id, schedule_style="generation_first")
    asking.join(30)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].json()["choices"][0]["text"] == aggregated
    for inst in pair:
        inst.wait_blocks_free(timeout=5.0)


def test_an_unreachable_endpoint_is_still_a_503(pair):
    """A context instance that does not answer at all is the service's failure, not the request's."""
    _, gen = pair
    r = _post(gen.url, _with(_generation_only(f"tcp://127.0.0.1:{free_port()}")))
    assert r.status_code == 503, r.text
    gen.wait_blocks_free(timeout=5.0)


def test_skip_special_tokens_holds_on_the_generation_half(pair):
    """skip_special_tokens (issue 44) on a real split: the generation worker, which writes the text from the context
    worker's first token on, keeps a special token with false and leaves it out by default, streamed and not."""
    ctx, gen = pair
    # ("a" is the context worker's token, then the special <|endoftext|> (id 0) and "b" the generation worker's)
    body = {**BODY, "ignore_eos": False, "structured_outputs": {"grammar": 'start: "a" <[0]> "b"'}}
    for skip, want in ((True, "ab"), (False, "a<|endoftext|>b")):
        half = {**body, "skip_special_tokens": skip}
        params = _context_only(ctx, _fresh_id(), half)
        r = _post(gen.url, {**half, "disaggregated_params": params})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        with httpx.stream("POST", gen.url + "/v1/completions", timeout=30, json={
                **half, "stream": True, "disaggregated_params": _context_only(ctx, _fresh_id(), half)}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    for inst in pair:
        inst.wait_blocks_free(timeout=5.0)


# n > 1 split: the context worker draws every choice's first token from the prompt's logits (choice c from its
# own seeded stream) and answers with all of them; the generation worker forks choices 1..n-1 from the one KV.
SEEDED_N = {**BODY, "n": 3, "temperature": 1.0, "seed": 11, "logprobs": 2}


def _choices(answer: dict) -> list[tuple[str, list[str], list]]:
    return [(c["text"], c["logprobs"]["tokens"], c["logprobs"]["top_logprobs"]) for c in answer["choices"]]


def _streamed(url: str, body: dict) -> list[tuple[str, list[str]]]:
    texts: dict[int, list] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text, tokens = texts.setdefault(c["index"], ["", []])
                    texts[c["index"]] = [text + c["text"], tokens + c["logprobs"]["tokens"]]
    return [tuple(texts[i]) for i in sorted(texts)]


def test_n_seeded_choices_split_equal_aggregated_streamed_and_not(pair):
    ctx, gen = pair
    r = _post(ctx.url, SEEDED_N)
    assert r.status_code == 200, r.text
    want = _choices(r.json())
    assert len({text for text, _, _ in want}) > 1  # the choices drew streams of their own
    r = _post(ctx.url, {**SEEDED_N, "disaggregated_params": {"request_type": "context_only",
                                                              "disagg_request_id": _fresh_id()}})
    assert r.status_code == 200, r.text
    # one answer, choice 0's; the other choices' first tokens ride in its params
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 1
    params = r.json()["disaggregated_params"]
    assert len(params["first_gen_tokens"]) == 3 and params["opaque_state"]
    r = _post(gen.url, {**SEEDED_N, "disaggregated_params": params})
    assert r.status_code == 200, r.text
    got = _choices(r.json())
    assert [(t, toks) for t, toks, _ in got] == [(t, toks) for t, toks, _ in want]
    for (_, _, top_got), (_, _, top_want) in zip(got, want):  # the first entry came from the context worker
        assert [sorted(e) for e in top_got] == [sorted(e) for e in top_want]
    assert r.json()["usage"]["completion_tokens"] == 3 * BODY["max_tokens"]
    streamed = _streamed(gen.url, {**SEEDED_N, "disaggregated_params": _context_only(ctx, _fresh_id(), SEEDED_N)})
    assert streamed == [(t, toks) for t, toks, _ in want]
    for inst in pair:
        inst.wait_blocks_free(timeout=5.0)


def test_malformed_n_halves_are_a_400_naming_the_field(pair, aggregated):
    """A generation_only with n = 3 whose first_gen_tokens are too few or whose logprob entries are of other
    tokens, and a context_only with n = 3 under generation_first: a 400 naming the field, and no KV kept."""
    ctx, gen = pair
    params = _context_only(ctx, _fresh_id(), SEEDED_N)
    tokens = params["first_gen_tokens"]
    forged = [tokens[0], tokens[1], (tokens[2] + 1) % VOCAB]
    cases = [(gen, {**params, "first_gen_tokens": tokens[:2]}, "disaggregated_params.first_gen_tokens"),
             (gen, {**params, "first_gen_tokens": tokens + [7]}, "disaggregated_params.first_gen_tokens"),
             (gen, {**params, "first_gen_tokens": forged}, "disaggregated_params.opaque_state"),
             (gen, {**params, "first_gen_tokens": [tokens[0], VOCAB, tokens[2]]},
              "disaggregated_params.first_gen_tokens"),
             (ctx, {"request_type": "context_only", "disagg_request_id": _fresh_id(),
                    "schedule_style": "generation_first"}, "n")]
    for worker, forged_params, field in cases:
        r = _post(worker.url, {**SEEDED_N, "disaggregated_params": forged_params})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    r = _post(gen.url, {**SEEDED_N, "disaggregated_params": params})  # the real half still gets its KV
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    _still_serves(pair, aggregated)
