"""Qwen3.5 as Qwen publishes it: a vision-language checkpoint (Qwen3_5ForConditionalGeneration, and
Qwen3_5MoeForConditionalGeneration for the MoE models), written in shards by transformers' own save_pretrained
(make_tiny_qwen3_5). pdserve reads the text model's config from `text_config`, loads `model.language_model.*`,
skips the vision tower with one log line, and its greedy tokens equal those of transformers' own class on the
same directory (its generate on token ids alone); the MoE's under TP2 too. Tensors outside what it knows are
still refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.testing.tiny_qwen3_5 import make_tiny_qwen3_5
from pdserve.weights.hf_dir import INDEX_FILE, read_config, weight_files

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SHARD = "40KB"  # a few shards of each tiny model


def _published(d, hf_greedy):
    """The checkpoint, two prompts and transformers' greedy tokens for them from its published class."""
    config = transformers.AutoConfig.from_pretrained(d)
    model = getattr(transformers, config.architectures[0]).from_pretrained(d, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, config.get_text_config().vocab_size, (n,), generator=g).tolist() for n in (5, 23)]
    return d, prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def dense(tmp_path_factory, hf_greedy):
    return _published(make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "m", max_shard_size=SHARD), hf_greedy)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, hf_greedy):
    return _published(make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe") / "m", moe=True, max_shard_size=SHARD),
                      hf_greedy)


def _stored_names(d) -> set[str]:
    names = set()
    for file in weight_files(d):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return names


def _generate(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **engine)) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_dense_vision_language_checkpoint_serves_its_text_model_as_transformers_does(dense, caplog):
    d, prompts, ref = dense
    raw = read_config(d)
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in raw
    assert "hidden_size" not in raw  # the text model's keys live under text_config only
    names = _stored_names(d)
    assert {"model.language_model.embed_tokens.weight", "model.language_model.layers.3.self_attn.q_proj.weight",
            "lm_head.weight"} <= names
    visual = sorted(n for n in names if n.startswith("model.visual."))
    assert visual and len(list(d.glob("model-*.safetensors"))) > 2
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.num_layers, cfg.recurrent_layers, cfg.hidden_size, cfg.moe) == (4, (0, 1, 2), 64, None)
    with caplog.at_level(logging.INFO, logger="pdserve.models.loader"):
        assert _generate(d, prompts) == ref
    skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert skipped == [f"skipped {len(visual)} tensors of the vision tower (model.visual.*) ({visual[0]}, ...): "
                       "pdserve does not serve it"]


def test_moe_vision_language_checkpoint_serves_its_text_model_as_transformers_does(moe):
    d, prompts, ref = moe
    cfg = ModelConfig.from_hf(read_config(d))
    assert (cfg.architecture, cfg.moe_layers) == ("Qwen3_5MoeForConditionalGeneration", (0, 1, 2, 3))
    shape = cfg.moe
    assert (shape.num_experts, shape.top_k, shape.shared_intermediate_size, shape.shared_gate) == (8, 2, 64, True)
    names = _stored_names(d)  # as transformers 5.24 saves them: one tensor per expert and projection
    assert {"model.language_model.layers.0.mlp.experts.7.gate_proj.weight",
            "model.language_model.layers.0.mlp.shared_expert.down_proj.weight",
            "model.language_model.layers.0.mlp.shared_expert_gate.weight"} <= names
    assert _generate(d, prompts) == ref


def test_the_moe_text_model_class_alone_equals_transformers(tmp_path, hf_greedy):
    """Qwen3_5MoeForCausalLM, the text model's class (`model.*`, no text_config)."""
    d, prompts, ref = _published(make_tiny_qwen3_5(tmp_path / "m", moe=True, vision=False), hf_greedy)
    assert read_config(d)["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in _stored_names(d)
    assert _generate(d, prompts) == ref


def test_moe_experts_stored_fused_load_as_the_per_expert_ones(moe, tmp_path):
    """The same model saved as transformers holds it (save_original_format=False: experts.gate_up_proj
    [experts, 2 * inter, hidden], experts.down_proj [experts, hidden, inter]) gives the same tokens: those of
    transformers on the per-expert checkpoint of the same parameters (same seed)."""
    d, prompts, ref = moe
    fused = make_tiny_qwen3_5(tmp_path / "fused", moe=True, fused_experts=True)
    names = _stored_names(fused)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    assert _generate(fused, prompts) == ref


@pytest.mark.slow
@pytest.mark.parametrize("engine", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_moe_parallel_layouts_equal_transformers(moe, engine):
    """TP2 cuts every expert and the shared expert by their intermediate dimension, the shared expert's gate
    whole on both ranks (replicated experts place only the routed ones otherwise: test_moe_replicated.py).
    PP2: two layers a stage."""
    d, prompts, ref = moe
    assert _generate(d, prompts, **engine) == ref


def test_a_tensor_outside_the_text_model_the_vision_tower_and_mtp_is_still_refused(tmp_path):
    """Beside the published MTP tensors (mtp.*, skipped as weights/mtp.py says), one stray tensor: it alone is
    named."""
    d = make_tiny_qwen3_5(tmp_path / "m", num_layers=4, max_shard_size=SHARD)
    index = json.loads((d / INDEX_FILE).read_text())
    extra = {"model.audio_tower.proj.weight": torch.zeros(2, 2), "mtp.fc.weight": torch.zeros(64, 128),
             "mtp.layers.0.input_layernorm.weight": torch.zeros(64)}
    save_file(extra, str(d / "extra.safetensors"))
    index["weight_map"] |= dict.fromkeys(extra, "extra.safetensors")
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"1 tensors pdserve's decoder has no place for \(model\.audio_tower"):
        LLM(EngineConfig(model=str(d), num_kv_blocks=8))


def test_the_head_is_tied_as_the_published_class_s_config_says():
    """transformers ties the vision-language model's head by its own tie_word_embeddings, not text_config's."""
    text = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": False}
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text, "tie_word_embeddings": True}
    assert ModelConfig.from_hf(raw).tie_word_embeddings
    assert not ModelConfig.from_hf(raw | {"tie_word_embeddings": False}).tie_word_embeddings
