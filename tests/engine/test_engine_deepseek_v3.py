"""DeepSeek-V3 (latent attention over a latent cache, a sigmoid-routed MoE with shared experts) against transformers.

The oracle is transformers' greedy `generate` on the same random weights (`make_tiny_deepseek_v3`). The output
must not depend on how the engine cuts the work: batched or alone, a prompt in chunks of 7 beside decodes, a
prefix served from the cache, a sequence preempted and recomputed, tensor- or pipeline-parallel; nor on the
decode form (attending in the latent space, or expanding the latents to per-head K and V).
"""

from __future__ import annotations

import pytest
import torch
from low_precision_oracle import assert_as_accurate, errors
from served import assert_greedy_completions, pdserve_serve

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.plan.profile import kv_bytes_per_token
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.weights.hf_dir import read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
def _tiny(path, hf_greedy, **kw):
    d = make_tiny_deepseek_v3(path, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 29)]
    ref = hf_greedy(hf, prompts, MAX_NEW)
    assert min(len(set(r)) for r in ref) >= 12
    return d, prompts, ref


@pytest.fixture(scope="module")
def model(tmp_path_factory, hf_greedy):
    """3 layers (layer 0 dense, 1-2 MoE: 8 experts in 4 groups, top 2 of the best 2 groups, one shared), 4 heads
    over a 40-wide latent, q through its LoRA. The greedy streams are varied (14-16 distinct tokens of 16)."""
    return _tiny(tmp_path_factory.mktemp("ds") / "m", hf_greedy)


def _run(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **engine)) as llm:
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # every KV block back
    return out


def test_batched_prefix_cached_and_either_decode_form_equal_transformers(model):
    """The five prompts batched, decoding in the latent space (the absorbed form); then again, each prompt's
    full blocks of latents now served from the prefix cache, decoding with the latents expanded to per-head K
    and V (the plain form): transformers' tokens both times."""
    d, prompts, ref = model
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        attns = [layer.self_attn for layer in llm.engine.runner.model.layers]
        assert all(a.absorb_decode for a in attns)
        first = llm.generate(prompts, GREEDY)
        for a in attns:
            a.absorb_decode = False
        again = llm.generate(prompts, GREEDY)
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == ref
    assert first[2].num_cached_tokens == 0 and again[2].num_cached_tokens == 32


def test_chunked_prefill_equals_transformers(model):
    """Prompts in chunks of 7: first the 40-token one alone, whose first chunks sample no token, so the last
    layer's MoE routes no rows (grouped routing once failed to reshape an empty batch); then all five beside
    each other's decodes."""
    d, prompts, ref = model
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, max_num_tokens=7)) as llm:
        alone = llm.generate([prompts[2]], GREEDY)[0].token_ids
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert alone == ref[2] and batched == ref


def test_preempted_sequences_equal_transformers(model):
    """8 blocks of 8 tokens cannot hold the five: some are preempted and recomputed."""
    d, prompts, ref = model
    assert _run(d, prompts, num_kv_blocks=8) == ref


def test_q_without_lora_and_yarn_rope_equal_transformers(tmp_path, hf_greedy):
    """q through one q_proj (q_lora_rank None, as DeepSeek-V2-Lite) and YaRN RoPE: its attention factor (mscale
    0.707 over mscale_all_dim 1) scales cos and sin, mscale_all_dim the softmax."""
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 0.707,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    d, prompts, ref = _tiny(tmp_path / "m", hf_greedy, shape={"q_lora_rank": None}, rope_scaling=yarn)
    assert _run(d, prompts) == ref


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "moe_experts": "replicated"},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "tp2-replicated-experts", "pp2"])
def test_parallel_layouts_equal_transformers(model, layout):
    """TP2 cuts the heads (q_b_proj, kv_b_proj, o_proj) and every expert's intermediate dimension, or keeps every
    routed expert whole on both ranks, each computing half the step's choices (moe_experts: replicated; the shared
    expert cut either way), each rank keeping the whole latent cache; PP2 gives the first stage layers 0-1, the
    second layer 2."""
    d, prompts, ref = model
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **layout)) as llm:
        expert = llm.engine.runner.model.layers[1].mlp.experts[0]  # rank 0's: its down_proj's input columns
        cut = layout.get("tensor_parallel_size", 1) == 2 and "moe_experts" not in layout
        assert expert.down_proj.weight.shape[-1] == (16 if cut else 32)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_bf16_is_as_accurate_as_transformers_bf16(model):
    """bf16: teacher-forced on the tokens pdserve chose, its log-probabilities are as close to transformers'
    fp32 ones as transformers' own bf16 forward."""
    d, prompts, _ = model
    assert_as_accurate(*errors(d, prompts, "bfloat16", MAX_NEW, tokens_per_block=8))


def test_the_cache_keeps_one_latent_per_token_and_layer(model):
    """KV bytes per token = (kv_lora_rank + qk_rope_head_dim) * dtype bytes * layers, not per head: in the
    engine's pool, in a block's bytes at any TP, and in the planner's profile."""
    d, _, _ = model
    cfg = ModelConfig.from_hf(read_config(d))
    per_token = (32 + 8) * 4 * 3
    assert kv_bytes_per_token(cfg, 4) == per_token
    for tp in (1, 2, 4):
        assert kv_block_bytes(cfg, 3, tp, 8, torch.float32) == 8 * per_token
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, num_kv_blocks=4)) as llm:
        pool = llm.engine.runner.pool
        assert pool.shape == (4, 3, 1, 1, 8, 40) and pool.dtype == torch.float32


def test_pdserve_serve_answers_the_openai_client_as_transformers_does(model):
    """`pdserve serve DIR` on the tiny DeepSeek-V3 directory, asked through the OpenAI client: the greedy
    completion of each prompt (token ids in, all sent at once) is transformers' text."""
    d, prompts, ref = model
    with pdserve_serve(d, "--tokens-per-block", "8", "--max-num-seqs", "4") as url:
        assert_greedy_completions(url, d, prompts, ref, MAX_NEW)
