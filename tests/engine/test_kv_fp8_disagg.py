"""An FP8 KV cache disaggregated: the context instance's FP8 blocks land byte for byte in the generation
instance's pool and the answer equals one aggregated FP8 engine's; instances whose KV bytes mean
different things (dtype, or the same size but another dtype) are refused at first contact."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import block_hashes
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.kv_quant import FP8
from pdserve.testing import make_tiny_model
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.testing.disagg import context_first, handoff, step_until
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
T = 8  # tokens per block


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("fp8") / "m", arch="llama", num_layers=4, num_heads=8,
                               num_kv_heads=2, head_dim=16))


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    """DeepSeek-V3: MLA's FP8 latent pool, carried as a REPLICATED pool."""
    return str(make_tiny_deepseek_v3(tmp_path_factory.mktemp("fp8-mla") / "m"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (21, 40, 9)]


def _engine(model: str, kv_cache_dtype: str, kv_layout: str = "HND") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, tokens_per_block=T, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype,
                                  kv_layout=kv_layout,
                                  cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 5000}))


def _prompt_blocks(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The bytes of the prompt's full blocks in an aggregated engine's pool, found through its prefix cache."""
    ids = engine.blocks.match_prefix(block_hashes(prompt, T))
    assert len(ids) == len(prompt) // T  # every full block of the prompt is still cached
    return engine.runner.pool[ids].view(torch.uint8)


def _split(ctx: LLMEngine, gen: LLMEngine, prompts: list[list[int]]):
    """context_first, watching the generation side: (its tokens per prompt, the bytes of each prompt's
    full blocks in its pool once the KV has arrived, before the request ends and frees them)."""
    for i, p in enumerate(prompts):
        ctx.add_request(p, GREEDY, f"c{i}", RequestType.CONTEXT_ONLY, DisaggInfo(2000 + i))
    done = {o.request_id: o for o in step_until([ctx], lambda outs: sum(o.finished for o in outs) == len(prompts))}
    for i, p in enumerate(prompts):
        gen.add_request(p, GREEDY, f"g{i}", RequestType.GENERATION_ONLY, handoff(ctx, done[f"c{i}"]))
    landed = {}

    def watch(_) -> bool:
        for i, p in enumerate(prompts):
            seq = gen.seqs.get(f"g{i}")
            if i not in landed and seq is not None and seq.num_computed_tokens >= len(p):
                landed[i] = gen.runner.pool[seq.block_ids[:len(p) // T]].view(torch.uint8).clone()
        return not ctx.has_unfinished() and not gen.has_unfinished()

    tokens = {f"g{i}": [] for i in range(len(prompts))}
    for o in step_until([ctx, gen], watch):
        assert o.error is None, o.error
        tokens.get(o.request_id, []).extend(o.new_token_ids)
    return [tokens[f"g{i}"] for i in range(len(prompts))], [landed[i] for i in range(len(prompts))]


@pytest.mark.parametrize("model", ["tiny", "latent"])
def test_fp8_disaggregated_equals_aggregated_and_the_kv_lands_byte_exact(request, model, layout="HND"):
    """The generation side's copy of each prompt's full blocks equals, byte for byte, what one aggregated
    FP8 engine computed for the same prompt (the context instance prefills with the same code): attention
    K/V (Llama) and MLA's latents (DeepSeek-V3)."""
    tiny = request.getfixturevalue(model)
    prompts = _prompts()
    with LLM(EngineConfig(model=tiny, tokens_per_block=T, kv_cache_dtype="fp8_e4m3", kv_layout=layout)) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        computed = [_prompt_blocks(llm.engine, p).clone() for p in prompts]
    ctx, gen = _engine(tiny, "fp8_e4m3", kv_layout=layout), _engine(tiny, "fp8_e4m3", kv_layout=layout)
    try:
        assert ctx.runner.pool.dtype == gen.runner.pool.dtype == FP8
        tokens, landed = _split(ctx, gen, prompts)
        assert tokens == expected
        for want, got in zip(computed, landed):
            assert want.count_nonzero() > want.numel() // 2  # real KV, not an empty pool
            assert torch.equal(got, want)
        assert all(e.blocks.num_free_blocks == e.blocks.num_blocks for e in (ctx, gen))
    finally:
        ctx.shutdown()
        gen.shutdown()


@pytest.mark.parametrize("ctx_dtype,gen_dtype,named", [
    ("bfloat16", "fp8_e4m3", ("bfloat16", "float8_e4m3fn")),
    ("bfloat16", "float16", ("bfloat16", "float16")),  # 2 bytes each: the element size alone let this through
])
def test_a_kv_dtype_mismatch_is_refused_at_first_contact(tiny, ctx_dtype, gen_dtype, named):
    ctx, gen = _engine(tiny, ctx_dtype), _engine(tiny, gen_dtype)
    try:
        outs = context_first(ctx, gen, _prompts()[:1], GREEDY)
        err = outs[0].error
        assert err is not None and "KV cache dtype differs" in err and all(n in err for n in named), err
        assert outs[0].token_ids == [] or len(outs[0].token_ids) <= 1  # at most the context's first token
        assert all(e.blocks.num_free_blocks == e.blocks.num_blocks for e in (ctx, gen))
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_the_kv_encoding_travels_in_rank_info_and_other_scales_are_refused():
    """RankInfo carries the dtype, the scale scheme and each layer's scales through its wire form; the write
    plan compares them on the layers both sides hold (context PP2 against generation PP1 here)."""
    from dataclasses import replace

    from pdserve.kv_transfer.errors import AlignmentError
    from pdserve.kv_transfer.rank_info import RankInfo
    from pdserve.kv_transfer.write_plan import align
    from pdserve.plan.transfer import Layout, rank_infos

    def fp8(infos, scales):
        return [replace(i, kv_dtype="float8_e4m3fn", kv_scale_scheme="per_tensor_static",
                        kv_scales=tuple((layer, *scales[layer]) for layer in range(*i.layer_range))) for i in infos]

    geometry = dict(num_layers=4, kv_heads=2, head_dim=16, element_bytes=1, tokens_per_block=8, num_blocks=4)
    scales = {0: (0.5, 0.25), 1: (1.0, 1.0), 2: (2.0, 0.125), 3: (1.0, 0.5)}
    ctx = fp8(rank_infos("ctx", Layout(pp=2), **geometry), scales)
    gen = fp8(rank_infos("gen", Layout(), **geometry), scales)
    wire = RankInfo.from_bytes(ctx[1].to_bytes())
    assert wire == ctx[1] and wire.kv_scales == ((2, 2.0, 0.125), (3, 1.0, 0.5))
    assert all(align(c, gen[0]) for c in ctx)
    other = fp8(rank_infos("gen", Layout(), **geometry), {**scales, 3: (1.0, 0.75)})
    align(ctx[0], other[0])  # layers 0 and 1 agree
    with pytest.raises(AlignmentError, match=r"KV scales of layer 3 differ: .*v_scale=0.5.*v_scale=0.75"):
        align(ctx[1], other[0])
    unscaled = [replace(g, kv_scale_scheme="none", kv_scales=()) for g in gen]
    with pytest.raises(AlignmentError, match="KV scale scheme differs: .*per_tensor_static.* none"):
        align(ctx[0], unscaled[0])
