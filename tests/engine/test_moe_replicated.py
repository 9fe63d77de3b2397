"""Replicated experts (EngineConfig.moe_experts: replicated): under tensor parallelism every rank holds every routed
expert whole and computes its share of the step's expert-sorted choices; the all-reduce adds the shares. At the
block: the ranks' shares sum to the one-rank block's output, however few the choices. Through the engine at TP 2
against transformers' greedy tokens: test_engine_deepseek_v3.py's parallel layouts."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.shapes import MoeShape
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState

HIDDEN, EXPERTS, INTER = 32, 6, 16


def _block(top_k: int, ps: ParallelState, replicated: bool) -> SparseMoeBlock:
    g = torch.Generator().manual_seed(3)
    weights = {"mlp.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=g) * 2 / HIDDEN ** 0.5}
    for e in range(EXPERTS):
        for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER))):
            weights[f"mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    block = SparseMoeBlock(MoeShape(EXPERTS, top_k, INTER, True, replicated=replicated), HIDDEN, ps, torch.float32)
    block.load(weights.__getitem__, "mlp.")
    return block


@pytest.mark.parametrize("top_k, tokens", [(2, 37), (1, 1), (4, 3)], ids=["37x2", "1x1", "3x4"])
def test_the_ranks_shares_add_up_to_the_whole_block(top_k, tokens):
    """Each rank's sum before the all-reduce, with whole experts, over its half of the choices (1 x top-1: one rank
    has none); the two add up to one rank's block. Each rank computes as many choices, on whole experts."""
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    whole = _block(top_k, ParallelState(), False)
    shares = [_block(top_k, ParallelState(tp_size=2, rank=r), True) for r in (0, 1)]
    with torch.inference_mode():
        weights, chosen = whole.route(x)
        parts = [b._routed(x, weights, chosen) for b in shares]
        expected = whole._routed(x, weights, chosen)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-6, atol=1e-6)
    n, half = tokens * top_k, tokens * top_k // 2
    assert [b._span(n) for b in shares] == [(0, half), (half, n)]
    assert all(e.gate_up_proj.weight.shape == (2 * INTER, HIDDEN) for b in shares for e in b.experts)
