"""A hybrid model (Qwen3.5) disaggregated: the context instance's recurrent state moves with the
attention layers' KV, section by section where the two sides cut the heads differently, and the
generation instance decodes exactly as one aggregated instance does.

Single-rank pairs in one process (pdserve.testing.disagg drives both engines); the pairs of other TP and
PP layouts are real workers, in tests/disagg_e2e/test_e2e_hybrid.py.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first, step_until

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = str(make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", arch="qwen3_5", num_layers=8, num_heads=4,
                            num_kv_heads=2, head_dim=16))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 21, 40)]
    with LLM(EngineConfig(model=d, device="cpu", tokens_per_block=8)) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    return d, prompts, expected


def _engine(model, backend="shm", max_num_tokens=1024, **transceiver):
    return LLMEngine(EngineConfig(model=model, device="cpu", tokens_per_block=8, num_kv_blocks=64, max_num_seqs=4,
                                  max_num_tokens=max_num_tokens, cache_transceiver_config={
                                      "backend": backend, "kv_transfer_timeout_ms": 20000, **transceiver}))


def _assert_everything_freed(*engines):
    step_until(list(engines), lambda _: not any(e.has_unfinished() for e in engines))
    for e in engines:
        assert e.blocks.num_free_blocks == e.blocks.num_blocks
        assert e.blocks.num_free_state_slots == e.blocks.num_state_slots == 8


def _pair(d, ctx_kw, gen_kw):
    ctx = _engine(d, **ctx_kw)
    try:
        return ctx, _engine(d, **gen_kw)
    except BaseException:
        ctx.shutdown()
        raise


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_context_first_equals_aggregated(hybrid, backend):
    """The state after exactly the prompt lands in the generation instance's slot with the KV."""
    d, prompts, expected = hybrid
    ctx, gen = _pair(d, {"backend": backend}, {"backend": backend})
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == expected
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


@pytest.mark.parametrize("pipelined", [False, True], ids=["whole", "pipelined"])
def test_generation_first_equals_aggregated(hybrid, pipelined):
    """generation_first: the generation side asks first; pipelined, the context side ships each prefill
    chunk's blocks as it finishes them and the state with the last piece only (the state after exactly
    the prompt: no earlier chunk ends at a checkpoint the transfer delivers)."""
    d, prompts, expected = hybrid
    # prefill chunks of 16 tokens: the 40-token prompt goes in three pieces when pipelined
    ctx, gen = _pair(d, {"pipelined_transfer": pipelined, "max_num_tokens": 16}, {})
    try:
        for i, p in enumerate(prompts):
            gen.add_request(p, GREEDY, f"g{i}", RequestType.GENERATION_ONLY,
                            DisaggInfo(700 + i, ctx.kv_endpoint, schedule_style="generation_first"))
        step_until([gen], lambda _: all(gen.seqs[f"g{i}"].disagg.transfer_started for i in range(len(prompts))))
        for i, p in enumerate(prompts):
            ctx.add_request(p, GREEDY, f"c{i}", RequestType.CONTEXT_ONLY,
                            DisaggInfo(700 + i, schedule_style="generation_first"))
        outs = step_until([ctx, gen], lambda outs: sum(o.finished and o.request_id.startswith("g") for o in outs)
                          == len(prompts))
        got = [[t for o in outs if o.request_id == f"g{i}" for t in o.new_token_ids] for i in range(len(prompts))]
        assert got == expected
        assert ctx.runner.connector.tx.stats["direct_writes"] == (6 if pipelined else 3)
        _assert_everything_freed(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()
