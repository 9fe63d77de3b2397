"""Nemotron-H's MoE block (models/moe.py with MoeShape.activation "relu2") against transformers' NemotronHMoE on
the same weights: the routing in fp32, the squared-ReLU experts, their outputs weighted and summed in fp32 and
cast once (as transformers' experts do), the shared expert added after; Super's latent projections around the
routed experts. bf16 bit for bit; fp32 within an ulp or two, where torch's grouped_mm (transformers' experts)
and F.linear (pdserve's) sum their products in different orders."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.config import ModelConfig
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState

transformers = pytest.importorskip("transformers")


def _pair(dtype: torch.dtype, latent: int | None):
    """(transformers' NemotronHMoE, pdserve's SparseMoeBlock) on the same random weights."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    config = transformers.NemotronHConfig(
        hidden_size=64, layers_block_type=["moe"], n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, moe_latent_size=latent, num_attention_heads=4, head_dim=16)
    g = torch.Generator().manual_seed(0)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks (the eager loop rounds otherwise)
    theirs = NemotronHMoE(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        theirs.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    theirs.to(dtype)
    theirs.gate.float()  # transformers keeps the router in fp32 (_keep_in_fp32_modules)
    weights = theirs.state_dict()

    def take(name: str) -> torch.Tensor:
        if name.startswith("experts."):  # experts.E.up_proj.weight: one of transformers' stack
            _, e, proj, _ = name.split(".")
            return weights[f"experts.{proj}"][int(e)]
        return weights[name]

    shape = ModelConfig.from_hf({**config.to_dict(), "architectures": ["NemotronHForCausalLM"]}).moe
    ours = SparseMoeBlock(shape, 64, ParallelState(), dtype)
    ours.load(take, "")
    return theirs, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("latent", [None, 24], ids=["nano", "super latent"])
def test_the_block_equals_transformers(dtype, latent):
    theirs, ours = _pair(dtype, latent)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = theirs(x.unsqueeze(0))[0]
        if dtype == torch.bfloat16:
            assert torch.equal(ours(x), want)
        else:
            torch.testing.assert_close(ours(x), want, rtol=1e-6, atol=1e-5)
        assert ours(x[:0]).shape == (0, 64)  # a step that routes no rows
