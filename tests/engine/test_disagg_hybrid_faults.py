"""A hybrid model's disaggregated request cancelled, aborted or hit by transfer faults: its recurrent-state
slot is given back on both sides, as its KV blocks are, and the requests that do finish are the
aggregated output.

Two real single-rank engines over shm in one process (pdserve.testing.disagg drives them), on a tiny
Qwen3.5 (Gated DeltaNet layers 0-2, attention layer 3): a request's transfer carries three layers' conv
and SSM state beside one layer's KV. Faults are injected by wrapping the real agent
(cache_transceiver_config.fault_injection), as tests/engine/test_injected_faults.py does for Llama."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.kv_transfer.agents.faults import FaultyAgent
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first, handoff, step_until

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", arch="qwen3_5", num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16))


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def expected(hybrid):
    with LLM(EngineConfig(model=hybrid, tokens_per_block=8)) as llm:
        return [o.token_ids for o in llm.generate(_prompts(8), GREEDY)]


def _engine(model: str, checksum: bool = False, max_num_tokens: int = 1024, pipelined: bool = False,
            **faults) -> LLMEngine:
    transceiver = {"backend": "shm", "kv_transfer_timeout_ms": TIMEOUT_MS, "fault_injection": faults or None,
                   "checksum": checksum, "canary": False, "pipelined_transfer": pipelined}
    return LLMEngine(EngineConfig(model=model, tokens_per_block=8, num_kv_blocks=64, max_num_seqs=4,
                                  max_num_tokens=max_num_tokens, cache_transceiver_config=transceiver))


def _assert_freed(*engines: LLMEngine) -> None:
    """Every KV block and every state slot back (8: two per running sequence on a disaggregated instance)."""
    step_until(list(engines), lambda _: not any(e.has_unfinished() for e in engines), limit=20_000)
    for e in engines:
        assert e.blocks.num_free_blocks == e.blocks.num_blocks and not e.seqs
        assert e.blocks.num_free_state_slots == e.blocks.num_state_slots == 8


def _state_addresses(engine: LLMEngine) -> list[tuple[int, int]]:
    """[start, end) of the engine's recurrent-state pools."""
    state = engine.runner.model.state
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (state.conv, state.ssm)]


@pytest.mark.parametrize("side,faults,error", [
    ("ctx", {"write_failure_rate": 1.0}, "KV transfer"),
    ("gen", {"drop_notification_rate": 1.0}, "timed out"),
], ids=["every-write-fails", "every-notification-lost"])
def test_a_transfer_that_cannot_succeed_frees_the_state_slots_on_both_sides(hybrid, side, faults, error):
    ctx = _engine(hybrid, **(faults if side == "ctx" else {}))
    gen = _engine(hybrid, **(faults if side == "gen" else {}))
    try:
        for out in context_first(ctx, gen, _prompts(3), GREEDY, 100, limit=200_000):
            assert out.finish_reason == "error" and error in out.error and "KV transfer" in out.error, out.error
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_corrupted_state_bytes_are_a_clear_error_with_checksums(hybrid, expected, monkeypatch):
    """Half of the writes land with one byte inverted, some of them in a recurrent-state slot: the
    checksums cover the state as they cover the KV blocks, so each corrupted request fails naming a
    block, every other one is the aggregated output, and both sides free everything."""
    landed: list[int] = []
    corrupt = FaultyAgent._corrupt

    def recording(self, src, dst, size):
        new = corrupt(self, src, dst, size)
        scratch = self._scratch_region.ptr
        landed.extend(int(d) for s, d in zip(new[0], new[1]) if scratch <= int(s) < scratch + 4096)
        return new

    monkeypatch.setattr(FaultyAgent, "_corrupt", recording)
    ctx, gen = _engine(hybrid, corrupt_rate=0.5, seed=4), _engine(hybrid, checksum=True)
    try:
        right = failed = 0
        for i, out in enumerate(context_first(ctx, gen, _prompts(8), GREEDY, 400, limit=200_000)):
            if out.finish_reason == "error":
                assert "KV checksum mismatch" in out.error and "block" in out.error, out.error
                failed += 1
            else:
                assert out.token_ids == expected[i]
                right += 1
        assert failed == ctx.runner.connector.agent.injected["corrupted_writes"] == len(landed) > 0 and right > 0
        in_state = [a for a in landed if any(lo <= a < hi for lo, hi in _state_addresses(gen))]
        assert in_state, "no corruption landed in a state slot: this seed tests the KV only"
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_mixed_faults_give_right_answers_or_clear_errors(hybrid, expected):
    ctx = _engine(hybrid, write_failure_rate=0.25, seed=1)
    gen = _engine(hybrid, drop_notification_rate=0.15, seed=2)
    try:
        right = failed = 0
        for i, out in enumerate(context_first(ctx, gen, _prompts(8), GREEDY, 300, limit=200_000)):
            if out.finish_reason == "error":
                assert "KV transfer" in out.error, out.error
                failed += 1
            else:
                assert out.token_ids == expected[i]
                right += 1
        assert failed > 0 and right > 0, (right, failed)
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_aborting_either_side_frees_the_state_slots_on_both(hybrid, expected):
    """Four cancels in turn on one pair: the generation side aborts a request waiting for its KV, and one
    decoding after its state landed; the context side aborts a pipelined prefill mid-way (the generation
    half fails naming the transfer), and releases an answered request's KV and state that nobody pulls.
    After each, both sides hold nothing; then a request goes through whole, equal to aggregated."""
    prompts = _prompts(8)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ctx, gen = _engine(hybrid, max_num_tokens=8, pipelined=True), _engine(hybrid)
    try:
        # 1. generation_first: the generation side asks, then its client goes before any prefill.
        gen.add_request(prompts[0], GREEDY, "g1", RequestType.GENERATION_ONLY,
                        DisaggInfo(501, ctx.kv_endpoint, schedule_style="generation_first"))
        step_until([gen], lambda _: gen.seqs["g1"].disagg.transfer_started)
        assert gen.blocks.num_free_state_slots == 7
        gen.abort("g1")
        _assert_freed(ctx, gen)

        # 2. decoding after the KV and state landed (context_first): aborted mid-decode.
        ctx.add_request(prompts[1], long, "c2", RequestType.CONTEXT_ONLY, DisaggInfo(502))
        answer = [o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished][0]
        assert ctx.blocks.num_free_state_slots == 7  # the state waits for its pull with the KV
        gen.add_request(prompts[1], long, "g2", RequestType.GENERATION_ONLY, handoff(ctx, answer))
        step_until([ctx, gen], lambda outs: sum(len(o.new_token_ids) for o in outs if o.request_id == "g2") > 3)
        gen.abort("g2")
        assert gen.blocks.num_free_state_slots == 8
        _assert_freed(ctx, gen)

        # 3. the context side aborts a pipelined prefill (chunks of 8 tokens) after two chunks were sent.
        p = prompts[2] if len(prompts[2]) > 24 else prompts[2] * 3
        gen.add_request(p, GREEDY, "g3", RequestType.GENERATION_ONLY,
                        DisaggInfo(503, ctx.kv_endpoint, schedule_style="generation_first"))
        step_until([gen], lambda _: gen.seqs["g3"].disagg.transfer_started)
        ctx.add_request(p, GREEDY, "c3", RequestType.CONTEXT_ONLY, DisaggInfo(503, schedule_style="generation_first"))
        step_until([ctx, gen], lambda _: ctx.seqs["c3"].num_computed_tokens >= 16)
        ctx.abort("c3")
        outs = step_until([ctx, gen], lambda outs: any(o.finished and o.request_id == "g3" for o in outs))
        final = [o for o in outs if o.request_id == "g3" and o.finished][0]
        assert final.finish_reason == "error" and "KV transfer" in final.error, final
        _assert_freed(ctx, gen)

        # 4. an answered context request whose generation half never comes: released at once.
        ctx.add_request(prompts[3], GREEDY, "c4", RequestType.CONTEXT_ONLY, DisaggInfo(504))
        step_until([ctx], lambda outs: any(o.finished for o in outs))
        assert ctx.blocks.num_free_state_slots == 7
        assert ctx.release_kv(504)
        _assert_freed(ctx, gen)

        # The pair still serves: a whole request, equal to the aggregated output.
        assert [g.token_ids for g in context_first(ctx, gen, prompts[4:5], GREEDY, 600)] == expected[4:5]
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()
