"""The native CPU kernels against float64 references.

Paged decode attention: each case builds a real pool in the engine's layout, scatters sequences over
random blocks, and compares the kernel with softmax attention computed in float64 from K/V read back
through PagedKVCache.gather. RMSNorm and the RoPE/cache write: against the PyTorch ops they replace.
(The flash prefill attention has its own file.) The kernels are built by the machine's C compiler, as
in production."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu
from pdserve.models.attention import PagedKVCache
from pdserve.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build the CPU kernels")


def _pool(layout, num_blocks, layers, kv_heads, T, d, dtype, g):
    shape = (num_blocks, layers, 2, kv_heads, T, d) if layout == "HND" else (num_blocks, layers, 2, T, kv_heads, d)
    return torch.randn(shape, generator=g).to(dtype)


def _reference(q, cache, layer, table, lens, scale, window=0):
    """float64 softmax attention of q [b, heads, d] over each sequence's first lens[i] tokens (the last
    `window` of them with a sliding window)."""
    out = []
    for i in range(q.shape[0]):
        k, v = cache.gather(layer, table[i], int(lens[i]))  # [kv_heads, len, d]
        if window:
            k, v = k[:, -window:], v[:, -window:]
        group = q.shape[1] // k.shape[0]
        k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
        p = (torch.einsum("hd,hld->hl", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,hld->hd", p, v))
    return torch.stack(out)


def _case(layout, dtype, heads, kv_heads, d, T, lens, layers=3, layer=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // T) for n in lens)
    num_blocks = len(lens) * max_blocks + 5
    pool = _pool(layout, num_blocks, layers, kv_heads, T, d, dtype, g)
    order = torch.randperm(num_blocks, generator=g)
    table = order[: len(lens) * max_blocks].view(len(lens), max_blocks).clone()
    for i, n in enumerate(lens):  # padding past a sequence's last block is 0, as the model runner writes it
        table[i, -(-n // T):] = 0
    q = torch.randn(len(lens), heads, d, generator=g)
    return q, pool, PagedKVCache(pool, layout), table, torch.tensor(lens, dtype=torch.long)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,T,lens", [
    (9, 3, 64, 32, [1, 32, 33, 200, 95, 64, 7, 150, 31, 2, 129, 96, 40, 77, 160, 5]),  # SmolLM2 heads, 16 seqs
    (8, 8, 128, 16, [1000]),  # one long sequence: many online-softmax rescales, one task per head
    (8, 1, 40, 8, [13, 3]),  # MQA and a head_dim with no specialised loop
])
def test_matches_float64_attention(layout, dtype, heads, kv_heads, d, T, lens):
    q, pool, cache, table, ctx = _case(layout, dtype, heads, kv_heads, d, T, lens)
    scale = d ** -0.5
    out = cpu.paged_decode_attention(q, pool, layout, 1, table, ctx, scale)
    assert out is not None and out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _reference(q, cache, 1, table, ctx, scale), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("window", [1, 20, 64, 500])
def test_sliding_window_matches_float64(layout, window):
    """The window starts mid-block, on a block boundary, or covers everything (500)."""
    lens = [1, 19, 20, 21, 64, 65, 200, 333]
    q, pool, cache, table, ctx = _case(layout, torch.float32, 9, 3, 64, 32, lens, seed=window)
    out = cpu.paged_decode_attention(q, pool, layout, 1, table, ctx, 0.125, window)
    torch.testing.assert_close(out.double(), _reference(q, cache, 1, table, ctx, 0.125, window), atol=2e-6,
                               rtol=2e-5)


def test_bf16_queries_come_back_in_bf16():
    q, pool, cache, table, ctx = _case("HND", torch.bfloat16, 6, 2, 64, 32, [50, 70])
    out = cpu.paged_decode_attention(q.bfloat16(), pool, "HND", 1, table, ctx, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _reference(q.bfloat16().float(), cache, 1, table, ctx, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)


def test_bad_block_ids_and_lengths_are_refused_not_read():
    q, pool, _, table, ctx = _case("HND", torch.float32, 4, 2, 64, 32, [40, 10])
    bad = table.clone()
    bad[0, 1] = pool.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="outside the block table"):
        cpu.paged_decode_attention(q, pool, "HND", 0, bad, ctx, 0.125)
    with pytest.raises(IndexError, match="outside the block table"):  # longer than the table holds
        cpu.paged_decode_attention(q, pool, "HND", 0, table, torch.tensor([65, 10]), 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        cpu.paged_decode_attention(q[..., :32], pool, "HND", 0, table, ctx, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (300, 96), (3, 7)])
def test_rms_norm_matches_pytorchs_form(dtype, rows, hidden):
    """Against layers.RMSNorm's PyTorch form (the reference's rounding): fp32 within a few ulps (the
    sum of squares is added in another order), bf16 the same bits except where that ulp crosses a
    rounding boundary."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    if dtype == torch.float32:
        expected = F.rms_norm(x, (hidden,), w, 1e-5)
    else:
        expected = F.rms_norm(x.float(), (hidden,), None, 1e-5).to(dtype) * w
    h, out = cpu.rms_norm(x, w, 1e-5)
    assert h is None and out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=4e-7)
    else:
        torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)  # at most one bf16 ulp apart
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("model_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float16)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_rope_cache_write_is_bit_identical_to_the_pytorch_ops(layout, model_dtype, kv_dtype, prefill):
    """The same bits as RotaryEmbedding.rotate followed by PagedKVCache.write: a decode step of five
    sequences at scattered positions, and a 100-token prefill (split across threads; RoPE's other
    PyTorch form, ROPE_HALVES_MIN_TOKENS)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, T = 9, 3, 64, 16
    rope = RotaryEmbedding(d, 4096, 10000.0, None)
    positions = torch.tensor([0, 17, 300, 4095, 1000] + list(range(2000, 2100)) if prefill
                             else [0, 17, 300, 4095, 1000])
    n = len(positions)
    table = rope.table(positions)
    qkv = (torch.randn(n, heads + 2 * kv_heads, d, generator=g) * 2).to(model_dtype)
    shape = (20, 4, 2, kv_heads, T, d) if layout == "HND" else (20, 4, 2, T, kv_heads, d)
    expected_pool, pool = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    slots = torch.randperm(20 * T, generator=g)[:n]  # distinct slots in scattered blocks
    blocks, offsets = slots // T, slots % T
    md = SimpleNamespace(slot_blocks=blocks, slot_offsets=offsets)

    qk = RotaryEmbedding.rotate(qkv[:, :heads + kv_heads], table)
    PagedKVCache(expected_pool, layout).write(2, qk[:, heads:], qkv[:, heads + kv_heads:], md)
    native = cpu.rope_cache_write(qkv, heads, *table, pool, layout, 2, blocks, offsets)

    assert native.dtype == model_dtype and torch.equal(native, qk)
    assert torch.equal(pool, expected_pool)  # the slots written, and nothing else


def test_rope_cache_write_refuses_a_slot_outside_the_pool():
    pool, qkv = torch.zeros(2, 1, 2, 1, 4, 8), torch.zeros(1, 3, 8)
    cos = torch.ones(1, 8)
    for block, offset in ((2, 0), (-1, 0), (0, 4)):
        with pytest.raises(IndexError, match="outside the pool"):
            cpu.rope_cache_write(qkv, 1, cos, cos, pool, "HND", 0, torch.tensor([block]),
                                 torch.tensor([offset]))
    assert not pool.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_after_a_residual_add_matches_the_two_steps(dtype):
    g = torch.Generator().manual_seed(5)
    x, y = ((torch.randn(9, 576, generator=g) * 3).to(dtype) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    h, out = cpu.rms_norm(y, w, 1e-6, residual=x)
    assert torch.equal(h, x + y)  # the sum rounded as PyTorch rounds it
    assert torch.equal(out, cpu.rms_norm(x + y, w, 1e-6)[1])


def test_rms_norm_leaves_mismatched_shapes_to_pytorch():
    x = torch.randn(2, 8)
    assert cpu.rms_norm(x, torch.ones(4), 1e-6) is None  # never reads past the weight
    assert cpu.rms_norm(x, torch.ones(8), 1e-6, residual=torch.randn(1, 8)) is None


def test_build_is_cached_and_a_compiler_error_is_reported(tmp_path):
    first = cpu.build(cache_dir=tmp_path)
    assert cpu.build(cache_dir=tmp_path) == first and first.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temporary left behind
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {\n")
    with pytest.raises(cpu.KernelBuildError, match="broken.c"):
        cpu.build([broken], cache_dir=tmp_path)


def test_loading_the_kernels_keeps_the_processs_floating_point_environment(tmp_path):
    """Linked with -ffast-math, the library's crtfastmath.o turned on flush-to-zero and denormals-are-
    zero for whoever loaded it: every subnormal in the process became 0 (hypothesis refused to run)."""
    probe = (
        "import sys, ctypes\n"
        "from pdserve.kernels import cpu\n"
        f"ctypes.CDLL(str(cpu.build(cache_dir=__import__('pathlib').Path({str(tmp_path)!r}))))\n"
        "tiny = sys.float_info.min / 4\n"
        "print(tiny * 1.0 > 0.0, float(__import__('torch').tensor([1e-40]) * 1) > 0.0)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_the_kernel_shares_pytorchs_openmp_runtime():
    """Two OpenMP runtimes in one process would each keep spinning threads on the same two cores."""
    cpu.load()
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_disabled_by_environment_falls_back_to_pytorch(tmp_path):
    code = textwrap.dedent("""
        import torch
        from pdserve.kernels import cpu
        q, pool = torch.randn(1, 2, 8), torch.randn(2, 1, 2, 2, 4, 8)
        out = cpu.paged_decode_attention(q, pool, "HND", 0, torch.zeros(1, 1, dtype=torch.long),
                                                 torch.tensor([3]), 1.0)
        print("fallback" if out is None else "kernel")
    """)
    env = dict(os.environ, PDSERVE_CPU_KERNELS="0", PDSERVE_KERNEL_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fallback"
    assert not list(tmp_path.iterdir())  # nothing was built
