"""RMSNorm, and the residual add before it, on the GPU as one Triton kernel.

layers.RMSNorm's PyTorch form in bf16 is four kernels (a cast to fp32, the norm, a cast back, the weight) and
add_and_norm one more: per layer and step ten launches for what is one pass over a row. This is one
program per row of `hidden` values:

    h = x + residual                      (rounded to x's dtype, as the PyTorch add rounds it)
    n = h * rsqrt(mean(h * h) + eps)      (fp32)
    out = n * weight                      (fp32: in fp32; bf16 and fp16: n rounded to that dtype first, as
                                           RMSNorm.torch_forward casts before the weight)

The sum of squares is reduced in another order than PyTorch's kernel, so the output can differ from it in
the last bit; the CUDA eager and graph steps both take this kernel. Off CUDA it runs in Triton's interpreter
(the CPU suite's check).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_failed: list[str] = []  # why the kernel could not run here (then the PyTorch path, said once)


def _rms_norm_kernel(x_ptr, res_ptr, h_ptr, w_ptr, out_ptr, hidden, eps, ADD: tl.constexpr, CAST: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * hidden
    i = tl.arange(0, BLOCK)
    ok = i < hidden
    h = tl.load(x_ptr + row + i, mask=ok, other=0.0)
    if ADD:
        h = (h.to(tl.float32) + tl.load(res_ptr + row + i, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + row + i, h, mask=ok)
    hf = h.to(tl.float32)
    n = hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    if CAST:  # bf16, fp16: the normalised row is rounded to the weight's dtype before the product
        n = n.to(w.dtype).to(tl.float32)
    tl.store(out_ptr + row + i, (n * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _kernel(interpret: bool):
    if interpret:  # CPU tensors: Triton's interpreter (the CPU suite's check of the kernel)
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_rms_norm_kernel)
    return triton.jit(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [..., hidden] (contiguous), weight [hidden] -> (h, rms_norm(h) * weight) with h = x + residual (x itself
    without one), in x's dtype; None where the kernel does not apply or failed to build or launch here."""
    hidden = weight.numel()
    if (_failed or x.dtype not in _DTYPES or weight.dtype != x.dtype or not x.is_contiguous()
            or x.shape[-1] != hidden or (residual is not None and (residual.shape != x.shape
                                                                   or residual.dtype != x.dtype
                                                                   or not residual.is_contiguous()))):
        return None
    rows = x.numel() // hidden
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return h, out
    block = triton.next_power_of_2(hidden)
    try:
        _kernel(x.device.type == "cpu")[(rows,)](
            x, residual if residual is not None else x, h, weight, out, hidden, eps, ADD=residual is not None,
            CAST=x.dtype != torch.float32, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    except Exception as e:  # a compile or launch failure on this machine: the PyTorch path from now on
        _failed.append(f"{type(e).__name__}: {e}")
        log.warning("the Triton RMSNorm kernel failed; RMSNorm takes the PyTorch path: %s", _failed[0])
        return None
    return h, out
