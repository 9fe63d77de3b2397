"""The native CPU kernels on an FP8 KV pool (kv_cache_dtype fp8_e4m3, kernels/kv_quant.py): each against
the PyTorch path it replaces, bit for bit.

Writing (the RoPE / cache write): the pool's bytes equal PagedKVCache.write's, which quantizes with
kv_quant.quantize (saturating, ties to even, subnormals), under per-layer scales. Reading (paged decode,
flash prefill): an FP8 pool read through its dequantisation tables gives the very output the same kernel
gives on the values PyTorch dequantizes to (a pool of fp32 or bf16), so the native FP8 path differs from
the native fp32 / bf16 paths by nothing but the cache's rounding. The engine on FP8, native against the
PyTorch path: tests/engine/test_kv_fp8.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.kernels import cpu
from pdserve.models.attention import PagedKVCache
from pdserve.kernels.kv_quant import FP8, KVScales, quantize
from pdserve.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build the CPU kernels")

SCALES = KVScales((1.0, 0.061, 2.5), (1.0, 0.37, 3.0))  # 1.0, and scales that do not divide evenly


def test_the_kernels_e4m3_rounding_is_torchs_on_every_kind_of_value():
    """fp8.h's encoder, through the cache write of V (written as it comes): every e4m3 value, the midpoints
    between neighbours (ties to even), subnormals and what rounds to zero, saturation, infinities and NaN,
    and random values over e4m3's whole range, divided by a scale."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-14, 10, (4000,), generator=g).float())
    special = torch.tensor([0.0, -0.0, 2**-10, -2**-10, 2**-11, 3 * 2**-11, 447.9, 449.0, 465.0, 1e30, float("inf"),
                            -float("inf"), float("nan"), 1e-40])
    at_scale = mids * SCALES.v[1]  # ties once divided by the scale (a product by its reciprocal may miss them)
    values = torch.cat([finite, mids, mids.nextafter(torch.tensor(0.0)), at_scale, at_scale.nextafter(-at_scale),
                        spread, special])
    d = 64
    values = torch.cat([values, torch.zeros(-len(values) % d)]).view(-1, 1, d)
    n = values.shape[0]
    for layer in (0, 1):  # scale 1, and 0.37 / 0.061
        pool = torch.zeros(n, 3, 2, 1, 1, d, dtype=FP8)  # HND, one token a block
        qkv = torch.cat([torch.zeros(n, 2, d), values], dim=1)  # one query head, K zero, V the values
        table = (torch.ones(n, d), torch.zeros(n, d))  # cos 1, sin 0: rotation is the identity
        slots = torch.arange(n)
        assert cpu.rope_cache_write(qkv, 1, *table, pool, "HND", layer, slots, torch.zeros(n, dtype=torch.long),
                                    SCALES) is not None
        expected = quantize(values[:, 0], SCALES.v[layer]).view(torch.uint8)
        got = pool[:, layer, 1, 0, 0].view(torch.uint8)
        nan = expected.view(FP8).float().isnan()
        assert torch.equal(got[~nan], expected[~nan]) and got.view(FP8).float()[nan].isnan().all()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_write_into_fp8_is_bit_identical_to_the_pytorch_ops(layout, model_dtype):
    """RotaryEmbedding.rotate, then PagedKVCache.write quantizing by the layer's scales: the same bytes, and
    the same rotated q and k, for a decode step and a prefill (split across threads)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, T = 9, 3, 64, 16
    rope = RotaryEmbedding(d, 4096, 10000.0, None)
    positions = torch.tensor([0, 17, 300, 4095, 1000] + list(range(2000, 2060)))
    n = len(positions)
    qkv = (torch.randn(n, heads + 2 * kv_heads, d, generator=g) * 3).to(model_dtype)
    shape = (20, 3, 2, kv_heads, T, d) if layout == "HND" else (20, 3, 2, T, kv_heads, d)
    expected_pool, pool = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    slots = torch.randperm(20 * T, generator=g)[:n]
    blocks, offsets = slots // T, slots % T
    for rows in (slice(0, 5), slice(5, n)):
        table = rope.table(positions[rows])
        qk = RotaryEmbedding.rotate(qkv[rows, :heads + kv_heads], table)
        md = SimpleNamespace(slot_blocks=blocks[rows], slot_offsets=offsets[rows])
        PagedKVCache(expected_pool, layout, SCALES).write(1, qk[:, heads:], qkv[rows, heads + kv_heads:], md)
        native = cpu.rope_cache_write(qkv[rows].contiguous(), heads, *table, pool, layout, 1, blocks[rows],
                                      offsets[rows], SCALES)
        assert torch.equal(native, qk)
    assert torch.equal(pool.view(torch.uint8), expected_pool.view(torch.uint8))


def _fp8_pool(layout, blocks, kv_heads, T, d, g):
    shape = (blocks, 3, 2, kv_heads, T, d) if layout == "HND" else (blocks, 3, 2, T, kv_heads, d)
    return quantize(torch.randn(shape, generator=g) * 4, 1.0)  # (the scales are applied on reading)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,T,lens", [
    (9, 3, 64, 16, [1, 16, 17, 100, 95, 64, 7, 50, 31, 2, 33, 96, 40, 77, 60, 5]),  # 16 sequences
    (8, 8, 128, 16, [150]),  # one task per head
    (4, 2, 40, 8, [13, 3]),  # a head_dim with no specialised loop
])
def test_paged_decode_on_fp8_equals_the_kernel_on_the_dequantized_pool(layout, dtype, heads, kv_heads, d, T, lens):
    g = torch.Generator().manual_seed(len(lens) + d)
    max_blocks = max(-(-n // T) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    pool = _fp8_pool(layout, num_blocks, kv_heads, T, d, g)
    table = torch.randperm(num_blocks, generator=g)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    ctx, q = torch.tensor(lens), torch.randn(len(lens), heads, d, generator=g).to(dtype)
    cache = PagedKVCache(pool, layout, SCALES)
    for layer in (1, 2):
        # the pool as the PyTorch path reads it: every layer's K and V dequantized to q's dtype
        plain = torch.stack([torch.stack(cache.decode(i, pool[:, i, 0], pool[:, i, 1], dtype), dim=1)
                             for i in range(3)], dim=1)
        for window in (0, 20):
            fp8 = cpu.paged_decode_attention(q, pool, layout, layer, table, ctx, d ** -0.5, window, SCALES)
            ref = cpu.paged_decode_attention(q, plain, layout, layer, table, ctx, d ** -0.5, window)
            assert fp8.dtype == dtype and torch.equal(fp8, ref)


def test_an_fp8_pool_without_its_scales_is_refused():
    pool = torch.zeros(2, 3, 2, 1, 4, 16, dtype=FP8)
    q, table, ctx = torch.randn(1, 1, 16), torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="needs its KV scales"):
        cpu.paged_decode_attention(q, pool, "HND", 0, table, ctx, 0.25)
    with pytest.raises(ValueError, match="needs its KV scales"):
        cpu.paged_decode_attention(q, pool, "HND", 0, table, ctx, 0.25, scales=KVScales.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,ctx,window", [(70, 70, 0), (37, 300, 0), (100, 100, 33)])
def test_flash_prefill_on_fp8_equals_the_kernel_on_the_dequantized_keys(dtype, n, ctx, window):
    """K and V as a prefill reads them from an FP8 cache (strided views of gathered bytes), through the
    layer's tables, against the kernel on the values PyTorch dequantizes them to: the same bits (on an
    AVX512-BF16 CPU, bf16 takes the bf16-pair products)."""
    g = torch.Generator().manual_seed(n)
    heads, kv_heads, d = 6, 2, 64
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    kv = quantize(torch.randn(2, ctx, kv_heads, d, generator=g) * 4, 1.0)  # [K/V, ctx, heads, d]: NHD-like
    k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [kv_heads, ctx, d], strided
    cache = PagedKVCache(torch.zeros(1, 3, 2, 1, 1, d, dtype=FP8), "HND", SCALES)
    table = cache.dequant_table(1, dtype)
    fp8 = cpu.flash_prefill(q, k, v, d ** -0.5, window=window, dequant=table)
    ks, vs = cache.decode(1, k, v, dtype)
    ref = cpu.flash_prefill(q, ks, vs, d ** -0.5, window=window)
    assert fp8 is not None and torch.equal(fp8, ref)
    assert cpu.flash_prefill(q, k, v, d ** -0.5) is None  # FP8 bytes without their tables: not the kernel's

