"""The bf16 GEMM for CPUs where oneDNN takes no bf16 (kernels/gemm.py, csrc/gemm_bf16.c), against float64
and against F.linear's own error. Its AVX2 + FMA code is in every x86-64 build of the library, so it runs
here whatever this machine has; on an AVX2-only machine layers.linear sends every bf16 linear of more rows
than the GEMV's to it (the AVX2 child run, tests/test_cpu_without_avx512.py, serves bf16 through it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu, gemm

from pdserve.models import layers

pytestmark = pytest.mark.skipif(gemm.gemm_bf16(torch.ones(1, 4).bfloat16(), torch.ones(2, 4).bfloat16()) is None,
                                reason="no native kernels with AVX2 + FMA")


@pytest.mark.parametrize("m,n,k", [(1, 5, 7), (7, 33, 100), (130, 96, 576), (6, 16, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_as_accurate_as_f_linear(m, n, k, with_bias):
    """Row and column counts off the tile sizes (6 x 16), with and without a bias, x a strided view: within
    F.linear's own error of the float64 product, and the fp32 sums rounded once (the rounding of the fp32
    product's result, but for sums that land on a bf16 rounding boundary in another order)."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, 3:]  # rows k + 3 apart
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    out = gemm.gemm_bf16(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    theirs = F.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert (out.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()
    fp32 = (x.float() @ w.float().T + (b.float() if with_bias else 0)).bfloat16()
    assert (out != fp32).float().mean() < 0.01


def test_batched_input_and_what_it_does_not_take():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 32, generator=g).bfloat16(), torch.randn(8, 32, generator=g).bfloat16()
    assert torch.equal(gemm.gemm_bf16(x, w), gemm.gemm_bf16(x.reshape(6, 32), w).view(2, 3, 8))
    assert gemm.gemm_bf16(x.float(), w.float()) is None  # bf16 only
    assert gemm.gemm_bf16(x, w.T.contiguous().T) is None  # a strided weight
    assert gemm.gemm_bf16(torch.zeros(0, 32).bfloat16(), w) is None  # nothing to multiply: F.linear's


def test_a_linear_takes_it_only_where_onednn_takes_no_bf16_and_the_dispatch_chose_it(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(24, 64, generator=g).bfloat16()
    calls, real = [], gemm.gemm_bf16
    monkeypatch.setattr(gemm, "gemm_bf16", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(layers, "_onednn_bf16", lambda: False)  # as on an AVX2-only CPU
    assert torch.equal(layers.linear(x, w), real(x, w)) and len(calls) == 1
    assert torch.equal(layers.linear(x.float(), w.float()), F.linear(x.float(), w.float())) and len(calls) == 1
    few = x[:gemm.MIN_ROWS - 1]  # a decode step's rows (an LM head's): F.linear is the faster there
    assert torch.equal(layers.linear(few, w), F.linear(few, w)) and len(calls) == 1
    cpu.set_native(cpu.GEMM, torch.bfloat16, False)  # the dispatch chose F.linear
    try:
        assert torch.equal(layers.linear(x, w), F.linear(x, w)) and len(calls) == 1
    finally:
        cpu.reset_paths()
    monkeypatch.setattr(layers, "_onednn_bf16", lambda: True)  # oneDNN's bf16 (on a plain weight: F.linear)
    assert torch.equal(layers.linear(x, w), F.linear(x, w)) and len(calls) == 1
