"""Paged decode attention on the GPU as one Triton kernel, reading K and V straight from the pool.

The PyTorch decode path gathers every sequence's blocks of a layer into a contiguous copy and runs
SDPA over it under a mask (attention._sdpa_decode): a copy of the whole batch's KV per layer per
step, and a mask as wide as the longest table. This kernel instead walks each sequence's block
table: one program per (sequence, query head) runs an online softmax over that sequence's keys,
KEYS keys an iteration, each key row looked up through the table (so any tokens_per_block works,
and the table's width costs nothing: only `context_lens` keys are read).

    program (b, h):  q[b, h]  ·  K[table[b, pos // T], layer, 0, h // group, pos % T]   pos < len[b]
                     (HND: pool[block, layer, k|v, head, token, d]; NHD: [block, layer, k|v, token, head, d])

Scores, softmax and the weighted sum are fp32 whatever the pool's dtype (fp32, bf16, fp16; an FP8
pool takes the PyTorch path); the output is q's dtype. With a sliding window a query sees its last
`window` keys. Off CUDA the same kernel runs in Triton's interpreter (numpy, slow): that is how the
CPU suite checks it against the PyTorch path.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_failed: list[str] = []  # why the kernel could not run here (then the PyTorch path, said once)


def _paged_decode_kernel(q_ptr, pool_ptr, table_ptr, lens_ptr, out_ptr, scale, tokens_per_block,
                         stride_qb, stride_qh, stride_blk, stride_kv, stride_head, stride_tok, stride_tb,
                         group: tl.constexpr, head_dim: tl.constexpr, D_PAD: tl.constexpr, KEYS: tl.constexpr,
                         WINDOW: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(length - WINDOW, 0)
    kv_head = h // group
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    start = first
    while start < length:  # (a while loop: Triton 3.6's interpreter cannot take a range over loaded bounds)
        pos = start + tl.arange(0, KEYS)
        ok = pos < length
        block = tl.load(table_ptr + b * stride_tb + pos // tokens_per_block, mask=ok, other=0)
        row = block.to(tl.int64) * stride_blk + kv_head * stride_head + (pos % tokens_per_block) * stride_tok
        at = row[:, None] + d[None, :]
        both = ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + at, mask=both, other=0.0).to(tl.float32)  # [KEYS, D_PAD]
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(pool_ptr + stride_kv + at, mask=both, other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
        start += KEYS
    out = acc / total
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.cache
def _kernel(interpret: bool):
    if interpret:  # CPU tensors: Triton's interpreter (the CPU suite's check of the kernel)
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_paged_decode_kernel)
    return triton.jit(_paged_decode_kernel)


def paged_decode(q: torch.Tensor, pool: torch.Tensor, layout: str, layer: int, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor | None:
    """q: [b, heads, d] (d contiguous), pool: the rank's KV pool (attention.PagedKVCache's layout),
    block_table: [b, max_blocks] int64, context_lens: [b] int64 (each >= 1) -> [b, heads, d] in q's
    dtype; None where the kernel does not apply (an FP8 pool, a strided head_dim) or failed to build or launch
    here (logged once)."""
    if _failed or pool.dtype not in _POOL_DTYPES or pool.stride(-1) != 1 or q.stride(-1) != 1:
        return None
    b, heads, d = q.shape
    kv_heads = pool.shape[3] if layout == "HND" else pool.shape[4]
    if heads % kv_heads or d != pool.shape[-1]:
        raise ValueError(f"paged decode: {heads} query heads of {d} over a pool of {kv_heads} heads of "
                         f"{pool.shape[-1]}")
    out = torch.empty(b, heads, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    layer_pool = pool[:, layer]  # [NB, 2, H, T, D] (HND) or [NB, 2, T, H, D] (NHD)
    s_head, s_tok = (layer_pool.stride(2), layer_pool.stride(3)) if layout == "HND" else (
        layer_pool.stride(3), layer_pool.stride(2))
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    d_pad = triton.next_power_of_2(d)
    try:
        _kernel(q.device.type == "cpu")[(b, heads)](
            q, layer_pool, table, context_lens, out, scale, pool.shape[4] if layout == "HND" else pool.shape[3],
            q.stride(0), q.stride(1), layer_pool.stride(0), layer_pool.stride(1), s_head, s_tok, table.stride(0),
            group=heads // kv_heads, head_dim=d, D_PAD=d_pad, KEYS=64 if d_pad <= 64 else 32, WINDOW=window)
    except Exception as e:  # a compile or launch failure on this machine: the PyTorch path from now on
        _failed.append(f"{type(e).__name__}: {e}")
        log.warning("the Triton decode attention kernel failed; decode attention takes the PyTorch path: %s",
                    _failed[0])
        return None
    return out
