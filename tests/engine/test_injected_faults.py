"""Transfers with injected faults (cache_transceiver_config.fault_injection) between two real engines
over shm: failed writes, lost notifications, late writes and (with checksums on) corrupted bytes each
end as the right output or a clear error, never a hang, and no KV block stays allocated on either side.

The faults are injected by wrapping the real agent: the fault tolerance of the transceiver and the
engine around it is under test, not the agent."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.agents.faults import FaultPlan
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import Generated, context_first

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2))


def _engine(model: str, checksum: bool = False, canary: bool = False, **faults) -> LLMEngine:
    """The first-contact canary is off unless asked for: these tests count what faults do to requests."""
    transceiver = {"backend": "shm", "kv_transfer_timeout_ms": TIMEOUT_MS, "fault_injection": faults or None,
                   "checksum": checksum, "canary": canary}
    return LLMEngine(EngineConfig(model=model, tokens_per_block=8, num_kv_blocks=96,
                                  cache_transceiver_config=transceiver))


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(ctx: LLMEngine, gen: LLMEngine, prompts: list[list[int]], first_id: int) -> list[Generated]:
    results = context_first(ctx, gen, prompts, GREEDY, first_id, limit=200_000)
    assert all(r.finish_reason is not None for r in results), "a request never finished"
    return results


def _assert_freed(*engines: LLMEngine) -> None:
    for e in engines:
        assert e.blocks.num_free_blocks == e.blocks.num_blocks and not e.seqs


@pytest.fixture(scope="module")
def expected(tiny):
    ctx, gen = _engine(tiny, canary=True), _engine(tiny, canary=True)
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
        for out in _run(ctx, gen, _prompts(3), 100):
            assert out.finish_reason == "error" and error in out.error and "KV transfer" in out.error
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_late_writes_change_nothing(tiny, expected):
    ctx, gen = _engine(tiny, delay_ms=150), _engine(tiny)
    try:
        assert [r.token_ids for r in _run(ctx, gen, _prompts(4), 200)] == expected[:4]
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
        right = wrong = failed = 0
        for i, out in enumerate(_run(ctx, gen, _prompts(24), 300)):
            if out.finish_reason == "error":
                assert "KV transfer" in out.error
                failed += 1
            elif out.token_ids == expected[i]:
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


def test_corrupted_kv_is_a_clear_error_with_checksums(tiny, expected):
    """Half of the writes land with one byte inverted; the generation side checks KV checksums:
    a corrupted request fails naming the block, every other one is the fault-free output."""
    ctx, gen = _engine(tiny, corrupt_rate=0.5, seed=4), _engine(tiny, checksum=True)
    try:
        right = failed = 0
        for i, out in enumerate(_run(ctx, gen, _prompts(12), 400)):
            if out.finish_reason == "error":
                assert "KV checksum mismatch" in out.error and "block" in out.error, out.error
                failed += 1
            else:
                assert out.token_ids == expected[i]
                right += 1
        assert failed == ctx.runner.connector.agent.injected["corrupted_writes"] > 0 and right > 0
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_a_corrupted_first_contact_canary_keeps_every_request_off_the_pair(tiny, expected):
    """The canary's one write lands with a byte inverted: every request held behind it fails naming the
    canary, none of them was written, and both sides free everything. The next contact checks again
    and, the fault gone, serves the fault-free output."""
    ctx, gen = _engine(tiny, canary=True, corrupt_rate=1.0, seed=6), _engine(tiny, canary=True)
    try:
        for out in _run(ctx, gen, _prompts(3), 500):
            assert out.finish_reason == "error" and "KV transfer" in out.error, out.error
            assert "first-contact canary" in out.error and "canary bytes differ" in out.error, out.error
        agent = ctx.runner.connector.agent
        assert agent.injected["corrupted_writes"] == 1 and ctx.runner.connector.tx.canary_writes == 1
        assert ctx.runner.connector.tx.stats["direct_writes"] == 0  # no request's KV was written
        _assert_freed(ctx, gen)
        agent.plan = FaultPlan()
        assert [r.token_ids for r in _run(ctx, gen, _prompts(3), 600)] == expected[:3]
        assert ctx.runner.connector.tx.canary_writes == 2
        _assert_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()
