"""A checkpoint pdserve would compute differently from its definition is refused, not served: an
activation or bias the decoder does not have, tensors it has no place for. And the sliding window is
read from config.json the way transformers reads it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.weights.hf_dir import read_config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", num_layers=2)


@pytest.mark.parametrize("change, message", [({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
                                             ({"mlp_bias": True}, "unsupported mlp_bias")])
def test_what_the_mlp_lacks_is_refused(llama, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(read_config(llama) | change)


@pytest.mark.parametrize("arch, change, window, layers", [
    ("MistralForCausalLM", {"sliding_window": 4096}, 4096, (0, 1)),
    ("MistralForCausalLM", {"sliding_window": None}, None, ()),
    ("Qwen2ForCausalLM", {"sliding_window": 131072, "use_sliding_window": False}, None, ()),
    ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1}, 4096, (1,)),
    ("MistralForCausalLM", {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"]},
     4096, (0,)),
    ("MistralForCausalLM", {"sliding_window": 4096, "layer_types": ["full_attention"] * 2}, None, ()),
    ("LlamaForCausalLM", {}, None, ()),
])
def test_sliding_window_is_read_as_transformers_reads_it(llama, arch, change, window, layers):
    cfg = ModelConfig.from_hf(read_config(llama) | {"architectures": [arch]} | change)
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)
    assert [cfg.window(i) for i in range(2)] == [window if i in layers else 0 for i in range(2)]


def _with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(load_file(str(src / "model.safetensors")) | extra, str(dst / "model.safetensors"))
    return dst


def test_tensors_without_a_place_are_refused(llama, tmp_path):
    hidden = json.loads((llama / "config.json").read_text())["hidden_size"]
    d = _with_tensors(llama, tmp_path / "biased", {"model.layers.1.self_attn.o_proj.bias": torch.zeros(hidden)})
    with pytest.raises(ValueError, match=r"1 tensors .* no place for \(model\.layers\.1\.self_attn\.o_proj\.bias\)"):
        LLMEngine(EngineConfig(model=str(d), num_kv_blocks=8))


def test_tensors_outside_the_layers_without_a_place_are_refused(llama, tmp_path):
    hidden = json.loads((llama / "config.json").read_text())["hidden_size"]
    d = _with_tensors(llama, tmp_path / "norm_bias", {"model.norm.bias": torch.zeros(hidden)})
    with pytest.raises(ValueError, match=r"1 tensors .* no place for \(model\.norm\.bias\)"):
        LLMEngine(EngineConfig(model=str(d), num_kv_blocks=8))


def test_rope_frequencies_in_the_checkpoint_are_ignored(llama, tmp_path):
    d = _with_tensors(llama, tmp_path / "inv_freq", {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    LLMEngine(EngineConfig(model=str(d), num_kv_blocks=8)).shutdown()
