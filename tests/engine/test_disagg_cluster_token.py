"""cache_transceiver_config.cluster_token reaches the KV control plane of a real engine: two engines
with the same token hand over the KV as without one; a generation engine with another token is
refused and its request fails naming the key, and the context engine keeps serving."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first, handoff, step_until
from pdserve.testing.wait import wait_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 300, 12, 8, 64, 23, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16))


def _engine(model: str, token: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, tokens_per_block=8, num_kv_blocks=32, cache_transceiver_config={
        "backend": "shm", "kv_transfer_timeout_ms": 3000, "rank_info_timeout_s": 2.0, "cluster_token": token}))


def test_same_token_transfers_and_another_token_is_refused(tiny):
    with LLM(EngineConfig(model=tiny, tokens_per_block=8)) as llm:
        expected = [c.token_ids for c in llm.generate([PROMPT], GREEDY)]
    ctx, gen, stranger = _engine(tiny, "cluster-a"), _engine(tiny, "cluster-a"), _engine(tiny, "cluster-b")
    try:
        assert ctx.runner.connector.tx.messenger.auth_failures == 0
        assert [g.token_ids for g in context_first(ctx, gen, [PROMPT], GREEDY)] == expected

        ctx.add_request(PROMPT, GREEDY, "c", RequestType.CONTEXT_ONLY, DisaggInfo(7001))
        d = next(o for o in step_until([ctx], lambda outs: any(o.finished for o in outs)) if o.finished)
        stranger.add_request(PROMPT, GREEDY, "s", RequestType.GENERATION_ONLY, handoff(ctx, d))
        outs = step_until([stranger], lambda outs: any(o.finished for o in outs))
        final = next(o for o in outs if o.finished)
        assert final.finish_reason == "error" and "cluster_token" in final.error
        # the context's listener thread counts the refused handshake on its own poll, which may come after
        # the stranger's own side has already failed the request
        assert wait_until(lambda: ctx.runner.connector.tx.messenger.auth_failures > 0, timeout_s=5.0)
        step_until([ctx, stranger], lambda _: not ctx.has_unfinished() and not stranger.has_unfinished())
        assert ctx.blocks.num_free_blocks == ctx.blocks.num_blocks  # the unclaimed KV timed out and was freed
    finally:
        for e in (ctx, gen, stranger):
            e.shutdown()
