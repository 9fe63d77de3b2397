"""FP8 weights (pdserve/weights/fp8.py): dequantized exactly as a plain loop over the blocks does it, partial
blocks at the edges included, one scale per tensor under either spelling; a quant_method pdserve does not load,
a weight without its scale or FP8 tensors without a quantization_config are refused naming the fix. End to
end: a Qwen3 checkpoint saved by transformers, quantized per tensor as vLLM names it (weight_scale), serves
transformers' greedy tokens on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model
from pdserve.testing.fp8_checkpoint import dequantize_reference, dequantized_copy, quantize, quantize_checkpoint
from pdserve.weights.fp8 import Fp8Scheme, dequantize_weights

BLOCKWISE = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 24]}}


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(40, 50), (32, 48), (7, 5)], ids=["edge-blocks", "whole-blocks", "one-partial"])
def test_block_dequantization_equals_the_blockwise_loop(shape):
    """[16, 24] blocks: 40 x 50 ends in a block of 8 rows and one of 2 columns; 7 x 5 is one partial block."""
    q, scale = quantize(_weight(*shape), (16, 24))
    assert scale.shape == (-(-shape[0] // 16), -(-shape[1] // 24))
    got = Fp8Scheme.from_config(BLOCKWISE).dequantize("w", q, scale, torch.float32)
    assert torch.equal(got, dequantize_reference(q, scale, (16, 24)))


def test_stacked_experts_dequantize_each_with_its_own_grid():
    """[experts, out, in] with scales [experts, out / bo, in / bi], as a checkpoint that stacks experts holds them."""
    pairs = [quantize(_weight(40, 50, seed=e), (16, 24)) for e in range(3)]
    q, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    got = Fp8Scheme.from_config(BLOCKWISE).dequantize("w", q, scale, torch.float32)
    for e, (qe, se) in enumerate(pairs):
        assert torch.equal(got[e], dequantize_reference(qe, se, (16, 24)))


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["scalar", "one-element"])
def test_per_tensor_dequantization_and_the_serving_dtype(scale_shape):
    q, scale = quantize(_weight(40, 50), None)
    scheme = Fp8Scheme.from_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert scheme.block is None
    got = scheme.dequantize("w", q, scale.reshape(scale_shape), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_reference(q, scale, None).to(torch.bfloat16))


def test_ue8m0_scales_stored_as_bytes_are_powers_of_two():
    """DeepSeek-V3.1's scale_fmt ue8m0: a byte b is the scale 2^(b - 127)."""
    q = torch.ones(16, 24).to(torch.float8_e4m3fn)
    scheme = Fp8Scheme.from_config({"quantization_config": {**BLOCKWISE["quantization_config"], "scale_fmt": "ue8m0"}})
    got = scheme.dequantize("w", q, torch.tensor([[130]], dtype=torch.uint8), torch.float32)
    assert torch.equal(got, torch.full((16, 24), 8.0))
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0'"):
        Fp8Scheme.from_config(BLOCKWISE).dequantize("w", q, torch.tensor([[130]], dtype=torch.uint8), torch.float32)


def test_loaded_tensors_lose_their_scales_and_keep_the_rest():
    q, scale = quantize(_weight(40, 50), (16, 24))
    norm = torch.ones(50)
    tensors = {"l.q_proj.weight": q, "l.q_proj.weight_scale_inv": scale, "l.q_proj.input_scale": torch.tensor(1.0),
               "l.norm.weight": norm}
    assert dequantize_weights(tensors, Fp8Scheme.from_config(BLOCKWISE), torch.float32) == 1
    assert sorted(tensors) == ["l.norm.weight", "l.q_proj.weight"] and tensors["l.norm.weight"] is norm
    assert torch.equal(tensors["l.q_proj.weight"], dequantize_reference(q, scale, (16, 24)))


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_a_quant_method_pdserve_does_not_load_is_named(method):
    with pytest.raises(ValueError, match=rf"quant_method is '{method}': pdserve loads \['fp8'\] only .*unquantized"):
        Fp8Scheme.from_config({"quantization_config": {"quant_method": method, "bits": 4}})


@pytest.mark.parametrize("q,match", [({"fmt": "e5m2"}, "fmt is 'e5m2'"),
                                     ({"weight_block_size": [128]}, r"weight_block_size is \[128\]"),
                                     ({"weight_block_size": [0, 128]}, "two positive integers")])
def test_malformed_fp8_configs_are_refused(q, match):
    with pytest.raises(ValueError, match=match):
        Fp8Scheme.from_config({"quantization_config": {"quant_method": "fp8", **q}})


def test_scales_that_do_not_fit_and_weights_without_scales_are_refused():
    q, scale = quantize(_weight(40, 50), (16, 24))
    scheme = Fp8Scheme.from_config(BLOCKWISE)
    with pytest.raises(ValueError, match=r"scale of shape \(3, 2\); weight_block_size \[16, 24\] gives \(3, 3\)"):
        scheme.dequantize("w", q, scale[:, :2], torch.float32)
    with pytest.raises(ValueError, match=r"are FP8 with no weight_scale_inv"):
        dequantize_weights({"a.weight": q}, scheme, torch.float32)
    with pytest.raises(ValueError, match="not the weight b.weight"):
        dequantize_weights({"b.weight_scale_inv": scale}, scheme, torch.float32)
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        dequantize_weights({"a.weight": q, "a.weight_scale_inv": scale}, None, torch.float32)


def test_per_tensor_fp8_qwen3_serves_transformers_tokens_on_the_dequantized_weights(tmp_path, hf_greedy):
    """Qwen3 saved by transformers (q/k/v/o biases stay float32), its projections FP8 with one `weight_scale`
    each (vLLM's per-tensor spelling), in 3 shards: pdserve's greedy tokens are transformers' on the weights
    multiplied out."""
    transformers = pytest.importorskip("transformers")
    src = make_tiny_model(tmp_path / "src", arch="qwen3", num_layers=2)
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", block=None, scale_name="weight_scale")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(dequantized_copy(fp8, tmp_path / "deq"),
                                                               dtype=torch.float32)
    prompts = [[5, 9, 33, 70, 2, 101], list(range(3, 30))]
    ref = hf_greedy(oracle, prompts, 12)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig(model=str(fp8), tokens_per_block=8)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref


def test_a_checkpoint_quantized_otherwise_is_refused_at_load(tmp_path):
    import json

    src = make_tiny_model(tmp_path / "src", arch="qwen3", num_layers=1)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quant_method is 'awq': pdserve loads \['fp8'\]"):
        LLM(EngineConfig(model=str(src), num_kv_blocks=8))
