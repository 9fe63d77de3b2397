"""The native GEMV of batch-1 decode steps (csrc/skinny_linear.c) against float64, against PyTorch's
own bf16 linear as the yardstick, and as the model's linears use it."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu

from pdserve.models import layers

LIB = cpu.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the CPU kernels")

SHAPES = [  # m, n, k
    (1, 1, 1),
    (1, 5, 17),  # a partial tile of w, a masked step of K
    (1, 192, 128),  # a tiny model's qkv
    (1, 960, 576),  # SmolLM2's qkv
    (1, 576, 1536),  # SmolLM2's down projection
    (3, 7, 40),
    (4, 64, 64),
    (6, 33, 100),  # a group of four rows of x and a remainder of two
    (9, 20, 1536),  # fp32: the lane loop
    (16, 960, 576),
    (13, 17, 40),  # the lane loop: a partial tile of w
]


def _inputs(m, n, k, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype) if bias else None


def _exact(x, w, b):
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


def _skip_without_avx512():
    if not cpu.skinny_linear_runs():
        pytest.skip("the kernel library was built without AVX-512 or AVX2 + FMA")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp32_matches_float64(m, n, k, bias):
    _skip_without_avx512()
    x, w, b = _inputs(m, n, k, torch.float32, seed=m * 1000 + n + k, bias=bias)
    out = cpu.skinny_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _exact(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_as_accurate_as_pytorch(m, n, k, as_accurate_as):
    _skip_without_avx512()
    x, w, b = _inputs(m, n, k, torch.bfloat16, seed=m * 1000 + n + k)
    out = cpu.skinny_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    as_accurate_as(out, F.linear(x, w, b), _exact(x, w, b), max_ratio=2.0)


def test_bf16_products_widened_to_fp32(tmp_path, as_accurate_as):
    """The form a CPU with AVX-512 but without AVX512-BF16 compiles: both bf16 halves of a pair widened
    to fp32. Built here with those instructions turned off, and called directly."""
    _skip_without_avx512()
    source = [s for s in cpu.SOURCES if s.name == "skinny_linear.c"]
    lib = ctypes.CDLL(str(cpu.build(source, tmp_path, [*cpu.FLAGS, "-mno-avx512bf16"])))
    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    for m, n, k in [(1, 960, 576), (6, 33, 100)]:
        x, w, b = _inputs(m, n, k, torch.bfloat16, seed=n)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        assert lib.skinny_linear(x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, k, n, 1, 2) == 0
        as_accurate_as(out, F.linear(x, w, b), _exact(x, w, b), max_ratio=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    """Every row is summed in the same order whatever the number of rows: a sequence decoded alone and
    in a batch gets the same bits. (fp32 within 1-8 rows, and within 9-16, which the lane loop takes.)"""
    _skip_without_avx512()
    x, w, b = _inputs(16, 70, 200, dtype, seed=5)
    together = cpu.skinny_linear(x[:8], w, b)
    for i in range(8):
        assert torch.equal(cpu.skinny_linear(x[i:i + 1], w, b), together[i:i + 1])
    assert torch.equal(cpu.skinny_linear(x[2:7], w, b), together[2:7])
    sixteen = cpu.skinny_linear(x, w, b)
    assert torch.equal(cpu.skinny_linear(x[3:12], w, b), sixteen[3:12])
    assert torch.equal(cpu.skinny_linear(x[:13], w, b), sixteen[:13])
    if dtype == torch.bfloat16:
        assert torch.equal(sixteen[:8], together)


def test_strided_rows_and_leading_dims():
    _skip_without_avx512()
    x, w, b = _inputs(3, 24, 64, torch.float32, seed=9)
    wide = torch.zeros(3, 100)
    wide[:, 10:74] = x
    strided = wide[:, 10:74]  # rows 100 apart
    assert torch.equal(cpu.skinny_linear(strided, w, b), cpu.skinny_linear(x, w, b))
    every_other = torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]  # stride 2 along K: copied first
    assert torch.equal(cpu.skinny_linear(every_other, w, b), cpu.skinny_linear(x, w, b))
    out = cpu.skinny_linear(x.view(3, 1, 64), w, b)
    assert out.shape == (3, 1, 24)


def test_refused_inputs_are_left_to_pytorch():
    x, w, b = _inputs(1, 8, 32, torch.float32, seed=1)
    assert cpu.skinny_linear(x.half(), w.half()) is None  # fp16
    assert cpu.skinny_linear(x, w.bfloat16()) is None  # mixed dtypes
    assert cpu.skinny_linear(x, w.T.contiguous().T) is None  # a strided weight
    assert cpu.skinny_linear(x, w, b[:4]) is None  # a bias of the wrong size
    if torch.backends.mkldnn.is_available():
        assert cpu.skinny_linear(x, torch.ops.mkldnn._reorder_linear_weight(w)) is None  # packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sends_a_few_rows_to_the_gemv(dtype):
    """`layers.linear` with a plain `gemv_weight`: in a decode step of SKINNY_ROWS rows the kernel;
    other row counts (more, or 9-11 fp32 rows), or any prefill, the GEMM on the packed weight; both agree
    with F.linear."""
    _skip_without_avx512()
    taken = cpu.SKINNY_ROWS[dtype]
    limit = max(taken)
    x, w, b = _inputs(limit + 1, 48, 64, dtype, seed=2)
    packed = torch.ops.mkldnn._reorder_linear_weight(w) if layers.onednn_packs(dtype) else w  # as pack_for_cpu
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    if dtype == torch.float32:
        assert 8 in taken and 10 not in taken and 12 in taken
        with layers.decode_step(True):
            assert torch.equal(layers.linear(x[:10], packed, b, gemv_weight=w), layers.linear(x[:10], packed, b))
    for rows in sorted({1, 8, limit}):
        with layers.decode_step(True):
            few = layers.linear(x[:rows], packed, b, gemv_weight=w)
        assert torch.equal(few, cpu.skinny_linear(x[:rows], w, b))
        torch.testing.assert_close(few, F.linear(x[:rows], w, b), **tol)
        prefill = layers.linear(x[:rows], packed, b, gemv_weight=w)  # not a decode step: the GEMM
        assert torch.equal(prefill, layers.linear(x[:rows], packed, b))
    with layers.decode_step(True):
        many = layers.linear(x, packed, b, gemv_weight=w)
    assert torch.equal(many, layers.linear(x, packed, b))
    torch.testing.assert_close(many, F.linear(x, w, b), **tol)
