"""The FP8 KV cache (`kv_cache_dtype: fp8_e4m3`, per-tensor static scales: kernels/kv_quant.py).

Two oracles. Exact: transformers' greedy `generate` on the same fp32 weights, with an attention that
reads K and V rounded through float8_e4m3fn under the same scales, gives the engine's tokens one for one
(through chunked prefill, a cached prefix and continuous batching). Accuracy: against the bf16 cache on
the same weights, what FP8 costs, measured and asserted with a margin (the numbers are in the tests).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import cpu
from pdserve.kernels.kv_quant import FP8, FP8_MAX, KVScales, dequantize, quantize
from pdserve.testing import make_tiny_model

from low_precision_oracle import greedy_with_logprobs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SHAPES = {"llama": dict(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16),
          "qwen3": dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=80)}


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in (3, 17, 40, 64, 9, 33)[:n]]


def _fp8_attention(scales: dict[int, tuple[float, float]] | None = None) -> str:
    """A transformers attention implementation that attends over K and V as an FP8 cache holds them:
    x -> float8_e4m3fn(clamp(x / scale)) * scale, per layer (`scales`: layer -> (k, v); default 1.0)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, q, k, v, mask, **kw):
        ks, vs = (scales or {}).get(module.layer_idx, (1.0, 1.0))
        k, v = dequantize(quantize(k, ks), ks, k.dtype), dequantize(quantize(v, vs), vs, v.dtype)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("pdserve_fp8_kv", attend)
    return "pdserve_fp8_kv"


def _fp8_greedy_mismatches(hf, prompts, outs, scales=None) -> list[tuple[int, int]]:
    """(prompt, position) of every generated token that is not transformers' argmax there, transformers
    attending over FP8-rounded K and V, teacher-forced on the prompt and pdserve's tokens (one forward per
    prompt: equal to its greedy `generate` wherever every token is the argmax)."""
    hf.set_attn_implementation(_fp8_attention(scales))
    bad = []
    try:
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
            bad += [(i, j) for j, (a, b) in enumerate(zip(logits.argmax(-1).tolist(), out)) if a != b]
    finally:
        hf.set_attn_implementation("sdpa")
    return bad


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny(request, tmp_path_factory):
    """(arch, model dir, transformers' fp32 model of it)."""
    d = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, **SHAPES[request.param])
    return request.param, d, transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                              attn_implementation="sdpa")


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 449.0, 1e6, -1e30, float("inf"), -float("inf"), 2**-9, 1e-4])
    q = quantize(x, 1.0)
    assert q.dtype == FP8 and not q.float().isnan().any()  # finite (and infinite) input never becomes NaN
    assert q.float().tolist()[4:9] == [FP8_MAX, FP8_MAX, -FP8_MAX, FP8_MAX, -FP8_MAX]
    assert q.float()[9] == 2**-9 and q.float()[10] == 0  # the smallest subnormal; below half of it, zero
    # every e4m3 value comes back exact; a scale divides on the way in and multiplies on the way out
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    every = every[~every.float().isnan()]
    assert torch.equal(quantize(every.float(), 1.0).view(torch.uint8), every.view(torch.uint8))
    exact = torch.tensor([0.0, 1.0, -3.25, 448.0]) * 0.25  # e4m3 values times the scale
    assert torch.equal(dequantize(quantize(exact, 0.25), 0.25, torch.float32), exact)
    assert quantize(torch.tensor([-3.3]), 1.0).float().item() == -3.25  # the nearest e4m3 value
    assert quantize(torch.tensor([100.0]), 0.1).float().item() == FP8_MAX  # 1000 saturates
    with pytest.raises(ValueError, match="finite and positive"):
        KVScales((1.0, 0.0), (1.0, 1.0))


def _chosen_logprob_errors(hf, prompts, outs) -> torch.Tensor:
    """|pdserve's log p - transformers fp32's log p| of each token pdserve chose, teacher-forced."""
    errs = []
    for prompt, out in zip(prompts, outs):
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        errs.append((torch.tensor([lp["logprob"] for lp in out.logprobs]) - ref[at, out.token_ids]).abs())
    return torch.cat(errs)


# What an FP8 cache costs against the bf16 cache, fp32 weights, 6 prompts x 16 tokens, teacher-forced
# |log p - transformers fp32's log p| of each chosen token. Measured (mean, max): llama bf16 0.015, 0.071;
# fp8 0.22, 1.23 (its K values reach 7 at head_dim 16: sharp softmaxes magnify e4m3's 3-bit mantissa);
# qwen3 (q/k norms) bf16 0.004, 0.023; fp8 0.074, 0.41. Asserted with a margin of about 2x.
FP8_ERROR_BOUNDS = {"llama": (0.45, 2.5), "qwen3": (0.15, 0.8)}


def test_greedy_equals_transformers_reading_the_same_fp8_kv_and_its_cost_against_bf16(tiny):
    """fp32 weights, so the only rounding is the cache's. Exact: transformers made to attend over the same
    FP8-rounded K and V gives the same tokens, batched with prompts in chunks of 16 beside decodes, and
    again when the prompts' prefixes come from the cache (read back as FP8). Accuracy: the FP8 cache's
    log-probability error within FP8_ERROR_BOUNDS, and above the bf16 cache's."""
    arch, d, hf = tiny
    prompts, params = _prompts(), greedy_with_logprobs(MAX_NEW)
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype="fp8_e4m3", max_num_tokens=16)) as llm:
        assert llm.engine.runner.pool.dtype == FP8
        fp8_outs = llm.generate(prompts, params)
        first = [o.token_ids for o in fp8_outs]
        assert [o.token_ids for o in llm.generate(prompts, params)] == first
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert _fp8_greedy_mismatches(hf, prompts, first) == []
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype="bfloat16")) as llm:
        bf16 = _chosen_logprob_errors(hf, prompts, llm.generate(prompts, params))
    fp8 = _chosen_logprob_errors(hf, prompts, fp8_outs)
    print(f"{arch}: |dlogprob| mean/max bf16 {bf16.mean():.4f}/{bf16.max():.3f} fp8 {fp8.mean():.4f}/{fp8.max():.3f}")
    mean, worst = FP8_ERROR_BOUNDS[arch]
    assert fp8.mean() <= mean and fp8.max() <= worst, (fp8.mean(), fp8.max())
    assert bf16.mean() < fp8.mean()  # the bf16 cache is the more accurate: FP8 is really what the pool holds


def test_checkpoint_scales_are_read_and_applied(tmp_path):
    """A checkpoint carrying self_attn.k_scale / v_scale: the cache uses them (a different scale per
    layer), the tokens are transformers' attending over K and V rounded under the same scales, and scales
    small enough to saturate change the output (so the scales are really applied)."""
    d = make_tiny_model(tmp_path / "m", arch="llama", **SHAPES["llama"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    plain = load_file(d / "model.safetensors")
    scales = {i: (0.5 + 0.25 * i, 0.125 * (i + 1)) for i in range(4)}

    def with_scales(s):
        w = dict(plain)
        for i, (k, v) in s.items():
            w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
            w[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
        save_file(w, d / "model.safetensors", metadata={"format": "pt"})

    def generate(kvd="fp8_e4m3"):
        with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype=kvd)) as llm:
            return llm.engine.runner.cache.scales, [o.token_ids for o in llm.generate(prompts, GREEDY)]

    prompts = _prompts(4)
    with_scales(scales)
    got, scaled = generate()
    assert got == KVScales(tuple(k for k, _ in scales.values()), tuple(v for _, v in scales.values()))
    assert _fp8_greedy_mismatches(hf, prompts, scaled, scales) == []
    with_scales({i: (1e-3, 1e-3) for i in range(4)})  # K and V past 0.45 saturate
    assert generate()[1] != scaled
    with_scales({0: (1.0, 1.0)})
    with pytest.raises(ValueError, match=r"not for layers \[1, 2, 3\]"):
        generate()


@pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build the CPU kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_on_fp8_against_the_pytorch_path(tmp_path, monkeypatch, dtype):
    """A tiny Llama with an FP8 cache under per-layer scales, 4 prompts x 12 greedy tokens, batched with
    prompts in chunks of 16: the native kernels (the RoPE / cache write, flash prefill, paged decode and the
    one-call C decode step, each seen to run) against the PyTorch path (every kernel off). fp32: the same
    tokens, and again from the prefix cache. bf16, where the two paths' other products round apart and
    greedy tokens part on near-ties within a few steps (on some ISAs): as accurate, teacher-forced against
    transformers in fp32, as the PyTorch path."""
    d = make_tiny_model(tmp_path / "m", arch="llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    weights = load_file(d / "model.safetensors")
    for i in range(3):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + 0.25 * i)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.125 * (i + 1))
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 23, 40, 11)]
    greedy = greedy_with_logprobs(12)
    config = EngineConfig(model=str(d), dtype=dtype, tokens_per_block=8, kv_cache_dtype="fp8_e4m3", max_num_tokens=16,
                          kv_cache_memory_gb=1 / 64)

    def generate():
        with LLM(config) as llm:
            outs = [llm.generate(prompts, greedy) for _ in range(2)]  # then from the prefix cache
            return outs, llm.engine.runner.model.stage_decoder is not None

    ran = []
    for name in ("rope_cache_write", "flash_prefill", "paged_decode_attention"):
        def counted(*args, real=getattr(cpu, name), name=name, **kw):
            out = real(*args, **kw)
            ran.append(name if out is not None else None)
            return out
        monkeypatch.setattr(cpu, name, counted)
    native, staged = generate()
    assert staged and {"rope_cache_write", "flash_prefill", "paged_decode_attention"} <= set(ran)
    monkeypatch.setattr(cpu, "load", lambda: None)  # every kernel off: the PyTorch paths
    reference, staged = generate()
    assert not staged
    if dtype == "float32":
        tokens = [[o.token_ids for o in run] for run in native]
        assert tokens == [[o.token_ids for o in run] for run in reference] and tokens[0] == tokens[1]
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ours, theirs = _chosen_logprob_errors(hf, prompts, native[0]), _chosen_logprob_errors(hf, prompts, reference[0])
    assert ours.mean() <= 1.5 * theirs.mean() and ours.max() <= 2 * theirs.max(), (ours.mean(), theirs.mean())


def test_fp8_halves_kv_memory_per_token(tmp_path):
    """Same kv_cache_memory_gb: twice the blocks of a bf16 cache, each half the bytes."""
    d = make_tiny_model(tmp_path / "m", arch="llama", **SHAPES["llama"])
    pools = {}
    for kvd in ("bfloat16", "fp8_e4m3"):
        with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype=kvd, kv_cache_memory_gb=1 / 64)) as llm:
            pools[kvd] = llm.engine.runner.pool
    bf16, fp8 = pools["bfloat16"], pools["fp8_e4m3"]
    assert fp8.shape[0] == 2 * bf16.shape[0] and fp8.shape[1:] == bf16.shape[1:]
    assert fp8.element_size() * 2 == bf16.element_size() == 2
    assert math.isclose(fp8.numel() * fp8.element_size(), bf16.numel() * bf16.element_size(), rel_tol=1e-3)


def test_unknown_kv_cache_dtype_is_a_clear_config_error():
    with pytest.raises(ValueError, match="kv_cache_dtype") as e:
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert "fp8_e4m3" in str(e.value)  # the message lists what is accepted


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
                   "The three primary colors are"]


def test_smollm2_fp8_against_the_bf16_cache(smollm2_path, pdserve_cache):
    """The real embedded SmolLM2-135M-Instruct, fp32 weights, 4 prompts x 8 greedy tokens: the FP8 cache's
    tokens and log-probabilities against the bf16 cache's. Measured (8 prompts x 32 tokens): identical
    for the first 26, 13, 3, 3, 9, 9, 32 and 5 tokens; over the common prefixes |dlogprob| mean 0.016-0.065
    per prompt, max 0.26. Asserted: the first 3 tokens identical (measured on all 8), mean |dlogprob| at
    most 0.1 and max at most 0.4 over each common prefix."""
    params = greedy_with_logprobs(8)
    outs = {}
    for kvd in ("bfloat16", "fp8_e4m3"):
        with LLM(EngineConfig(kv_cache_dtype=kvd, cache_dir=str(pdserve_cache))) as llm:
            outs[kvd] = llm.generate([llm.tokenizer.encode(p) for p in SMOLLM2_PROMPTS], params)
    for bf16, fp8 in zip(outs["bfloat16"], outs["fp8_e4m3"]):
        same = next((i for i, (a, b) in enumerate(zip(bf16.token_ids, fp8.token_ids)) if a != b), len(bf16.token_ids))
        assert same >= 3, (bf16.text, fp8.text)
        d = torch.tensor([abs(a["logprob"] - b["logprob"]) for a, b in zip(bf16.logprobs[:same], fp8.logprobs[:same])])
        assert d.mean() <= 0.1 and d.max() <= 0.4, d


def test_deepseek_v3_fp8_latents_equal_transformers_expanding_the_same(tmp_path):
    """MLA's latent cache in FP8 (each layer's K scale, 1.0 here): transformers made to expand its cached
    latents rounded through float8_e4m3fn (the whole cached latent each step, which is what rounding on
    write gives: rounding twice is rounding once) picks the engine's tokens one for one, batched with
    prompts in chunks of 16 and again from the prefix cache. The pool is FP8, twice the blocks of a bf16
    pool in the same memory."""
    from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

    d = make_tiny_deepseek_v3(tmp_path / "m")
    prompts = _prompts()
    blocks = {}
    for kvd in ("bfloat16", "fp8_e4m3"):
        with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype=kvd, max_num_tokens=16,
                              kv_cache_memory_gb=0.01)) as llm:
            blocks[kvd] = llm.engine.runner.num_blocks
            if kvd == "fp8_e4m3":
                assert llm.engine.runner.pool.dtype == FP8
                first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
                assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == first  # prefixes read back as FP8
    assert blocks["fp8_e4m3"] == 2 * blocks["bfloat16"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)

    def rounded(x):
        return dequantize(quantize(x, 1.0), 1.0, x.dtype)

    for layer in hf.model.layers:
        attn = layer.self_attn
        attn.expand_kv = lambda kv_nope, k_rot, expand=attn.expand_kv: expand(rounded(kv_nope), rounded(k_rot))
    bad = []
    for i, (prompt, out) in enumerate(zip(prompts, first)):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        bad += [(i, j) for j, (a, b) in enumerate(zip(logits.argmax(-1).tolist(), out)) if a != b]
    assert bad == []


def test_scales_of_a_checkpoint_named_as_published_are_read_through_its_renames(tmp_path):
    """Qwen3.5 as published keeps its text model under model.language_model.*: its attention layers' k_scale /
    v_scale are read there, as its weights are. (Before, the scales were looked for under model.layers.* only,
    found nowhere, and the cache ran at scale 1.0 without a word.)"""
    from pdserve.models.config import ModelConfig
    from pdserve.testing.tiny_qwen3_5 import make_tiny_qwen3_5
    from pdserve.weights.hf_dir import read_config

    d = make_tiny_qwen3_5(tmp_path / "m")
    cfg = ModelConfig.from_hf(read_config(d))
    attention = cfg.kv_layers(0, cfg.num_layers)
    weights = load_file(d / "model.safetensors")
    for n, i in enumerate(attention):
        weights[f"model.language_model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + n)
        weights[f"model.language_model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25 + n)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, kv_cache_dtype="fp8_e4m3")) as llm:
        assert llm.engine.runner.cache.scales == KVScales(tuple(0.5 + n for n in range(len(attention))),
                                                          tuple(0.25 + n for n in range(len(attention))))
        assert len(llm.generate([[5, 9, 33]], GREEDY)[0].token_ids) == MAX_NEW
