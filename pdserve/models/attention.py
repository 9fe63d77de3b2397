"""Paged attention in plain PyTorch.

The KV pool of one rank is a single block-major tensor:

    HND: pool[num_blocks, num_layers, 2, kv_heads, tokens_per_block, head_dim]
    NHD: pool[num_blocks, num_layers, 2, tokens_per_block, kv_heads, head_dim]

(index 0 of the third dimension is K, 1 is V). One block therefore holds every local layer's K and V
contiguously, which lets the KV exchange move a block with one descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqSlice:
    """One sequence's share of a forward batch."""

    q_start: int  # first row of this sequence in the flattened token batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the KV cache after this step (cached prefix + q_len)
    block_ids: torch.Tensor  # [ceil(ctx_len / tokens_per_block)] int64


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [n_tokens] block id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [n_tokens] position inside that block
    prefills: list[SeqSlice]  # sequences with q_len > 1 (or whose q_len == ctx_len)
    decode_rows: torch.Tensor  # [n_decode] row of each single-token sequence in the batch
    decode_blocks: torch.Tensor  # [n_decode, max_blocks] block table, padded with 0
    decode_mask: torch.Tensor  # [n_decode, 1, 1, max_blocks * tokens_per_block] True = attend


class PagedKVCache:
    """A view of one rank's pool that reads and writes one layer's K/V by block and offset."""

    def __init__(self, pool: torch.Tensor, layout: str):
        if layout not in ("HND", "NHD"):
            raise ValueError(f"kv layout must be 'HND' or 'NHD', got {layout!r}")
        self.pool = pool
        self.layout = layout
        self.tokens_per_block = pool.shape[4] if layout == "HND" else pool.shape[3]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        """k, v: [n_tokens, kv_heads, head_dim]."""
        kv = torch.stack([k, v], dim=1).to(self.pool.dtype)  # [n, 2, H, D]
        blocks, offs = md.slot_blocks, md.slot_offsets
        if self.layout == "HND":
            # pool[b, layer, :, :, off] is [2, H, D]
            self.pool[blocks, layer, :, :, offs] = kv
        else:
            self.pool[blocks, layer, :, offs] = kv

    def gather(self, layer: int, block_ids: torch.Tensor, length: int | None = None):
        """block_ids: [..., nb] -> K, V as [..., kv_heads, nb * tokens_per_block, head_dim]."""
        kv = self.pool[:, layer][block_ids]  # [..., nb, 2, H, T, D] or [..., nb, 2, T, H, D]
        nb = block_ids.shape[-1]
        if self.layout == "HND":
            kv = kv.movedim(-5, -3)  # [..., 2, H, nb, T, D]
            kv = kv.reshape(*kv.shape[:-3], nb * self.tokens_per_block, kv.shape[-1])
        else:
            kv = kv.movedim(-5, -4)  # [..., 2, nb, T, H, D]
            kv = kv.reshape(*kv.shape[:-4], nb * self.tokens_per_block, *kv.shape[-2:])
            kv = kv.transpose(-3, -2)  # [..., 2, H, nb*T, D]
        k, v = kv.select(-4, 0), kv.select(-4, 1)
        if length is not None:
            k, v = k[..., :length, :], v[..., :length, :]
        return k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [n, heads, d]; k, v: [n, kv_heads, d] for the new tokens. Returns [n, heads * d]."""
    cache.write(layer, k, v, md)
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    # SDPA gets 4-D [1, heads, len, d] inputs: with 3-D ones PyTorch's CPU backend falls back to the
    # math kernel and materialises the whole [heads, len, len] score matrix (6x slower at 2048 tokens).
    for s in md.prefills:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        if s.q_len == s.ctx_len:
            # Nothing cached before this chunk: attend to the fresh K/V, rounded through the cache
            # dtype so the result matches what a later step reads back.
            rows = slice(s.q_start, s.q_start + s.q_len)
            ks = k[rows].to(cache.pool.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, d]
            vs = v[rows].to(cache.pool.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks, vs = cache.gather(layer, s.block_ids, s.ctx_len)  # [kv_heads, ctx_len, d]
            ks, vs = ks.to(q.dtype).unsqueeze(0), vs.to(q.dtype).unsqueeze(0)
            # Query i sits at absolute position ctx_len - q_len + i and sees keys up to it.
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device).unsqueeze(1)
            mask = torch.arange(s.ctx_len, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s.q_start:s.q_start + s.q_len] = o[0].transpose(0, 1)
    if md.decode_rows.numel():
        # One query per sequence: fold the query heads of a KV group into the "query length" axis so
        # a single batched SDPA covers every decode sequence without repeating K/V.
        qd = q[md.decode_rows].view(-1, kv_heads, group, d)  # [b, kv_heads, group, d]
        kd, vd = cache.gather(layer, md.decode_blocks)  # [b, kv_heads, L, d]
        o = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=md.decode_mask,
                                           scale=scale)
        out[md.decode_rows] = o.reshape(-1, heads, d)
    return out.view(n, heads * d)
