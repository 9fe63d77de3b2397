"""The sparse MoE block (models/moe.py) against transformers' Qwen3-MoE block on the same weights, and which
layers a Qwen3-MoE config.json makes sparse."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.config import ModelConfig
from pdserve.models.shapes import MoeShape
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

HIDDEN, EXPERTS, INTER = 32, 6, 16


def _blocks(norm_topk_prob: bool, top_k: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * 2 / HIDDEN ** 0.5
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    ours = SparseMoeBlock(MoeShape(EXPERTS, top_k, INTER, norm_topk_prob), HIDDEN, ParallelState(), dtype)
    weights = {"mlp.gate.weight": router}
    for e in range(EXPERTS):
        weights.update({f"mlp.experts.{e}.gate_proj.weight": gate[e], f"mlp.experts.{e}.up_proj.weight": up[e],
                        f"mlp.experts.{e}.down_proj.weight": down[e]})
    ours.load(weights.pop, "mlp.")
    assert not weights  # every tensor taken
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
                         moe_intermediate_size=INTER, norm_topk_prob=norm_topk_prob)
    cfg._experts_implementation = "eager"
    theirs = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        theirs.gate.weight.copy_(router)
        theirs.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
        theirs.experts.down_proj.copy_(down)
    return ours, theirs.to(dtype)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_block_equals_transformers(norm_topk_prob, top_k):
    """fp32: equal to rounding; 37 tokens, so some experts get none."""
    ours, theirs = _blocks(norm_topk_prob, top_k, torch.float32)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-5, atol=1e-5)


def test_bf16_block_rounds_as_transformers():
    """bf16: the same choices and the same sums, bit for bit (routing weights cast to bf16 before they scale)."""
    ours, theirs = _blocks(True, 2, torch.bfloat16)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x[None])[0])


def _config(**moe) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, **moe})


def test_sparse_layers_are_chosen_as_transformers_chooses_them():
    assert _config().moe_layers == (0, 1, 2, 3, 4, 5)
    assert _config(decoder_sparse_step=2).moe_layers == (1, 3, 5)  # every second layer, counted from 1
    assert _config(mlp_only_layers=[0, 3]).moe_layers == (1, 2, 4, 5)
    assert _config(num_experts=0, num_experts_per_tok=0).moe_layers == ()
    cfg = _config()
    assert cfg.qk_norm and not cfg.o_proj_bias and not cfg.attention_bias and cfg.head_dim == 32
    assert _config(attention_bias=True).o_proj_bias


def test_bad_moe_config_is_refused_by_name():
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        _config(num_experts_per_tok=9)
    problem = _config(moe_intermediate_size=50).layout_problem(4, 1)
    assert "moe_intermediate_size 50" in problem and "use one of [1, 2]" in problem
