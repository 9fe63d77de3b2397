"""The engine against transformers on tiny random-weight models: every parallel layout, batching,
chunked prefill, prefix reuse and preemption must leave the greedy tokens unchanged."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import cpu
from pdserve.testing import make_tiny_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = [3, 17, 40, 64, 9, 33, 75, 1][:n]
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_greedy):
    """8 query heads, 2 KV heads: TP4 replicates each KV head on two ranks."""
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", num_layers=4, num_heads=8,
                        num_kv_heads=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size)
    return d, prompts, hf_greedy(model, prompts, MAX_NEW)


def test_each_step_records_what_it_ran(tiny):
    """LLMEngine.last_step (the server's step metrics): prompt tokens and decoding requests per step."""
    d, prompts, _ = tiny
    engine = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8))
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.add_request(prompts[1], params)  # 17 tokens
        records = []
        for _ in range(2):
            engine.step()
            records.append(engine.last_step)
        engine.add_request(prompts[2], params)  # 40 tokens, beside the first request's last token
        engine.step()
        records.append(engine.last_step)
        assert [(r.kind, r.prefill_tokens, r.decode_rows) for r in records] == [
            ("prefill", 17, 0), ("decode", 0, 1), ("mixed", 40, 1)]
        assert all(r.seconds > 0 for r in records)
        while engine.has_unfinished():
            engine.step()
        engine.step()  # nothing left to run
        assert engine.last_step is None
    finally:
        engine.shutdown()


def _run(model_dir, prompts, **cfg):
    cfg.setdefault("tokens_per_block", 8)
    with LLM(EngineConfig(model=str(model_dir), **cfg)) as llm:
        return [c.token_ids for c in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_batched_matches_transformers(tiny, layout):
    d, prompts, ref = tiny
    assert _run(d, prompts, kv_layout=layout) == ref


_NATIVE = ("paged_decode_attention", "flash_prefill", "rope_cache_write", "rms_norm", "skinny_linear")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("missing", [_NATIVE, ("paged_decode_attention", "flash_prefill")], ids=["all", "attention"])
def test_pytorch_paths_match_transformers(tiny, layout, missing, monkeypatch):
    """The model as it runs without a C compiler (and on CUDA): every native kernel replaced by its
    PyTorch path; and with only the attention kernels missing after the native cache write."""
    for name in missing:
        monkeypatch.setattr(cpu, name, lambda *args, **kwargs: None)
    d, prompts, ref = tiny
    assert _run(d, prompts, kv_layout=layout) == ref


@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "onednn only"])
def test_one_sequence_at_a_time_with_and_without_the_gemv(tiny, gemv):
    """Batch-1 decode steps run the linears through the native GEMV on a plain copy of each weight
    (`cpu_decode_gemv`, the default), or through oneDNN's packed weights only; tokens must not move."""
    from pdserve.models.layers import _LINEARS

    d, prompts, ref = tiny
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8, max_num_seqs=1,
                          cpu_decode_gemv=gemv)) as llm:
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, _LINEARS)]
        kept = [m.gemv_weight for m in linears if m.gemv_weight is not None]
        assert len(kept) == (len(linears) if gemv and cpu.skinny_linear_runs() else 0)
        assert all(not w.is_mkldnn and w.is_contiguous() for w in kept)
        assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == ref


def test_unbatched_and_chunked_prefill_match(tiny):
    d, prompts, ref = tiny
    # One sequence at a time, and prompts cut into 7-token chunks.
    assert _run(d, prompts, max_num_seqs=1) == ref
    assert _run(d, prompts, max_num_tokens=7) == ref


def test_last_layer_on_the_sampled_rows_only(tiny):
    """Prefill steps hand the model the rows that sample (`out_rows`): the last layer's o_proj and MLP
    run on those rows only, and they equal those rows of the whole forward. Chunks of 7 tokens make
    steps that sample nothing (a long prompt alone), and, with six sequences, steps that mix chunks with
    decode rows. On the CPU, whose GEMMs compute a row alike whatever the row count: cuBLAS picks its
    kernel by the row count, so on CUDA the rows agree to rounding only."""
    d, prompts, ref = tiny
    seen = []
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8, max_num_tokens=7)) as llm:
        model = llm.engine.runner.model
        forward = model.forward

        def both(x, positions, cache, md, out_rows=None):
            ours = forward(x, positions, cache, md, out_rows)
            if out_rows is not None:
                whole = forward(x, positions, cache, md)  # rewrites the same K and V into the same slots
                assert torch.equal(ours, whole[out_rows])
                seen.append((len(x), len(out_rows)))
            return ours

        model.forward = both
        assert llm.generate([prompts[3]], GREEDY)[0].token_ids == ref[3]  # alone: chunks that sample nothing
        assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == ref
    assert any(k == 0 for _, k in seen) and any(0 < k < n for n, k in seen)


def test_prefix_cache_hit_equals_miss(tiny):
    d, prompts, ref = tiny
    shared = prompts[3][:48]  # six full 8-token blocks
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        first = llm.generate([shared + [5, 6, 7]], GREEDY)[0]
        second = llm.generate([shared + [5, 6, 7]], GREEDY)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 48
        assert second.token_ids == first.token_ids
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_preemption_recomputes_without_changing_tokens(tiny):
    d, prompts, ref = tiny
    # 30 blocks of 8 tokens cannot hold all six sequences at once: some are preempted and requeued.
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, num_kv_blocks=30)) as llm:
        out = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        assert llm.engine.blocks.num_free_blocks == 30
    assert out == ref


@pytest.mark.parametrize("native", [True, False], ids=["flash", "tiled"])
def test_long_prompts_match_transformers(tiny, hf_greedy, native, monkeypatch):
    """Prompts of several key blocks run the native flash prefill, or without it, past
    attention.TILED_MIN_TOKENS, the tiled oneDNN prefill; whole and in chunks that start after a
    cached part, greedy tokens must not move."""
    if not native:
        monkeypatch.setattr(cpu, "flash_prefill", lambda *args, **kwargs: None)
    d, _, _ = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (L,), generator=g).tolist() for L in (700, 1100)]
    ref = hf_greedy(model, prompts, MAX_NEW)
    assert _run(d, prompts) == ref
    assert _run(d, prompts, max_num_tokens=520) == ref


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_parallel_layouts_match_transformers(tiny, tp, pp):
    d, prompts, ref = tiny
    assert _run(d, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1) == ref


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures(tmp_path, arch, hf_greedy):
    d = make_tiny_model(tmp_path / arch, arch=arch, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        tie_word_embeddings=arch == "qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, 3)
    assert _run(d, prompts) == hf_greedy(model, prompts, MAX_NEW)


def test_llama3_rope_scaling(tmp_path, hf_greedy):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    d = make_tiny_model(tmp_path / "l3", arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        rope_scaling=scaling)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, 3)
    assert _run(d, prompts) == hf_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def sliding(request, tmp_path_factory, hf_greedy):
    """A window of 16 positions, far shorter than the prompts: mistral slides in every layer, qwen2 in
    the second half of them."""
    d = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size)
    return d, prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.mark.parametrize("case", ["batched", "NHD", "chunked", "one at a time", "PyTorch paths"])
def test_sliding_window_attention_matches_transformers(sliding, case, monkeypatch):
    d, prompts, ref = sliding
    if case == "PyTorch paths":
        for name in _NATIVE:
            monkeypatch.setattr(cpu, name, lambda *args, **kwargs: None)
    cfg = {"NHD": {"kv_layout": "NHD"}, "chunked": {"max_num_tokens": 16},
           "one at a time": {"max_num_seqs": 1}}.get(case, {})
    assert _run(d, prompts, **cfg) == ref


@pytest.mark.slow
def test_sliding_window_attention_tp2_pp2(sliding):
    d, prompts, ref = sliding
    assert _run(d, prompts, tensor_parallel_size=2, pipeline_parallel_size=2, num_threads=1) == ref


def test_a_context_longer_than_the_model_is_refused(tmp_path):
    d = make_tiny_model(tmp_path / "m", num_layers=1, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"max_model_len=257 is longer than the model's max_position_embeddings "
                                         r"\(256\); set max_model_len <= 256"):
        LLM(EngineConfig(model=str(d), max_model_len=257))
    with LLM(EngineConfig(model=str(d))) as llm:
        assert llm.engine.max_model_len == 256
        engine = llm.engine
        # the context-length rule, checked by the engine alone, naming the field and OpenAI's code
        for ids, params, param in (([5] * 256, SamplingParams(max_tokens=None), "prompt"),
                                   ([5] * 200, SamplingParams(max_tokens=57), "max_tokens")):
            with pytest.raises(RequestError, match="maximum context length is 256 tokens") as e:
                engine.add_request(ids, params)
            assert (e.value.param, e.value.code) == (param, "context_length_exceeded")
        with pytest.raises(RequestError, match=r"min_tokens must be an integer in \[0, max_tokens=6\]") as e:
            engine.add_request([5] * 250, SamplingParams(max_tokens=None, min_tokens=7))
        assert e.value.param == "min_tokens"
        rid = engine.add_request([5] * 250, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
        assert engine.seqs[rid].params.max_tokens == 6  # unset: what the window leaves
        engine.abort(rid)


@pytest.mark.parametrize("layout,says", [
    ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 cannot split this model \(4 attention heads, 2 KV heads, "
                                  r"intermediate_size 64\): use one of \[1, 2, 4\]"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 3}, "pipeline_parallel_size=3 exceeds the model's 2 layers"),
])
def test_a_layout_the_model_cannot_take_is_refused_before_any_rank_starts(tmp_path, layout, says):
    """Before, the other ranks were spawned and the model built before one of its layers refused the split."""
    import psutil

    d = make_tiny_model(tmp_path / "m", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match=says):
        LLMEngine(EngineConfig(model=str(d), **layout))
    assert set(psutil.Process().children()) == before


def test_min_tokens_holds_back_stop_tokens_and_strings(tiny):
    d, prompts, ref = tiny
    stop_id = ref[0][1]  # greedy's second token
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        def run(**kw):
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(stop_id,), **kw)
            return llm.generate([prompts[0]], params)[0]

        assert run().token_ids == ref[0][:2]  # stopped by the stop token at once
        held = run(min_tokens=6)
        assert len(held.token_ids) >= 7 and stop_id not in held.token_ids[:6]
        assert held.token_ids[:1] == ref[0][:1]  # the first token was never a stop candidate
        text = llm.tokenizer.decode(ref[0][:1])
        stopped = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                            stop=[text], min_tokens=3))[0]
        assert len(stopped.token_ids) >= 3
