"""DeepSeek-V3's parts: its config.json as pdserve reads it (the latent's width, the MoE's routing keys, YaRN as
transformers reads it, a clear error for what pdserve does not serve), and the MoE block (grouped sigmoid routing,
shared experts) against transformers' on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.models.config import ModelConfig
from pdserve.models.shapes import MoeShape
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402

# DeepSeek-V3's own config.json (the keys pdserve reads), as deepseek-ai/DeepSeek-V3 ships it
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "attention_bias": False,
}


def test_deepseek_v3_reads_as_one_latent_head_and_grouped_experts():
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_parts, cfg.mla.latent_dim) == (1, 576, 1, 576)
    assert cfg.moe_layers == tuple(range(3, 61)) and cfg.moe.shared_intermediate_size == 2048
    assert (cfg.moe.scoring, cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    yarn = cfg.mla.yarn
    assert yarn.attention_factor == 1.0  # mscale == mscale_all_dim
    assert math.isclose(yarn.softmax_mscale, (0.1 * math.log(40) + 1) ** 2)
    assert cfg.layout_problem(8, 1) is None and "use one of" in cfg.layout_problem(3, 1)


@pytest.mark.parametrize("change,error", [
    ({"rope_scaling": {"type": "longrope", "factor": 2.0, "short_factor": [1.0] * 32, "long_factor": [1.0] * 32,
                       "original_max_position_embeddings": 4096}}, "unsupported rope_type 'longrope'"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "does not read as transformers' DeepseekV3Config"),
    ({"n_group": 3}, "the groups must split the experts evenly"),
    ({"topk_group": 9}, "topk_group be between 1 and n_group"),
    ({"num_experts_per_tok": 200}, "must be between 1 and the experts of topk_group groups"),
    ({"qk_rope_head_dim": 63}, "RoPE requires an even rotary dimension"),  # (transformers' check)
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
])
def test_a_config_pdserve_cannot_serve_is_a_clear_error(change, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


HIDDEN, EXPERTS, INTER = 32, 8, 16


def test_grouped_moe_block_equals_transformers():
    """8 experts in 4 groups, top 2 within the best 2 groups, a score bias that changes choices, one shared
    expert: fp32 equal to rounding over 37 tokens; a batch of no rows is an empty output."""
    g = torch.Generator().manual_seed(3)
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * 2 / HIDDEN ** 0.5
    bias = torch.randn(EXPERTS, generator=g) * 0.1
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    shared = [torch.randn(INTER, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(2)]
    shared.append(torch.randn(HIDDEN, INTER, generator=g) / INTER ** 0.5)
    shape = MoeShape(EXPERTS, 2, INTER, True, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     shared_intermediate_size=INTER)
    ours = SparseMoeBlock(shape, HIDDEN, ParallelState(), torch.float32)
    weights = {"mlp.gate.weight": router, "mlp.gate.e_score_correction_bias": bias}
    for e in range(EXPERTS):
        weights.update({f"mlp.experts.{e}.gate_proj.weight": gate[e], f"mlp.experts.{e}.up_proj.weight": up[e],
                        f"mlp.experts.{e}.down_proj.weight": down[e]})
    for name, w in zip(("gate_proj", "up_proj", "down_proj"), shared):
        weights[f"mlp.shared_experts.{name}.weight"] = w
    ours.load(weights.pop, "mlp.")
    assert not weights  # every tensor taken
    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=4, topk_group=2,
                           moe_intermediate_size=INTER, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    theirs = DeepseekV3MoE(cfg)
    with torch.no_grad():
        theirs.gate.weight.copy_(router)
        theirs.gate.e_score_correction_bias.copy_(bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
        theirs.experts.down_proj.copy_(down)
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), shared):
            getattr(theirs.shared_experts, name).weight.copy_(w)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-5, atol=1e-5)
        chosen = ours.route(x)[1]
        ours.score_bias.zero_()
        assert not torch.equal(ours.route(x)[1], chosen)  # the bias decides some choices: the test covers it
        ours.score_bias.copy_(bias)
        assert ours(x[:0]).shape == (0, HIDDEN)
