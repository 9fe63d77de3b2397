"""DeepSeek-V3 as DeepSeek publishes it: FP8 projections with block scales, and the multi-token-prediction layer
past the decoder's.

The checkpoint (pdserve/testing/fp8_checkpoint.py): the tiny DeepSeek-V3 saved by transformers' `save_pretrained`
of DeepseekV3ForCausalLM, its MTP layer added as model.layers.3 (num_nextn_predict_layers 1), then quantized as
the publisher does, in 3 shards. Blocks of [16, 24] (weight_block_size is read from config.json)
leave partial blocks at the edges of most weights: kv_a_proj_with_mqa [40, 64] ends in a block of 8 rows and
one of 16 columns. The oracle is transformers' greedy `generate` on the weights multiplied out block by block.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.fp8_checkpoint import make_tiny_deepseek_v3_fp8

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
BLOCK = (16, 24)


def _stored(d) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for path in sorted(d.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out |= {n: (f.get_tensor(n).dtype, tuple(f.get_tensor(n).shape)) for n in f.keys()}
    return out


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory, hf_greedy):
    fp8, dequantized = make_tiny_deepseek_v3_fp8(tmp_path_factory.mktemp("ds_fp8"), BLOCK)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 19, 33)]
    ref = hf_greedy(oracle, prompts, MAX_NEW)
    assert min(len(set(r)) for r in ref) >= 8
    return fp8, prompts, ref


def test_the_checkpoint_is_quantized_as_deepseek_publishes_it(fp8_model):
    fp8, _, _ = fp8_model
    stored = _stored(fp8)
    a = "model.layers.1.self_attn."
    assert stored[a + "kv_a_proj_with_mqa.weight"] == (torch.float8_e4m3fn, (40, 64))
    assert stored[a + "kv_a_proj_with_mqa.weight_scale_inv"] == (torch.float32, (3, 3))  # ceil(40/16), ceil(64/24)
    assert stored["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"] == (torch.float32, (4, 2))
    for unquantized in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                        a + "kv_a_layernorm.weight", "model.layers.3.eh_proj.weight"):
        assert stored[unquantized][0] == torch.float32 and unquantized + "_scale_inv" not in stored
    assert stored["model.layers.3.mlp.experts.0.up_proj.weight"][0] == torch.float8_e4m3fn  # the MTP layer's
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 24]
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3, 1)


def test_fp8_blocks_and_the_mtp_layer_serve_transformers_tokens(fp8_model, caplog):
    """Batched: transformers' tokens; the MTP layer's tensors are skipped with one log line. (Context TP1 ->
    generation TP2, each rank cutting its shard from the dequantized weights: tests/disagg_e2e/
    test_e2e_deepseek_v3_fp8.py.)"""
    fp8, prompts, ref = fp8_model
    with caplog.at_level(logging.INFO, logger="pdserve.weights.mtp"):
        with LLM(EngineConfig(model=str(fp8), tokens_per_block=8)) as llm:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.weights.mtp"]
    assert len(lines) == 1 and "multi-token-prediction" in lines[0], lines


def test_a_layer_past_the_mtp_layers_is_refused(fp8_model, tmp_path):
    """With num_nextn_predict_layers 0, model.layers.3 is a layer config.json does not name: refused, not
    dropped."""
    fp8, _, _ = fp8_model
    d = shutil.copytree(fp8, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"no place for \(model\.layers\.3\."):
        LLM(EngineConfig(model=str(d), num_kv_blocks=8))
