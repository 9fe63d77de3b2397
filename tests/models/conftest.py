"""Shared by the attention kernel tests: the oracle they all compare with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, heads, d]; k, v: [kv_heads, ctx, d]; query i at position ctx - n + i. SDPA in float64."""
    n, ctx = q.shape[0], k.shape[1]
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double()[None], v.double()[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.fixture(scope="session")
def attention_float64():
    return _causal_attention_float64
