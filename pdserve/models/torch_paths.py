"""The PyTorch path each native kernel replaces, as the kernel dispatch (kernels/dispatch.py) races it: the
models hand these in, so the dispatch knows no model. `choose_paths` runs the races for a model: it finds
the layers they are timed on and drops the GEMV's plain weight copies where the GEMM won."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu, dispatch
from pdserve.models.attention import (AttentionMetadata, PagedKVCache, _sdpa_decode, _tiled_causal_attention,
                                      _use_tiled)
from pdserve.models.layers import _LINEARS, RMSNorm, RotaryEmbedding, linear, onednn_packs

log = logging.getLogger(__name__)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    """The path attention.paged_attention takes for a whole prompt without the flash kernel: at
    TILED_MIN_TOKENS tokens or more the tiled oneDNN path, else (or where torch has no oneDNN) SDPA."""
    qs, tiled = q.transpose(0, 1).unsqueeze(0), _use_tiled(q, q.shape[0])

    def run() -> torch.Tensor:
        if tiled:
            return _tiled_causal_attention(q, k, v, scale)
        return F.scaled_dot_product_attention(qs, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
    return run


def paged_decode(pool: torch.Tensor, cases: list, scale: float) -> Callable[[], None]:
    """The gather and SDPA attention.paged_attention runs for decode rows without the native kernel."""
    cache, empty = PagedKVCache(pool, "HND"), torch.zeros(0, dtype=torch.int64)
    steps = [(q, AttentionMetadata(empty, empty, [], torch.arange(q.shape[0]), table, lens, cache.tokens_per_block,
                                   decode_only=True)) for q, table, lens in cases]

    def run() -> None:
        for q, md in steps:
            _sdpa_decode(q, 0, cache, md, scale, 0)
    return run


def rope_cache(pool: torch.Tensor, heads: int, cases: list) -> Callable[[], None]:
    """RotaryEmbedding.rotate and PagedKVCache.write: attention.rotate_and_cache without the native kernel."""
    cache, kv_heads = PagedKVCache(pool, "HND"), pool.shape[3]
    empty, no_table = torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)
    steps = [(qkv, table, AttentionMetadata(slot_blocks, slot_offsets, [], empty, no_table, empty,
                                            cache.tokens_per_block))
             for qkv, table, slot_blocks, slot_offsets in cases]

    def run() -> None:
        for qkv, table, md in steps:
            qk = RotaryEmbedding.rotate(qkv[:, :heads + kv_heads], table)
            cache.write(0, qk[:, heads:], qkv[:, heads + kv_heads:], md)
    return run


def rms_norm(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """layers.RMSNorm's PyTorch form."""
    norm = RMSNorm(weight.shape[0], eps, weight.dtype)
    norm.weight.copy_(weight)
    return norm.torch_forward


REFERENCES = dispatch.References(causal_attention=causal_attention, paged_decode=paged_decode,
                                 rope_cache=rope_cache, rms_norm=rms_norm, linear=linear)


def choose_paths(model: torch.nn.Module, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 cache: Path | None = None, kv_dtype: torch.dtype | None = None) -> dict[str, bool]:
    """dispatch.choose_paths for `model` (kernel -> native): `heads`, `kv_heads`: this rank's query and KV
    heads (heads 0: a model that runs no paged attention kernel; only its GEMV and RMSNorm are raced);
    `kv_dtype`: the KV pool's, where it is not `dtype`. Call after `layers.pack_for_cpu`."""
    norm = next((m for m in model.modules() if isinstance(m, RMSNorm)), None)
    chosen = dispatch.choose_paths(
        REFERENCES, dtype, heads, kv_heads, head_dim, hidden=None if norm is None else norm.weight.shape[0],
        gemm_linears=[] if onednn_packs(dtype) else _first_linears(model), gemv_linears=_first_gemv_linears(model),
        cache=cache, kv_dtype=kv_dtype)
    if chosen.get(cpu.GEMV) is False:
        _drop_gemv_weights(model)
    return chosen


def _first_linears(model: torch.nn.Module) -> list:
    """The linears, one per weight shape, in model order."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, _LINEARS) and isinstance(m.weight, torch.Tensor) and tuple(m.weight.shape) not in seen:
            seen.add(tuple(m.weight.shape))
            out.append(m)
    return out


def _first_gemv_linears(model: torch.nn.Module) -> list:
    """The linears with a plain `gemv_weight`, one per weight shape, in model order (a layer's set)."""
    seen, out = set(), []
    for m in model.modules():
        w = getattr(m, "gemv_weight", None)
        if isinstance(w, torch.Tensor) and tuple(w.shape) not in seen:
            seen.add(tuple(w.shape))
            out.append(m)
    return out


def _drop_gemv_weights(model: torch.nn.Module) -> None:
    """The GEMV lost: its plain weight copies go (where the layer keeps a packed one), and with them the
    GEMV and the one-call C decode step, which both need them."""
    freed = 0
    for m in model.modules():
        w = getattr(m, "gemv_weight", None)
        if isinstance(w, torch.Tensor):
            if m.weight is not None and m.weight.is_mkldnn:
                freed += w.numel() * w.element_size()
            m.gemv_weight = None
    if freed:
        log.info("kernel dispatch: the GEMM beats the GEMV here; its plain weight copies dropped (%.0f MB)",
                 freed / 1e6)
