"""Nemotron 3: Nemotron-H with mixture-of-experts layers ('moe', pattern letter E), as transformers' `save_pretrained`
writes it (each routed expert's tensors on their own, backbone.*), against transformers' greedy tokens.

An MoE layer routes as DeepSeek-V3 does (sigmoid scores, a correction bias, groups, a scaling factor) to
squared-ReLU experts beside one shared expert; it keeps neither KV nor a state. The oracle runs through
batching and prefill chunks, TP 2 (the experts cut, or replicated whole), PP 2, bf16 (as accurate as transformers'
bf16) and a disaggregated TP1 -> TP2 pair;
Nemotron 3 Super's latent projections (`moe_latent_size`) on a checkpoint of their own, its MTP layers beside
it skipped.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.testing.disagg import assert_nothing_held, context_first, step_until
from pdserve.testing.fp8_checkpoint import read_tensors, write_checkpoint
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.weights.hf_dir import INDEX_FILE, read_config

from low_precision_oracle import assert_as_accurate, errors

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
PATTERN = "ME*E-M"  # Mamba2, MoE, attention, MoE, MLP, Mamba2


def _reference(d, hf_greedy, lengths):
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return str(d), prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def nano(tmp_path_factory, hf_greedy):
    """Nemotron 3 Nano's shape, tiny: 8 experts, top 2 of the 2 best of 4 groups, one shared expert; sharded."""
    d = make_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron3") / "m", pattern=PATTERN, max_shard_size="40KB")
    return _reference(d, hf_greedy, (3, 26))


def _run(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=d, tokens_per_block=8, **engine)) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_published_names_are_read_as_moe_layers_without_cache(nano):
    d = nano[0]
    index = json.loads((Path(d) / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    assert {"backbone.layers.1.mixer.experts.7.up_proj.weight", "backbone.layers.3.mixer.gate.weight",
            "backbone.layers.1.mixer.shared_experts.down_proj.weight"} <= set(index)
    bias = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    with safe_open(f"{d}/{index[bias]}", framework="pt") as f:
        assert f.get_tensor(bias).abs().min() > 0  # drawn, not transformers' zeros: the routing reads it
    cfg = ModelConfig.from_hf(read_config(d))
    assert cfg.moe_layers == (1, 3) and cfg.cacheless_layers == (1, 3, 4) and cfg.kv_layers(0, 6) == [2]
    assert (cfg.moe.activation, cfg.moe.scoring, cfg.moe.n_group, cfg.moe.topk_group) == ("relu2", "sigmoid", 4, 2)
    assert (cfg.moe.shared_intermediate_size, cfg.moe.routed_scaling_factor, cfg.moe.latent_size) == (48, 2.5, 0)


def _config(**moe) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M*E",
                                "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
                                "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 4, "n_routed_experts": 8,
                                "moe_shared_expert_intermediate_size": 48, **moe})


def test_a_tp_that_cannot_cut_the_experts_is_refused_unless_they_are_replicated():
    cfg = _config(moe_intermediate_size=34)
    assert "tensor_parallel_size=4 cannot split" in cfg.layout_problem(4, 1)
    assert "moe_intermediate_size 34" in cfg.layout_problem(4, 1) and cfg.layout_problem(2, 1) is None
    assert replace(cfg, moe=replace(cfg.moe, replicated=True)).layout_problem(4, 1) is None  # whole experts


@pytest.mark.parametrize("moe,error", [
    ({"n_group": 3}, r"n_routed_experts=8, n_group=3, topk_group=1: the groups must split the experts evenly"),
    ({"num_experts_per_tok": 5, "n_group": 4, "topk_group": 2}, r"num_experts_per_tok=5 must be between 1 and"),
], ids=["groups", "top_k"])
def test_routing_groups_that_cannot_be_kept_are_refused_naming_the_keys(moe, error):
    with pytest.raises(ValueError, match=error):
        _config(**moe)


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_tokens": 7},  # prompts in chunks of 7 beside decodes
    pytest.param({"tensor_parallel_size": 2, "moe_experts": "replicated"}, marks=pytest.mark.slow),
    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow),  # layers 0-2 and 3-5: an MoE layer each
], ids=["batched", "chunks of 7", "tp2 replicated experts", "pp2"])
def test_greedy_tokens_equal_transformers(nano, engine):
    """(TP2 with every expert cut in two: the latent test's TP2 and the disaggregated TP2 generation side.)"""
    d, prompts, ref = nano
    assert _run(d, prompts, **engine) == ref


def test_bf16_is_as_accurate_as_transformers_bf16(nano):
    """bf16 (the published checkpoints' dtype): tokens part ways on near-ties, so the oracle is accuracy."""
    d, prompts, _ = nano
    assert_as_accurate(*errors(d, prompts, "bfloat16", MAX_NEW, tokens_per_block=8))


@pytest.mark.slow
def test_disaggregated_tp1_to_tp2_equals_aggregated(nano):
    """The Mamba2 state and the attention layer's KV move, re-cut from one rank to two; the MoE layers hold
    nothing to move. The TP2 generation instance decodes what transformers does, and both give everything back."""
    d, prompts, ref = nano

    def engine(tp):
        return LLMEngine(EngineConfig(model=d, device="cpu", tokens_per_block=8, num_kv_blocks=64, max_num_seqs=4,
                                      tensor_parallel_size=tp,
                                      cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 20000}))

    ctx = engine(1)
    try:
        gen = engine(2)
    except BaseException:
        ctx.shutdown()
        raise
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == ref
        step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished())
        assert_nothing_held(ctx, gen)
    finally:  # the TP2 instance first: the TP1 one's shutdown ends the process's one torch.distributed group
        gen.shutdown()
        ctx.shutdown()


@pytest.fixture(scope="module")
def super_latent(tmp_path_factory, hf_greedy):
    """Nemotron 3 Super's experts: routed in a 24-wide latent of the 64-wide hidden state; beside the model,
    multi-token-prediction layers under mtp.* (an attention and an MoE layer's tensors), which transformers'
    NemotronH skips on load, as pdserve does (weights/mtp.py)."""
    root = tmp_path_factory.mktemp("nemotron3_super")
    src = make_tiny_nemotron_h(root / "src", pattern="M*E", moe={"moe_latent_size": 24})
    tensors = read_tensors(src)
    for name, t in list(tensors.items()):
        for layer, mtp in (("backbone.layers.1.", "mtp.layers.0."), ("backbone.layers.2.", "mtp.layers.1.")):
            if name.startswith(layer):
                tensors[name.replace(layer, mtp)] = t.flip(0)
    d = write_checkpoint(src, root / "published", tensors, json.loads((src / "config.json").read_text()))
    return _reference(d, hf_greedy, (5, 23))


@pytest.mark.slow
def test_latent_experts_equal_transformers(super_latent):
    """At TP2 (every expert cut in two; TP1 runs the same products without the all-reduce): each rank's partial
    sum goes through the latent's up projection before the one all-reduce."""
    d, prompts, ref = super_latent
    assert ModelConfig.from_hf(read_config(d)).moe.latent_size == 24
    assert any(n.startswith("mtp.layers.1.mixer.experts.") for n in read_tensors(d))
    assert _run(d, prompts, tensor_parallel_size=2) == ref
