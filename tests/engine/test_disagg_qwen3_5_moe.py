"""Qwen3.5-MoE as published (Qwen3_5MoeForConditionalGeneration: Gated DeltaNet and gated attention, a sparse MoE
block with a gated shared expert in every layer) disaggregated from a context instance at TP1 to a generation
instance at TP2: the recurrent state re-cut by heads on the way (as the dense Qwen3.5's, test_disagg_hybrid.py),
the experts cut by their intermediate dimension on the generation side. Its output equals one aggregated
instance's, token for token. Both engines in this process (pdserve.testing.disagg); the generation engine's
second rank is its own process, as every TP instance's."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.disagg import assert_nothing_held, context_first
from pdserve.testing.tiny_qwen3_5 import make_tiny_qwen3_5

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model: str, **engine) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", tokens_per_block=8, num_kv_blocks=32, max_num_seqs=4,
                                  cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 20000},
                                  **engine))


@pytest.mark.slow
def test_context_tp1_to_generation_tp2_equals_aggregated(tmp_path):
    d = str(make_tiny_qwen3_5(tmp_path / "m", moe=True))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 19)]
    with LLM(EngineConfig(model=d, tokens_per_block=8)) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    ctx = _engine(d)
    try:
        gen = _engine(d, tensor_parallel_size=2)
        try:
            assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == expected
            assert_nothing_held(ctx, gen)
        finally:
            gen.shutdown()
    finally:
        ctx.shutdown()
