"""RotaryEmbedding.rotate, in both of its forms, against the textbook rotate-half formula in float64."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.layers import ROPE_HALVES_MIN_TOKENS, RotaryEmbedding


def _textbook(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Angles in fp32 as HF computes them (at position 2000 an fp32 angle is off by ~1e-4 rad, which
    is the table's precision, not rotate's); the rotation itself in float64."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.cat([torch.outer(positions.float(), inv)] * 2, -1)
    cos, sin = freqs.cos().double()[:, None], freqs.sin().double()[:, None]
    x = x.double()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


@pytest.mark.parametrize("n", [1, 16, ROPE_HALVES_MIN_TOKENS - 1, ROPE_HALVES_MIN_TOKENS, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_matches_the_textbook_formula(n, dtype):
    rope = RotaryEmbedding(64, 2048, 10000.0, None)
    positions = torch.randperm(2048, generator=torch.Generator().manual_seed(n))[:n]
    qkv = torch.randn(n, 15, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = qkv[:, :12]  # q and k as the model passes them: a strided slice of the fused projection
    out = RotaryEmbedding.rotate(x, rope.table(positions))
    assert out.dtype == dtype and out.shape == x.shape
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), _textbook(x, positions, 10000.0), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_forms_agree_to_the_last_bit(dtype):
    """The prefill form and the decode form must round alike, or a token would differ by batch shape."""
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    positions = torch.arange(ROPE_HALVES_MIN_TOKENS * 2)
    x = torch.randn(len(positions), 4, 64).to(dtype)
    whole = RotaryEmbedding.rotate(x, rope.table(positions))
    one_by_one = torch.cat([RotaryEmbedding.rotate(x[i:i + 1], rope.table(positions[i:i + 1]))
                            for i in range(len(positions))])
    assert torch.equal(whole, one_by_one)
