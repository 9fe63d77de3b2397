"""Qwen3 (dense: q/k norms, attention biases) and Qwen3-MoE (sparse experts in every layer but one) against
transformers.

The oracle is transformers' greedy `generate` on the same random weights (tiny models written by
`make_tiny_model(arch="qwen3" | "qwen3_moe")`). The output must not depend on how the engine cuts the
work: batched or alone, a prompt in chunks of 7 beside decodes, a prefix served from the cache, a
sequence preempted and recomputed, tensor- or pipeline-parallel, or disaggregated.
"""

from __future__ import annotations

import pytest
import torch
from low_precision_oracle import assert_as_accurate, errors
from served import assert_greedy_completions, pdserve_serve

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ARCHS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, tmp_path_factory, hf_greedy):
    """3 layers, 4 query heads and 2 KV heads of 16 over a hidden size of 80 (head_dim is its own key, as in
    real Qwen3 checkpoints: 4 * 16 != 80); the MoE's layers 0 and 2 sparse, layer 1 dense. The greedy streams
    are varied (12-16 distinct tokens of 16): a broken attention or routing would show. Written by transformers'
    save_pretrained in shards, so `pdserve serve DIR` below loads a sharded published checkpoint."""
    arch = request.param
    d = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch=arch, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=16, hidden_size=80, max_shard_size="40KB")
    assert len(list(d.glob("model-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    assert type(hf).__name__ == ARCHS[arch]
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 29)]
    return d, prompts, hf_greedy(hf, prompts, MAX_NEW)


def _run(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **engine)) as llm:
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.runner.model.stage_decoder is None  # the native decode step computes plain Llama only
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # every KV block back
    return out


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_seqs": 1},
    {"max_num_tokens": 7},  # prompts in chunks of 7 beside decodes
    {"num_kv_blocks": 8},  # 8 blocks of 8 tokens cannot hold the five: some are preempted and recomputed
], ids=["batched", "one at a time", "chunks of 7", "preempted"])
def test_greedy_tokens_equal_transformers(model, engine):
    d, prompts, ref = model
    assert _run(d, prompts, **engine) == ref


def test_a_cached_prefix_gives_the_same_tokens(model):
    """The 40-token prompt again: its first four blocks come from the prefix cache, and the tokens do not change."""
    d, prompts, ref = model
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        first = llm.generate([prompts[2]], GREEDY)[0]
        again = llm.generate([prompts[2]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert first.token_ids == again.token_ids == ref[2]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_parallel_layouts_equal_transformers(model, layout):
    """TP2 cuts the attention by heads (the q/k norms are per head, whole on each rank) and every expert's
    intermediate dimension (the router replicated); PP2 gives the first stage layers 0-1, the second layer 2."""
    d, prompts, ref = model
    assert _run(d, prompts, **layout) == ref


def test_bf16_is_as_accurate_as_transformers_bf16(model):
    """bf16: tokens part ways on near-ties, so the oracle is accuracy. Teacher-forced on the tokens pdserve
    chose, pdserve's log-probabilities are as close to transformers' fp32 ones as transformers' own bf16."""
    d, prompts, _ = model
    assert_as_accurate(*errors(d, prompts, "bfloat16", MAX_NEW, tokens_per_block=8))


def _disagg_engine(d):
    return LLMEngine(EngineConfig(model=str(d), device="cpu", tokens_per_block=8, num_kv_blocks=64, max_num_seqs=4,
                                  cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 20000}))


def test_disaggregated_context_first_equals_aggregated(model):
    """The KV of standard K/V heads moves as for Llama: the generation instance, handed the context
    instance's blocks and first token, decodes what one aggregated instance (and transformers) does."""
    d, prompts, ref = model
    ctx = _disagg_engine(d)
    try:
        gen = _disagg_engine(d)
    except BaseException:
        ctx.shutdown()
        raise
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == ref  # both drained after
        for e in (ctx, gen):
            assert e.blocks.num_free_blocks == e.blocks.num_blocks
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_pdserve_serve_answers_the_openai_client_as_transformers_does(model):
    """`pdserve serve DIR`, asked through the OpenAI client: the greedy completion of each prompt (token
    ids in, all sent at once) is transformers' text."""
    d, prompts, ref = model
    with pdserve_serve(d, "--tokens-per-block", "8", "--max-num-seqs", "4") as url:
        assert_greedy_completions(url, d, prompts, ref, MAX_NEW)
