"""Checkpoints as they are published, written by transformers' own `save_pretrained` of the published class,
in shards: pdserve reads their config.json as transformers does and loads their tensor names, and its greedy
tokens equal transformers' on them. Nemotron-H names its weights backbone.*, Qwen3-MoE saved by transformers
5 says num_local_experts; a model pdserve does not serve is refused by its architectures, naming the list."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.weights.hf_dir import INDEX_FILE, read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SHARD = "40KB"  # a few shards of each tiny model


def _stored_names(d) -> set[str]:
    names = set()
    for file in sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values())):
        with safe_open(str(d / file), framework="pt") as f:
            names |= set(f.keys())
    return names


def _equal_to_transformers(d, hf_greedy):
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23)]
    ref = hf_greedy(model, prompts, MAX_NEW)
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref


def test_nemotron_h_as_published_loads_and_equals_transformers(tmp_path, hf_greedy):
    d = make_tiny_nemotron_h(tmp_path / "m", pattern="M-*M", mamba={"ssm_state_size": 8}, max_shard_size=SHARD)
    names = _stored_names(d)
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.0.mixer.A_log"} <= names
    assert not any(n.startswith("model.") for n in names)  # (transformers' in-memory spelling)
    assert ModelConfig.from_hf(read_config(d)).mamba.state_size == 8
    _equal_to_transformers(d, hf_greedy)


def test_qwen3_moe_saved_by_transformers_is_read_as_moe_and_equals_transformers(tmp_path, hf_greedy):
    d = make_tiny_model(tmp_path / "m", arch="qwen3_moe", num_layers=2, max_shard_size=SHARD)
    raw = read_config(d)
    assert raw["num_local_experts"] == 8 and "num_experts" not in raw  # transformers 5's spelling
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.moe.num_experts, cfg.moe_layers) == (8, (0,))  # layer 1 is mlp_only
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in _stored_names(d)
    _equal_to_transformers(d, hf_greedy)


def test_nemotron_h_older_config_keys_read_as_transformers_reads_them():
    """hybrid_override_pattern (the first Nemotron-H checkpoints' key), and Infinity as transformers encodes it."""
    cfg = ModelConfig.from_hf({
        "architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-*", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16,
        "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert (cfg.num_layers, cfg.recurrent_layers, cfg.cacheless_layers, cfg.kv_layers(0, 3)) == (3, (0,), (1,), [2])


def test_an_unserved_architecture_is_refused_naming_it_and_the_served_ones(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="llama", num_layers=1)
    (d / "config.json").write_text(json.dumps(read_config(d) | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPT2LMHeadModel'\] .*"
                                         r"pdserve serves \[.*'NemotronHForCausalLM'.*'Qwen3MoeForCausalLM'"):
        LLM(EngineConfig(model=str(d), num_kv_blocks=8))


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="qwen3", num_layers=1, max_shard_size=SHARD)
    lost = sorted(d.glob("model-*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(ValueError, match=rf"names shards that do not exist: \['{lost.name}'\]; download them again"):
        LLM(EngineConfig(model=str(d), num_kv_blocks=8))
