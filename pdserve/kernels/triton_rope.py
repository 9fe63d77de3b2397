"""RoPE on q and k and the K/V cache write on the GPU as one Triton kernel.

The PyTorch form of a layer's rotate_and_cache (RotaryEmbedding.rotate + PagedKVCache.write) is about
ten kernels: casts, two products, a flip, a sum, a cast back, a stack and an indexed write. This is one
program per (token, q or k head):

    qk[n, h] = x1 * cos1 + x2 * ssin1 | x2 * cos2 + x1 * ssin2     (x = qkv[n, h] = x1 | x2, halves; fp32)
    h >= heads (a K head): pool[slot_blocks[n], layer, 0, kv_head, slot_offsets[n]] = qk[n, h]  (HND; NHD alike)
                           pool[..., 1, ...] = qkv[n, heads + kv_heads + kv_head]                 (its V head)

Each product and the sum are rounded as the PyTorch ops round them (fp32, no fused multiply-add:
enable_fp_fusion=False), and the results are cast as they are (to q's dtype, then the pool's), so the
kernel writes the PyTorch form's bits. Not for an FP8 pool (its writes quantize by scales: the
PyTorch path). Off CUDA it runs in Triton's interpreter (the CPU suite's check).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
_failed: list[str] = []  # why the kernel could not run here (then the PyTorch path, said once)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, qk_ptr, pool_ptr, blocks_ptr, offsets_ptr, heads, kv_heads,
                       stride_xn, stride_xh, stride_cn, stride_blk, stride_kv, stride_head, stride_tok,
                       HALF: tl.constexpr, H_PAD: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, H_PAD)
    ok = i < HALF
    x = qkv_ptr + n * stride_xn + h * stride_xh
    x1 = tl.load(x + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + i, mask=ok, other=0.0).to(tl.float32)
    c = cos_ptr + n * stride_cn
    s = sin_ptr + n * stride_cn
    o1 = x1 * tl.load(c + i, mask=ok, other=0.0) + x2 * tl.load(s + i, mask=ok, other=0.0)
    o2 = x2 * tl.load(c + HALF + i, mask=ok, other=0.0) + x1 * tl.load(s + HALF + i, mask=ok, other=0.0)
    o1 = o1.to(qk_ptr.dtype.element_ty)
    o2 = o2.to(qk_ptr.dtype.element_ty)
    out = qk_ptr + (n * (heads + kv_heads) + h) * (2 * HALF)
    tl.store(out + i, o1, mask=ok)
    tl.store(out + HALF + i, o2, mask=ok)
    if h >= heads:  # a K head: it and its V head go to the token's cache slot
        kv_head = h - heads
        block = tl.load(blocks_ptr + n)
        slot = block * stride_blk + kv_head * stride_head + tl.load(offsets_ptr + n) * stride_tok
        kind = pool_ptr.dtype.element_ty
        tl.store(pool_ptr + slot + i, o1.to(kind), mask=ok)
        tl.store(pool_ptr + slot + HALF + i, o2.to(kind), mask=ok)
        v = qkv_ptr + n * stride_xn + (heads + kv_heads + kv_head) * stride_xh
        tl.store(pool_ptr + stride_kv + slot + i, tl.load(v + i, mask=ok).to(kind), mask=ok)
        tl.store(pool_ptr + stride_kv + slot + HALF + i, tl.load(v + HALF + i, mask=ok).to(kind), mask=ok)


@functools.cache
def _kernel(interpret: bool):
    if interpret:  # CPU tensors: Triton's interpreter (the CPU suite's check of the kernel)
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_rope_cache_kernel)
    return triton.jit(_rope_cache_kernel)


def rope_cache_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor, pool: torch.Tensor,
                     layout: str, layer: int, slot_blocks: torch.Tensor,
                     slot_offsets: torch.Tensor) -> torch.Tensor | None:
    """qkv [n, heads + 2 * kv_heads, d] (d contiguous); cos, signed_sin [n, 1, d] fp32 (RotaryEmbedding.table);
    slot_blocks, slot_offsets [n] int64 -> the rotated q and k, [n, heads + kv_heads, d] in qkv's dtype, with
    K and V written to the pool; None where the kernel does not apply (an FP8 pool, other dtypes or strides) or
    failed to build or launch here (logged once)."""
    n, width, d = qkv.shape
    kv_heads = (width - heads) // 2
    if (_failed or pool.dtype not in _DTYPES or qkv.dtype not in _DTYPES or qkv.stride(2) != 1 or pool.stride(-1) != 1
            or d % 2 or cos.dtype != torch.float32 or cos.stride(-1) != 1 or signed_sin.stride() != cos.stride()
            or slot_blocks.stride(0) != 1 or slot_offsets.stride(0) != 1):
        return None
    qk = torch.empty(n, heads + kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return qk
    layer_pool = pool[:, layer]  # [NB, 2, H, T, D] (HND) or [NB, 2, T, H, D] (NHD)
    s_head, s_tok = (layer_pool.stride(2), layer_pool.stride(3)) if layout == "HND" else (
        layer_pool.stride(3), layer_pool.stride(2))
    try:
        _kernel(qkv.device.type == "cpu")[(n, heads + kv_heads)](
            qkv, cos, signed_sin, qk, layer_pool, slot_blocks, slot_offsets, heads, kv_heads, qkv.stride(0),
            qkv.stride(1), cos.stride(0), layer_pool.stride(0), layer_pool.stride(1), s_head, s_tok,
            HALF=d // 2, H_PAD=triton.next_power_of_2(d // 2), enable_fp_fusion=False)
    except Exception as e:  # a compile or launch failure on this machine: the PyTorch path from now on
        _failed.append(f"{type(e).__name__}: {e}")
        log.warning("the Triton RoPE + cache write kernel failed; it takes the PyTorch path: %s", _failed[0])
        return None
    return qk
