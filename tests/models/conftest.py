"""Shared by the attention kernel tests: the float64 oracle, and the yardstick of PyTorch's own error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _causal_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              window: int = 0) -> torch.Tensor:
    """q: [n, heads, d]; k, v: [kv_heads, ctx, d]; query i at position ctx - n + i, seeing the keys up to
    it (the last `window` of them with a sliding window). SDPA in float64."""
    n, ctx = q.shape[0], k.shape[1]
    keys, queries = torch.arange(ctx).unsqueeze(0), torch.arange(ctx - n, ctx).unsqueeze(1)
    mask = (keys <= queries) & ((keys > queries - window) if window else True)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double()[None], v.double()[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.fixture(scope="session")
def attention_float64():
    return _causal_attention_float64


def _as_accurate_as(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, max_ratio: float) -> None:
    """`ours` is off `exact` by at most 1.25x `theirs`'s mean error and max_ratio x its largest one."""
    ours, theirs = (ours.double() - exact).abs(), (theirs.double() - exact).abs()
    assert ours.mean() <= 1.25 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= max_ratio * theirs.max(), (ours.max(), theirs.max())


@pytest.fixture(scope="session")
def as_accurate_as():
    return _as_accurate_as
