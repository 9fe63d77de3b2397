"""The engine on a CUDA device: the checks the CPU suite makes, with every rank's weights, KV pool
and activations in device memory. Skipped without a device (`scripts/test -m cuda` runs these).

Never run yet: no task so far was lent a GPU. On a CUDA machine the rest of the suite runs on the
device too (`device: auto`), except where CUDA cannot serve the config (see pick_device)."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_greedy):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", num_layers=3, num_heads=8,
                        num_kv_heads=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 9)]
    return str(d), prompts, hf_greedy(model, prompts, MAX_NEW)


def _run(model, prompts, **cfg):
    with LLM(EngineConfig(model=model, device="cuda", tokens_per_block=8, **cfg)) as llm:
        assert llm.engine.runner.pool.is_cuda
        return [c.token_ids for c in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_greedy_tokens_equal_transformers(tiny, layout):
    d, prompts, ref = tiny
    assert _run(d, prompts, kv_layout=layout) == ref


def test_one_at_a_time_and_chunked(tiny):
    d, prompts, ref = tiny
    assert _run(d, prompts, max_num_seqs=1) == ref
    assert _run(d, prompts, max_num_tokens=16) == ref


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP2 needs two CUDA devices")
def test_two_tensor_parallel_ranks(tiny):
    d, prompts, ref = tiny
    assert _run(d, prompts, tensor_parallel_size=2) == ref


def test_disaggregated_over_nixl_vram(tiny):
    """context_only on one engine, generation_only on another: the KV moves VRAM to VRAM."""
    d, prompts, ref = tiny

    def engine():
        return LLMEngine(EngineConfig(model=d, device="cuda", tokens_per_block=8, num_kv_blocks=64,
                                      cache_transceiver_config={"backend": "nixl", "kv_transfer_timeout_ms": 10000}))

    ctx, gen = engine(), engine()
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == ref
        assert ctx.blocks.num_free_blocks == ctx.blocks.num_blocks
        assert gen.blocks.num_free_blocks == gen.blocks.num_blocks
    finally:
        ctx.shutdown()
        gen.shutdown()
