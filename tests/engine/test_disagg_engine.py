"""context_only -> generation_only between two single-rank engines in one process (real shm/NIXL
agents and ZeroMQ control plane); the multi-process, multi-rank pairs live in tests/disagg_e2e."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import block_hashes
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import ConflictError, LLMEngine, RequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.host import free_port
from pdserve.testing import make_tiny_model
from pdserve.server.errors import APIError
from pdserve.server.handoff import first_gen_logprobs
from pdserve.testing.disagg import context_first, handoff, step_until

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def ref_device(backend: str = "shm") -> str:
    """Where an aggregated reference runs: where the split engines do. shm moves host memory only, so
    `device: auto` puts shm engines on the CPU even on a GPU host; logprobs are compared exactly, and a
    CUDA reference differs from a CPU split in the last bits."""
    return "cpu" if backend == "shm" else "auto"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=3, num_heads=4, num_kv_heads=2,
                               head_dim=16))


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 21, 40)]


def _engine(model, backend, tokens_per_block=8, layout="HND", **transceiver):
    transceiver = {"backend": backend, "kv_transfer_timeout_ms": 5000, **transceiver}
    return LLMEngine(EngineConfig(model=model, tokens_per_block=tokens_per_block, num_kv_blocks=64, kv_layout=layout,
                                  cache_transceiver_config=transceiver))


def _assert_everything_freed(ctx, gen):
    """Both engines settle every transfer and hold no KV block afterwards."""
    step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished())
    assert ctx.blocks.num_free_blocks == ctx.blocks.num_blocks
    assert gen.blocks.num_free_blocks == gen.blocks.num_blocks


@pytest.mark.parametrize("backend,ctx_tpb,gen_tpb,layout", [("shm", 8, 8, "HND"), ("shm", 8, 16, "HND"),
                                                            ("nixl", 16, 8, "HND"), ("shm", 8, 8, "NHD")])
def test_disaggregated_equals_aggregated(tiny, backend, ctx_tpb, gen_tpb, layout):
    prompts = _prompts()
    with LLM(EngineConfig(model=tiny, device=ref_device(backend), tokens_per_block=8)) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    ctx = _engine(tiny, backend, ctx_tpb, layout)
    gen = _engine(tiny, backend, gen_tpb, layout)
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == expected
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_disaggregated_requests_need_a_backend(tiny):
    with LLM(EngineConfig(model=tiny, device=ref_device(), tokens_per_block=8)) as llm:
        with pytest.raises(RequestError, match="cache_transceiver_config.backend"):
            llm.engine.add_request([5, 6, 7], GREEDY, request_type=RequestType.CONTEXT_ONLY, disagg=DisaggInfo(1))


def test_duplicate_in_flight_id_is_a_conflict_and_dead_context_fails_cleanly(tiny):
    gen = _engine(tiny, "shm", kv_transfer_timeout_ms=2000, rank_info_timeout_s=0.5)
    try:
        dead = "tcp://127.0.0.1:9"  # nothing listens there
        gen.add_request([5, 6, 7, 8], GREEDY, "g0", RequestType.GENERATION_ONLY, DisaggInfo(77, dead, 0, (9,)))
        with pytest.raises(ConflictError, match="77"):
            gen.add_request([5, 6, 7, 8], GREEDY, "g1", RequestType.GENERATION_ONLY, DisaggInfo(77, dead, 0, (9,)))
        outs = step_until([gen], lambda outs: any(o.finished for o in outs), limit=5000)
        final = [o for o in outs if o.finished][0]
        assert final.finish_reason == "error" and "KV transfer" in final.error
        assert gen.blocks.num_free_blocks == gen.blocks.num_blocks
        assert not gen.has_unfinished()
    finally:
        gen.shutdown()


def test_first_token_logprobs_travel_with_the_request(tiny):
    """The context instance's token and its logprobs reach the client through the generation
    instance (opaque_state), so a split answer has one logprob entry per token."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = _prompts()[1]
    with LLM(EngineConfig(model=tiny, device=ref_device(), tokens_per_block=8)) as llm:
        llm.engine.add_request(prompt, params, "agg")
        agg = [lp for o in step_until([llm.engine], lambda outs: any(o.finished for o in outs))
               for lp in o.new_logprobs]
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    try:
        ctx.add_request(prompt, params, "c", RequestType.CONTEXT_ONLY, DisaggInfo(4242))
        answer = step_until([ctx], lambda outs: len(outs) == 1)[0]
        gen.add_request(prompt, params, "g", RequestType.GENERATION_ONLY, handoff(ctx, answer))
        outs = step_until([ctx, gen], lambda outs: any(o.finished for o in outs))
        split = [lp for o in outs for lp in o.new_logprobs]
        assert [e["token_id"] for e in split] == [e["token_id"] for e in agg]
        assert [e["top"] for e in split][0] == agg[0]["top"]
        with pytest.raises(APIError, match="opaque_state"):
            first_gen_logprobs("not base64!")
    finally:
        ctx.shutdown()
        gen.shutdown()


def _generation_first(tiny, prompts, params, *, pipelined, ctx_max_tokens=16, ctx_kw=None, step_gen_first=True):
    """generation_first between two engines: the generation side posts its request (no first token)
    before the context side prefills; the first token arrives with the KV. Returns (outputs by
    request id, ctx engine, gen engine) with both still running (the caller shuts them down)."""
    ctx = LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=64, max_num_tokens=ctx_max_tokens,
                                 cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 5000,
                                                           "pipelined_transfer": pipelined}, **(ctx_kw or {})))
    gen = _engine(tiny, "shm")
    for i, p in enumerate(prompts):
        gen.add_request(p, params, f"g{i}", RequestType.GENERATION_ONLY,
                        DisaggInfo(500 + i, ctx.kv_endpoint, schedule_style="generation_first"))
    if step_gen_first:
        step_until([gen], lambda _: all(gen.seqs[f"g{i}"].disagg.transfer_started for i in range(len(prompts))))
    for i, p in enumerate(prompts):
        ctx.add_request(p, params, f"c{i}", RequestType.CONTEXT_ONLY,
                        DisaggInfo(500 + i, schedule_style="generation_first"))
    outs = step_until([ctx, gen], lambda outs: sum(o.finished and o.request_id.startswith("g") for o in outs)
                      == len(prompts))
    by_id: dict[str, list] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    return by_id, ctx, gen


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_generation_first_equals_aggregated_and_frees_everything(tiny, pipelined):
    prompts = _prompts()  # 5, 21 and 40 tokens: 40 prefills in 3 chunks of 16 on the context side
    with LLM(EngineConfig(model=tiny, device=ref_device(), tokens_per_block=8)) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    outs, ctx, gen = _generation_first(tiny, prompts, GREEDY, pipelined=pipelined)
    try:
        got = [[t for o in outs[f"g{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
        assert got == expected
        sends = ctx.runner.connector.tx.stats["direct_writes"]
        # 40 tokens in chunks of 16 with 8-token blocks: 3 pieces; 21 tokens: 2; 5 tokens: 1.
        assert sends == (6 if pipelined else 3)
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_generation_first_first_token_ending_the_request_and_its_logprobs(tiny):
    """The first token comes with the KV: with max_tokens=1 it is the whole answer, logprob included."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = _prompts()[2]
    with LLM(EngineConfig(model=tiny, device=ref_device(), tokens_per_block=8)) as llm:
        llm.engine.add_request(prompt, params, "agg")
        agg = [o for o in step_until([llm.engine], lambda outs: any(o.finished for o in outs))]
    outs, ctx, gen = _generation_first(tiny, [prompt], params, pipelined=True)
    try:
        final = outs["g0"][-1]
        assert final.finished and final.finish_reason == "length"
        assert [t for o in outs["g0"] for t in o.new_token_ids] == [t for o in agg for t in o.new_token_ids]
        assert [e["top"] for o in outs["g0"] for e in o.new_logprobs] == [e["top"] for o in agg for e in o.new_logprobs]
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_generation_first_prompt_mismatch_fails_loudly(tiny):
    """The generation side checks the token count the context side delivered against its prompt."""
    prompt = _prompts()[1]
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    try:
        gen.add_request(prompt, GREEDY, "g", RequestType.GENERATION_ONLY,
                        DisaggInfo(61, ctx.kv_endpoint, schedule_style="generation_first"))
        ctx.add_request(prompt[:-3], GREEDY, "c", RequestType.CONTEXT_ONLY,
                        DisaggInfo(61, schedule_style="generation_first"))
        outs = step_until([ctx, gen], lambda outs: any(o.finished and o.request_id == "g" for o in outs))
        final = [o for o in outs if o.request_id == "g" and o.finished][0]
        assert final.finish_reason == "error" and "18 prompt tokens" in final.error and "has 21" in final.error
        _assert_everything_freed(ctx, gen)
        with pytest.raises(RequestError, match="first_gen_tokens empty"):
            gen.add_request(prompt, GREEDY, "x", RequestType.GENERATION_ONLY,
                            DisaggInfo(62, ctx.kv_endpoint, 0, (5,), schedule_style="generation_first"))
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_aborting_a_pipelined_prefill_mid_way_frees_both_sides(tiny):
    prompt = _prompts()[2]
    ctx = LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=64, max_num_tokens=8,
                                 cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 5000,
                                                           "pipelined_transfer": True}))
    gen = _engine(tiny, "shm")
    try:
        gen.add_request(prompt, GREEDY, "g", RequestType.GENERATION_ONLY,
                        DisaggInfo(71, ctx.kv_endpoint, schedule_style="generation_first"))
        step_until([gen], lambda _: gen.seqs["g"].disagg.transfer_started)
        ctx.add_request(prompt, GREEDY, "c", RequestType.CONTEXT_ONLY,
                        DisaggInfo(71, schedule_style="generation_first"))
        step_until([ctx, gen], lambda _: ctx.seqs["c"].num_computed_tokens >= 16)  # 2 of 5 chunks sent
        assert ctx.seqs["c"].disagg.transfer_started
        ctx.abort("c")
        outs = step_until([ctx, gen], lambda outs: any(o.finished and o.request_id == "g" for o in outs))
        final = [o for o in outs if o.request_id == "g" and o.finished][0]
        assert final.finish_reason == "error" and "KV transfer" in final.error
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_released_context_kv_is_freed_at_once_and_a_late_pull_fails_cleanly(tiny):
    """The orchestrator's client went away after the context answer: release_kv frees the context's
    blocks within a few steps instead of after kv_transfer_timeout_ms (5 s here)."""
    prompt = _prompts()[2]
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    try:
        ctx.add_request(prompt, GREEDY, "c", RequestType.CONTEXT_ONLY, DisaggInfo(81))
        answer = [o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished][0]
        assert ctx.blocks.num_free_blocks < ctx.blocks.num_blocks  # the KV waits for its pull
        assert not ctx.release_kv(999)  # nothing held under another id
        assert ctx.release_kv(81) and ctx.release_kv(81)  # idempotent while the cancel settles
        step_until([ctx], lambda _: not ctx.has_unfinished(), limit=50)
        assert ctx.blocks.num_free_blocks == ctx.blocks.num_blocks
        assert not ctx.release_kv(81)
        gen.add_request(prompt, GREEDY, "g", RequestType.GENERATION_ONLY, handoff(ctx, answer))
        outs = step_until([ctx, gen], lambda outs: any(o.finished for o in outs))
        assert outs[-1].finish_reason == "error" and "KV transfer" in outs[-1].error
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_an_answer_still_due_is_not_released(tiny):
    ctx = _engine(tiny, "shm")
    try:
        ctx.add_request(_prompts()[1], GREEDY, "c", RequestType.CONTEXT_ONLY, DisaggInfo(82))
        assert not ctx.release_kv(82)  # its HTTP request is open: closing that aborts it
        ctx.abort("c")
        step_until([ctx], lambda _: not ctx.has_unfinished(), limit=50)
        assert ctx.blocks.num_free_blocks == ctx.blocks.num_blocks
    finally:
        ctx.shutdown()


def test_aborting_a_decode_whose_kv_arrived_is_no_transfer_failure(tiny, caplog):
    """Once the KV is in, a client cancel ends a decode like any other: blocks freed at once, no
    'KV transfer failed: cancelled' warning, and the context instance's RankInfo stays cached."""
    prompt = _prompts()[1]
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    try:
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        ctx.add_request(prompt, long, "c", RequestType.CONTEXT_ONLY, DisaggInfo(83))
        answer = [o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished][0]
        gen.add_request(prompt, long, "g", RequestType.GENERATION_ONLY, handoff(ctx, answer))
        step_until([ctx, gen], lambda outs: sum(len(o.new_token_ids) for o in outs if o.request_id == "g") > 3)
        with caplog.at_level("INFO", logger="pdserve.engine.kv.exchange"):
            gen.abort("g")
            assert gen.blocks.num_free_blocks == gen.blocks.num_blocks and not gen.has_unfinished()
            step_until([ctx, gen], lambda _: not ctx.has_unfinished(), limit=200)
        assert not [r for r in caplog.records if "failed" in r.getMessage()]
        assert gen.kv._peers.lookup(ctx.kv_endpoint) is not None  # still known
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_kv_the_context_instance_does_not_hold_fails_at_once_as_not_found(tiny):
    """context_first: the context instance answered before the generation side asks, so one that holds no
    session of the request (never had it, its KV already pulled, or released) says so at once, and the
    generation_only request fails within a second with error_code kv_not_found, its blocks freed."""
    prompt = _prompts()[1]
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    try:
        def ask(info: DisaggInfo, rid: str):
            gen.add_request(prompt, GREEDY, rid, RequestType.GENERATION_ONLY, info)
            start = time.monotonic()
            out = [o for o in step_until([ctx, gen], lambda outs: any(o.finished and o.request_id == rid
                                                                      for o in outs), limit=100_000)
                   if o.request_id == rid][-1]
            return out, time.monotonic() - start

        out, took = ask(DisaggInfo(95, ctx.kv_endpoint, 0, (5,)), "never")  # first contact (canary) included
        assert (out.finish_reason, out.error_code) == ("error", "kv_not_found") and took < 1.0, (out, took)
        assert "holds no request 95: it never arrived here" in out.error
        ctx.add_request(prompt, GREEDY, "c", RequestType.CONTEXT_ONLY, DisaggInfo(96))
        answer = [o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished][0]
        out, _ = ask(handoff(ctx, answer), "pulled")
        assert out.finish_reason == "length" and out.error is None
        _assert_everything_freed(ctx, gen)
        out, took = ask(handoff(ctx, answer), "again")
        assert out.error_code == "kv_not_found" and took < 1.0, (out, took)
        ctx.add_request(prompt, GREEDY, "c2", RequestType.CONTEXT_ONLY, DisaggInfo(97))
        answer = [o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished][0]
        step_until([ctx], lambda _: 97 in ctx.runner.connector.tx.send_sessions, limit=1000)
        assert ctx.release_kv(97)
        out, took = ask(handoff(ctx, answer), "released")
        assert out.error_code == "kv_not_found" and took < 1.0, (out, took)
        assert "already sent, released or timed out" in out.error
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_ids_outside_int64_are_refused_by_the_engine(tiny):
    """The id travels as a msgpack int64 (between ranks, and to the context instance): one past it is a
    RequestError naming the field, never an OverflowError in the step loop."""
    ctx = _engine(tiny, "shm")
    try:
        for rid in (2**63, 2**64 + 1, 2**200):
            for kind, info in ((RequestType.CONTEXT_ONLY, DisaggInfo(rid)),
                               (RequestType.GENERATION_ONLY, DisaggInfo(rid, ctx.kv_endpoint, 0, (5,)))):
                with pytest.raises(RequestError, match=r"disagg_request_id in \[1, 2\*\*63\)") as e:
                    ctx.add_request([5, 6, 7], GREEDY, None, kind, info)
                assert e.value.param == "disaggregated_params.disagg_request_id"
        with pytest.raises(RequestError, match="first_gen_tokens must be token ids") as e:
            ctx.add_request([5, 6, 7], GREEDY, None, RequestType.GENERATION_ONLY,
                            DisaggInfo(9, ctx.kv_endpoint, 0, (-1,)))
        assert not ctx.has_unfinished() and ctx.blocks.num_free_blocks == ctx.blocks.num_blocks
    finally:
        ctx.shutdown()


def test_a_context_instance_that_takes_the_request_and_never_writes(tiny, caplog):
    """Every wait of a transfer is bounded by kv_transfer_timeout_ms from the generation side's
    admission, and the timeout says what it waited for. The context instance here never got the
    prefill of this generation_first request, so it parks the REQUEST_DATA (its prefill may still come);
    it refuses it at its own timeout instead of keeping it."""
    prompt = _prompts()[1]
    ctx, gen = _engine(tiny, "shm", kv_transfer_timeout_ms=1500), _engine(tiny, "shm", kv_transfer_timeout_ms=1500)
    try:
        gen.add_request(prompt, GREEDY, "g", RequestType.GENERATION_ONLY,
                        DisaggInfo(91, ctx.kv_endpoint, 0, schedule_style="generation_first"))
        start = time.monotonic()
        outs = step_until([ctx, gen], lambda outs: any(o.finished for o in outs), limit=100_000)
        waited = time.monotonic() - start
        assert 1.4 < waited < 3.0
        assert "no write was reported" in outs[-1].error and outs[-1].finish_reason == "error"
        tx = ctx.runner.connector.tx
        step_until([ctx], lambda _: not tx.parked_requests and not tx.control_pending, limit=100_000)
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_a_context_instance_gone_after_its_answer_fails_the_transfer_at_once(tiny):
    """The context instance answered (it holds the KV), then its process went away before the generation
    side asked for the KV: the generation side's link to it never reconnects, so the transfer fails
    after peer_lost_ms, naming the lost rank, instead of waiting out kv_transfer_timeout_ms (20 s here)."""
    first, second = _prompts()[1:]
    ctx = _engine(tiny, "shm", kv_transfer_timeout_ms=20_000)
    gen = _engine(tiny, "shm", kv_transfer_timeout_ms=20_000, peer_lost_ms=500)
    try:
        context_first(ctx, gen, [first], GREEDY)  # first contact (RankInfos, canary) while it is up
        ctx.add_request(second, GREEDY, "c", RequestType.CONTEXT_ONLY, DisaggInfo(93))
        answer = step_until([ctx], lambda outs: len(outs) == 1)[0]
        info = handoff(ctx, answer)
        ctx.shutdown()  # its control endpoint closes, as a killed process's does
        gen.add_request(second, GREEDY, "g", RequestType.GENERATION_ONLY, info)
        start = time.monotonic()
        outs = step_until([gen], lambda outs: any(o.finished for o in outs), limit=1_000_000)
        waited = time.monotonic() - start
        assert waited < 5.0, f"waited {waited:.1f} s for a context instance that was gone"
        assert outs[-1].finish_reason == "error" and "lost" in outs[-1].error, outs[-1].error
        assert gen.blocks.num_free_blocks == gen.blocks.num_blocks
        assert not gen.has_unfinished()
        print(f"failed {waited:.2f} s after the generation side asked: {outs[-1].error}")
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_first_contact_counts_against_the_transfer_timeout(tiny):
    """A context endpoint that never answers: with rank_info_timeout_s far above kv_transfer_timeout_ms
    the request still fails at the transfer timeout, naming first contact."""
    gen = _engine(tiny, "shm", kv_transfer_timeout_ms=1000, rank_info_timeout_s=30)
    try:
        silent = f"tcp://127.0.0.1:{free_port()}"
        gen.add_request(_prompts()[0], GREEDY, "g", RequestType.GENERATION_ONLY, DisaggInfo(92, silent, 0, (5,)))
        start = time.monotonic()
        outs = step_until([gen], lambda outs: any(o.finished for o in outs), limit=100_000)
        assert time.monotonic() - start < 2.5
        assert "first contact" in outs[-1].error and silent in outs[-1].error
        assert gen.blocks.num_free_blocks == gen.blocks.num_blocks
    finally:
        gen.shutdown()


def test_a_prompt_whose_kv_arrived_is_a_prefix_cache_hit_on_the_generation_instance(tiny):
    """The prompt blocks a generation instance received are its own cache afterwards: a request served whole
    there (conditional disaggregation's local prefill, a request the orchestrator sends whole) with that
    prefix computes only the rest, and the router hears of them (KV events). Before, only blocks the instance
    computed itself were offered to its cache."""
    prompt = _prompts()[2]  # 40 tokens: five full blocks of 8
    ctx, gen = _engine(tiny, "shm"), _engine(tiny, "shm")
    stored = []
    gen.blocks.on_event = lambda e: stored.extend(e.block_hashes) if e.kind == "stored" else None
    try:
        context_first(ctx, gen, [prompt], GREEDY)
        assert stored[:5] == block_hashes(prompt, 8)  # the prompt's, before any block decoding filled
        gen.add_request(prompt + [7, 8], GREEDY, "again")
        outs = step_until([gen], lambda outs: any(o.finished for o in outs))
        assert outs[-1].num_cached_tokens == 40
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()
