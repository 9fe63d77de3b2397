"""The one-call decode step (stage_decoder.StageDecoder, csrc/decode_layers.c) against the model's own
modules, step by step, inside real generation, one sequence at a time and several together."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import cpu
from pdserve.testing import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu.skinny_linear_runs(),
                                reason="no C compiler, or a CPU without AVX-512: no native decode step")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _steps(model_dir, prompt_lens=(5, 30), max_num_seqs=1, **cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Generate prompts of `prompt_lens` tokens, `max_num_seqs` at a time; at every native step also
    run the modules on the same input (they rewrite the same cache slots) and keep both outputs."""
    seen = []
    with LLM(EngineConfig(model=str(model_dir), device="cpu", tokens_per_block=8, max_num_seqs=max_num_seqs,
                          **cfg)) as llm:
        model = llm.engine.runner.model
        native = model.stage_decoder
        assert native is not None

        def both(h, rope_table, cache, md):
            ours = native(h, rope_table, cache, md)
            if not md.decode_only:  # a prefill: not the native step's
                assert ours is None
                return None
            theirs = h
            for i, layer in enumerate(model.layers):
                theirs = layer(theirs, rope_table, i, cache, md)
            seen.append((ours, theirs))
            return ours

        model.stage_decoder = both
        g = torch.Generator().manual_seed(3)
        llm.generate([torch.randint(3, 500, (n,), generator=g).tolist() for n in prompt_lens], GREEDY)
    return seen


@pytest.mark.parametrize("arch,dtype,cfg", [
    ("llama", torch.float32, {}),
    ("llama", torch.float32, {"max_num_seqs": 4, "prompt_lens": (5, 30, 17, 9)}),  # steps of 4 rows
    ("qwen2", torch.bfloat16, {"dtype": "bfloat16", "max_num_seqs": 4, "prompt_lens": (5, 30, 17, 9)}),
    ("llama", torch.float32, {"kv_layout": "NHD", "kv_cache_dtype": "bfloat16"}),
    ("qwen2", torch.float32, {}),  # q/k/v biases
    ("llama", torch.bfloat16, {"dtype": "bfloat16"}),
    ("qwen2", torch.bfloat16, {"dtype": "bfloat16", "kv_layout": "NHD"}),
])
def test_native_step_matches_the_modules(tmp_path, arch, dtype, cfg):
    """The same kernels in the same order: the outputs agree to the last bits, where only silu's exp
    (glibc's here, Sleef's in PyTorch) may differ by an ulp and carry into the layers after it."""
    d = make_tiny_model(tmp_path / "m", arch=arch, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate_size=96, vocab_size=512)
    seen = _steps(d, **cfg)
    rows = [ours.shape[0] for ours, _ in seen if ours is not None]
    # every decode step took the native path: each sequence's 11 decode tokens, one row each
    assert sum(rows) == len(cfg.get("prompt_lens", (5, 30))) * (GREEDY.max_tokens - 1)
    assert max(rows) == cfg.get("max_num_seqs", 1)
    for ours, theirs in seen:
        assert ours is not None and ours.dtype == dtype and ours.shape == theirs.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 ** -7, atol=2 ** -7)
            assert (ours == theirs).float().mean() >= 0.99  # the very same bf16 values, but for a rare flip


def test_steps_it_does_not_take(tmp_path):
    """No native step object where it cannot apply: without the plain GEMV weights, or with an fp16
    model; and a step of more decode rows than the module path gives the GEMV (9 fp32 rows) goes to
    the modules, while one of 2 rows takes the native step."""
    d = make_tiny_model(tmp_path / "m", num_layers=2)
    with LLM(EngineConfig(model=str(d), device="cpu", cpu_decode_gemv=False)) as llm:
        assert llm.engine.runner.model.stage_decoder is None
    with LLM(EngineConfig(model=str(d), device="cpu", dtype="float16")) as llm:
        assert llm.engine.runner.model.stage_decoder is None
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8)) as llm:
        model = llm.engine.runner.model
        native, calls = model.stage_decoder, []

        def counted(*args):
            out = native(*args)
            calls.append(out is not None)
            return out

        model.stage_decoder = counted
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert calls[1:] == [True] * 3, calls  # the two prompts' prefill, then three steps of two decode rows
        calls.clear()
        llm.generate([[5 + i, 6, 7] for i in range(9)], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert calls and not any(calls), calls  # a prefill, then steps of 9 fp32 rows: the modules' GEMM
