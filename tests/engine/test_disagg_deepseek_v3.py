"""DeepSeek-V3 disaggregated: the context instance's latent cache moves as a REPLICATED pool (one latent per token
and layer, no heads to cut), and the generation instance decodes what transformers does.

Single-rank pairs in one process (pdserve.testing.disagg drives both engines); context TP1 -> generation TP2 and
TP2 -> TP1 run as real workers in tests/disagg_e2e/test_e2e_deepseek_v3.py, and the write plans of other TP
pairs over this pool are checked byte by byte in tests/kv_transfer/arith/test_latent_pool_plan.py.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.page_table import MapperKind
from pdserve.testing.disagg import context_first
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _engine(d, **transceiver):
    return LLMEngine(EngineConfig(model=str(d), device="cpu", tokens_per_block=8, num_kv_blocks=64, max_num_seqs=4,
                                  max_num_tokens=16, cache_transceiver_config={
                                      "backend": "shm", "kv_transfer_timeout_ms": 20000, **transceiver}))


def test_context_first_equals_transformers(tmp_path, hf_greedy):
    """Prompts of 5, 21 and 40 tokens, prefilled in chunks of 16; the generation instance's tokens are
    transformers' and every block is back on both sides afterwards. (A pipelined send of each chunk's blocks
    runs through real workers: tests/disagg_e2e/test_e2e_deepseek_v3.py.)"""
    d = make_tiny_deepseek_v3(tmp_path / "m")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 21, 40)]
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32), prompts, MAX_NEW)
    ctx = _engine(d)
    try:
        gen = _engine(d)
    except BaseException:
        ctx.shutdown()
        raise
    try:
        for e in (ctx, gen):
            table = e.runner.connector.info.page_table
            (view,) = table.layer_groups[0].views
            assert table.kind_of(view) == MapperKind.REPLICATED and len(table.pools) == 1
            assert view.entries[0].size == 8 * 40 * 4  # a block's latents of one layer: T x latent x fp32
        assert [o.token_ids for o in context_first(ctx, gen, prompts, GREEDY)] == ref
        for e in (ctx, gen):
            assert e.blocks.num_free_blocks == e.blocks.num_blocks
    finally:
        ctx.shutdown()
        gen.shutdown()
