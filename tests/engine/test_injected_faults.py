"""Transfers with injected faults (cache_transceiver_config.fault_injection) between two real engines
over shm: failed writes, lost notifications and late writes each end as the right output or a clear
error, never a hang, and no KV block stays allocated on either side.

The faults are injected by wrapping the real agent: the fault tolerance of the transceiver and the
engine around it is under test, not the agent."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first, step_until

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2))


def _engine(model: str, **faults) -> LLMEngine:
    transceiver = {"backend": "shm", "kv_transfer_timeout_ms": TIMEOUT_MS, "fault_injection": faults or None}
    return LLMEngine(EngineConfig(model=model, tokens_per_block=8, num_kv_blocks=96,
                                  cache_transceiver_config=transceiver))


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(ctx: LLMEngine, gen: LLMEngine, prompts: list[list[int]], first_id: int) -> dict[str, object]:
    """context_only on ctx, then generation_only on gen, for every prompt; each request's final output."""
    for i, p in enumerate(prompts):
        ctx.add_request(p, GREEDY, f"c{first_id + i}", RequestType.CONTEXT_ONLY, DisaggInfo(first_id + i))
    answers = {o.request_id: o for o in step_until([ctx], lambda outs: sum(o.finished for o in outs) == len(prompts))
               if o.finished}
    finals = {}
    for i, p in enumerate(prompts):
        d = answers[f"c{first_id + i}"].disaggregated_params
        gen.add_request(p, GREEDY, f"g{first_id + i}", RequestType.GENERATION_ONLY,
                        DisaggInfo(d["disagg_request_id"], d["ctx_info_endpoint"], 0, tuple(d["first_gen_tokens"])))
        finals[f"g{first_id + i}"] = []
    done = {}
    for o in step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished(), limit=200_000):
        if o.request_id in finals:
            finals[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    assert set(done) == set(finals), "a request never finished"
    return {rid: (finals[rid], out) for rid, out in done.items()}


def _assert_freed(*engines: LLMEngine) -> None:
    for e in engines:
        assert e.blocks.num_free_blocks == e.blocks.num_blocks and not e.seqs


@pytest.fixture(scope="module")
def expected(tiny):
    ctx, gen = _engine(tiny), _engine(tiny)
    try:
        return [g.token_ids for g in context_first(ctx, gen, _prompts(24), GREEDY)]
    finally:
        ctx.shutdown()
        gen.shutdown()


@pytest.mark.parametrize("side,faults,error", [
    ("ctx", {"write_failure_rate": 1.0}, "KV transfer"),
    ("gen", {"drop_notification_rate": 1.0}, "timed out"),
], ids=["every-write-fails", "every-notification-lost"])
def test_a_transfer_that_cannot_succeed_is_a_clear_error(tiny, side, faults, error):
    ctx = _engine(tiny, **(faults if side == "ctx" else {}))
    gen = _engine(tiny, **(faults if side == "gen" else {}))
    try:
        results = _run(ctx, gen, _prompts(3), 100)
        for _, out in results.values():
            assert out.finish_reason == "error" and error in out.error and "KV transfer" in out.error
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_late_writes_change_nothing(tiny, expected):
    ctx, gen = _engine(tiny, delay_ms=150), _engine(tiny)
    try:
        results = _run(ctx, gen, _prompts(4), 200)
        assert [results[f"g{200 + i}"][0] for i in range(4)] == expected[:4]
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_mixed_faults_give_right_answers_or_clear_errors(tiny, expected):
    """20% of writes fail and 10% of notifications are lost, seeded: each request is either the
    fault-free greedy output or an error naming the KV transfer; nothing hangs or leaks."""
    ctx = _engine(tiny, write_failure_rate=0.2, seed=1)
    gen = _engine(tiny, drop_notification_rate=0.1, seed=2)
    try:
        results = _run(ctx, gen, _prompts(24), 300)
        right = wrong = failed = 0
        for i in range(24):
            tokens, out = results[f"g{300 + i}"]
            if out.finish_reason == "error":
                assert "KV transfer" in out.error
                failed += 1
            elif tokens == expected[i]:
                right += 1
            else:
                wrong += 1
        assert wrong == 0 and failed > 0 and right > 0, (right, wrong, failed)
        injected = ctx.runner.connector.agent.injected, gen.runner.connector.agent.injected
        assert injected[0]["failed_writes"] > 0 and injected[1]["dropped_notifications"] > 0
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()
