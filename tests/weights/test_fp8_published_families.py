"""FP8 in blocks beyond DeepSeek-V3: a family's published checkpoint (pdserve/testing/published_families.py:
transformers' save_pretrained, bf16, sharded) with its projections quantized to float8_e4m3fn in [16, 24] blocks
with one `weight_scale_inv` each, as Qwen publishes Qwen3-30B-A3B-FP8 in [128, 128] ones (fp8_checkpoint.py;
[16, 24] so most weights end in partial blocks): pdserve's greedy tokens are transformers' on the weights
multiplied out. Qwen3-MoE is quantized as Qwen ships it (every expert's projections, the router kept); Llama,
Qwen2, Nemotron-H (Mamba2's in_proj and out_proj too) and Qwen3.5-MoE's vision-language checkpoint (its text
model's `*_proj` projections, Gated DeltaNet's out_proj and the shared expert's too; the vision tower kept) by the same rule, for
the loading path they share."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.fp8_checkpoint import quantize_checkpoint, read_tensors
from pdserve.testing.published_families import FAMILIES, oracle_dir

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 9, 33, 70, 2, 101], list(range(3, 30))]
MAX_NEW = 10


@pytest.mark.parametrize("name", ["qwen3_moe", "llama", "qwen2", "nemotron_h", "qwen3_5_moe"])
def test_block_fp8_checkpoint_serves_transformers_tokens_on_the_dequantized_weights(tmp_path, hf_greedy, name):
    fp8 = quantize_checkpoint(FAMILIES[name](tmp_path / "bf16", "40KB"), tmp_path / "fp8", block=(16, 24))
    tensors = read_tensors(fp8)
    quantized = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert quantized and all(n + "_scale_inv" in tensors for n in quantized)
    if name == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in quantized
        assert "model.layers.0.mlp.gate.weight" not in quantized
    if name == "qwen3_5_moe":
        assert {"model.language_model.layers.0.linear_attn.out_proj.weight",
                "model.language_model.layers.0.mlp.experts.7.down_proj.weight",
                "model.language_model.layers.0.mlp.shared_expert.down_proj.weight"} <= quantized
        assert not any(n.startswith("model.visual.") for n in quantized)
    published_class = getattr(transformers, json.loads((fp8 / "config.json").read_text())["architectures"][0])
    oracle = published_class.from_pretrained(oracle_dir(fp8), dtype=torch.float32)
    ref = hf_greedy(oracle, PROMPTS, MAX_NEW)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig(model=str(fp8), tokens_per_block=8)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == ref
