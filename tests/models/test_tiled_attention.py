"""The tiled oneDNN prefill attention (the CPU path without the native kernels) against SDPA computed in
float64: same formula, any tile edge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models import attention
from pdserve.models.attention import _tiled_causal_attention

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("n,past,heads,kv_heads", [
    (1, 0, 4, 4),  # one row
    (attention._TILE, 0, 9, 3),  # exactly one tile
    (attention._TILE + 44, 0, 9, 3),  # a partial last tile
    (257, 40, 8, 2),  # a cached prefix before the queries
    (130, 700, 6, 1),  # prefix far longer than the queries (MQA)
])
def test_matches_sdpa(n, past, heads, kv_heads, attention_float64):
    g = torch.Generator().manual_seed(n + past)
    d = 32
    q = torch.randn(n, heads, d, generator=g)
    k = torch.randn(kv_heads, past + n, d, generator=g)
    v = torch.randn(kv_heads, past + n, d, generator=g)
    out = _tiled_causal_attention(q, k, v, d ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), attention_float64(q, k, v, d ** -0.5), atol=2e-6, rtol=1e-5)


def test_bf16_is_as_accurate_as_pytorchs_own_bf16_attention(attention_float64, as_accurate_as):
    """Scores and softmax in fp32, probabilities rounded to bf16 for the P @ V product, as PyTorch's
    bf16 flash attention does: its error against float64 is the yardstick."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((600, 6, 64), (2, 600, 64), (2, 600, 64)))
    out = _tiled_causal_attention(q, k, v, 0.125)
    assert out.dtype == torch.bfloat16
    exact = attention_float64(q, k, v, 0.125)
    torch_bf16 = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=0.125,
                                                enable_gqa=True)[0].transpose(0, 1)
    as_accurate_as(out, torch_bf16, exact, max_ratio=2)
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1.6e-2)


def test_engine_takes_the_tiled_path_only_for_long_cpu_prefills():
    q = torch.zeros(1, 1, 1)
    assert attention._use_tiled(q, attention.TILED_MIN_TOKENS)
    assert not attention._use_tiled(q, attention.TILED_MIN_TOKENS - 1)
