"""A bf16 GEMM for CPUs where oneDNN takes no bf16 (`layers.onednn_packs`: AVX2 + FMA without AVX-512 BF16
or AVX-NE-CONVERT), in the native kernel library (csrc/gemm_bf16.c): there a bf16 linear's plain weight
otherwise goes through F.linear, PyTorch's own bf16 GEMM, several times slower than its fp32 one. The
kernel widens each tile to fp32 and multiplies with FMAs; the kernel dispatch races it against F.linear on
the model's linears (`cpu.GEMM`), and layers.linear takes it where it won.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import cpu

_bound: set[int] = set()  # ids of the libraries whose gemm_bf16 has its argtypes
# Linears of fewer rows stay on F.linear (layers.linear): the kernel widens all of W whatever the row count
# and pads x to 6-row tiles, which at a decode step's few rows (an LM head) costs more than F.linear's one
# pass over W.
MIN_ROWS = 16


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., in] @ weight [out, in] (plain, contiguous) + bias [out], all bf16 on CPU -> [..., out] bf16,
    the sums fp32 and rounded once, after the bias. None where the kernel does not apply (no library, a
    build without AVX2 + FMA, another dtype or device, a packed or strided weight)."""
    k = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.is_mkldnn or weight.dtype != x.dtype
            or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != weight.shape[:1]
                                      or not bias.is_contiguous()))):
        return None
    lib = cpu.load()
    if lib is None:
        return None
    if id(lib) not in _bound:
        lib.gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        lib.gemm_bf16.restype = ctypes.c_int
        _bound.add(id(lib))
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return None
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    status = lib.gemm_bf16(rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                           out.data_ptr(), m, n, k, rows.stride(0), n, torch.get_num_threads())
    if status == -3:
        raise MemoryError("bf16 GEMM: out of memory for its widened copy of x")
    return out.view(*x.shape[:-1], n) if status == 0 else None
