"""The native flash prefill attention (csrc/flash_prefill.c) against attention computed in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu

LIB = cpu.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the CPU kernels")


def _inputs(n, ctx, heads, kv_heads, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, d, generator=g).to(dtype), torch.randn(kv_heads, ctx, d, generator=g).to(dtype),
            torch.randn(kv_heads, ctx, d, generator=g).to(dtype))


@pytest.fixture(params=["bf16 pairs", "fp32 products"])
def bf16_form(request, monkeypatch):
    """Both forms of the bf16 products: bf16 pairs where the CPU has them, and the fp32 form that a CPU
    without AVX512-BF16 takes."""
    if request.param == "bf16 pairs":
        if LIB.flash_prefill_bf16_pairs() != 1:
            pytest.skip("this CPU has no AVX512-BF16")
    else:
        monkeypatch.setattr(LIB, "flash_prefill_bf16_pairs", lambda: 0)
    return request.param


@pytest.mark.parametrize("n,past,heads,kv_heads,d", [
    (1, 0, 2, 1, 16),  # one query, one key
    (5, 0, 4, 2, 16),  # less than one key block
    (64, 0, 9, 3, 64),  # exactly one key block
    (70, 0, 9, 3, 64),  # a partial second block; 96-row work items with padding rows
    (33, 167, 8, 1, 32),  # a cached prefix (chunked prefill), MQA: one query position per work item row group
    (130, 0, 6, 6, 48),  # MHA, head_dim of three vectors
    (100, 200, 4, 2, 128),  # two 64-wide slices of the accumulator
    (40, 0, 128, 1, 16),  # a group wider than a work item: one query position per item
])
def test_fp32_matches_float64(n, past, heads, kv_heads, d, attention_float64):
    q, k, v = _inputs(n, past + n, heads, kv_heads, d, seed=n + past)
    out = cpu.flash_prefill(q, k, v, d ** -0.5)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), attention_float64(q, k, v, d ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n,past,window", [
    (200, 0, 16),  # a window inside one key block
    (300, 0, 100),  # a window across key blocks; whole blocks before it skipped
    (90, 250, 64),  # a cached prefix, most of it outside the window
    (50, 10, 1000),  # a window longer than the context: plain causal attention
])
def test_sliding_window_matches_float64(n, past, window, attention_float64):
    q, k, v = _inputs(n, past + n, 6, 2, 64, seed=window)
    out = cpu.flash_prefill(q, k, v, 0.125, window=window)
    torch.testing.assert_close(out.double(), attention_float64(q, k, v, 0.125, window), atol=2e-6, rtol=1e-5)


def test_sliding_window_bf16_is_as_accurate_as_pytorchs(bf16_form, attention_float64, as_accurate_as):
    n, past, window = 150, 60, 40
    q, k, v = _inputs(n, past + n, 6, 2, 64, dtype=torch.bfloat16, seed=3)
    keys, queries = torch.arange(past + n).unsqueeze(0), torch.arange(past, past + n).unsqueeze(1)
    mask = (keys <= queries) & (keys > queries - window)
    torch_bf16 = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    out = cpu.flash_prefill(q, k, v, 0.125, window=window)
    as_accurate_as(out, torch_bf16, attention_float64(q, k, v, 0.125, window), max_ratio=2)


def test_running_max_that_keeps_growing_and_large_scores(attention_float64, as_accurate_as):
    """Scores that rise along the keys by far more than the lazy-rescale margin, and scores in the
    hundreds: the running max moves many times, nothing overflows, and the error stays that of
    PyTorch's own fp32 attention (fp32 scores in the hundreds carry ~1e-5 of rounding)."""
    q, k, v = _inputs(300, 300, 4, 2, 64, seed=3)
    k = k * torch.linspace(0.1, 12.0, 300).view(1, 300, 1)  # later keys dominate, more and more
    for scale in (0.125, 1.0):
        out = cpu.flash_prefill(q, k, v, scale)
        assert torch.isfinite(out).all()
        exact = attention_float64(q, k, v, scale)
        torch_fp32 = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                                    scale=scale, enable_gqa=True)[0].transpose(0, 1)
        as_accurate_as(out, torch_fp32, exact, max_ratio=1.5)


def test_strided_q_k_v_as_the_engine_passes_them(attention_float64):
    """The engine hands over q as a view of the rotated q and k rows side by side, and K and V of a fresh
    prefill as transposed views of the projected rows; the result equals that of contiguous copies."""
    g = torch.Generator().manual_seed(5)
    qk = torch.randn(90, 6 + 2, 32, generator=g)
    q = qk[:, :6]
    k_rows, v_rows = torch.randn(90, 2, 32, generator=g), torch.randn(90, 2, 32, generator=g)
    k, v = k_rows.transpose(0, 1), v_rows.transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = cpu.flash_prefill(q, k, v, 0.2)
    torch.testing.assert_close(out.double(), attention_float64(q, k, v, 0.2), atol=2e-6, rtol=1e-5)
    assert torch.equal(out, cpu.flash_prefill(q.contiguous(), k.contiguous(), v.contiguous(), 0.2))


@pytest.mark.parametrize("n,past", [(600, 0), (77, 300)])
def test_bf16_is_as_accurate_as_pytorchs_own_bf16_attention(n, past, bf16_form, attention_float64, as_accurate_as):
    """PyTorch's bf16 flash attention (scores and softmax fp32, probabilities rounded to bf16) is the
    yardstick for both forms of the bf16 products."""
    q, k, v = _inputs(n, past + n, 6, 2, 64, dtype=torch.bfloat16, seed=n)
    out = cpu.flash_prefill(q, k, v, 0.125)
    assert out.dtype == torch.bfloat16
    exact = attention_float64(q, k, v, 0.125)
    mask = torch.arange(past + n).unsqueeze(0) <= torch.arange(past, past + n).unsqueeze(1)
    torch_bf16 = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    as_accurate_as(out, torch_bf16, exact, max_ratio=2)


def test_shapes_the_kernel_does_not_take_are_left_to_pytorch():
    q, k, v = _inputs(8, 8, 4, 2, 24)  # head_dim not a multiple of 16
    assert cpu.flash_prefill(q, k, v, 0.2) is None
    q, k, v = _inputs(8, 8, 4, 2, 32, dtype=torch.float16)  # no fp16 activations
    assert cpu.flash_prefill(q, k, v, 0.2) is None
    q, k, v = _inputs(8, 4, 4, 2, 32)  # more queries than context
    assert cpu.flash_prefill(q, k, v, 0.2) is None
    q, k, v = _inputs(8, 8, 4, 2, 32)  # K and V in another dtype than q (the caller converts them)
    assert cpu.flash_prefill(q, k.bfloat16(), v.bfloat16(), 0.2) is None


def test_writes_into_the_given_output_and_checks_it(attention_float64):
    q, k, v = _inputs(20, 50, 4, 2, 32)
    out = torch.full((30, 4, 32), float("nan"))
    assert cpu.flash_prefill(q, k, v, 0.2, out=out[5:25]) is not None
    torch.testing.assert_close(out[5:25].double(), attention_float64(q, k, v, 0.2), atol=2e-6, rtol=1e-5)
    assert out[:5].isnan().all() and out[25:].isnan().all()  # nothing written outside it
    with pytest.raises(ValueError, match="contiguous"):
        cpu.flash_prefill(q, k, v, 0.2, out=torch.empty(20, 32, 4).transpose(1, 2))
