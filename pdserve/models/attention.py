"""Paged attention in plain PyTorch.

The KV pool of one rank is a single block-major tensor:

    HND: pool[num_blocks, num_layers, 2, kv_heads, tokens_per_block, head_dim]
    NHD: pool[num_blocks, num_layers, 2, tokens_per_block, kv_heads, head_dim]

(index 0 of the third dimension is K, 1 is V). One block therefore holds every local layer's K and V
contiguously, which lets the KV exchange move a block with one descriptor.

Prefills on CPU do not use SDPA, whose CPU flash kernel runs its tiles on the generic BLAS. The
native kernel `cpu.flash_prefill` takes them (`benchmarks/bench_cpu_paths.py` times it against
the PyTorch path on a model's shapes). Without the native kernels, prefills of TILED_MIN_TOKENS or more take
`_tiled_causal_attention`, exact softmax attention tile by tile with oneDNN's GEMMs, and shorter
ones SDPA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu
from pdserve.kernels.kv_quant import KVScales, dequant_tables, dequantize, is_quantized, quantize
from pdserve.models.layers import RotaryEmbedding, onednn_linear


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
    decode_lens: torch.Tensor  # [n_decode] int64 tokens each decode sequence attends to
    tokens_per_block: int
    decode_only: bool = False  # every row is a decode row, in order (skips the row gather/scatter)
    states: list = field(default_factory=list)  # hybrid models: recurrent_state.StateSlice per sequence, in row order

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[n_decode, 1, 1, max_blocks * tokens_per_block], True = attend: what the PyTorch decode path
        (gather + SDPA) needs; built on first use, once per step."""
        span = self.decode_blocks.shape[1] * self.tokens_per_block
        keys = torch.arange(span, device=self.decode_lens.device)
        return (keys.unsqueeze(0) < self.decode_lens.unsqueeze(1))[:, None, None, :]


# Without the native kernels, a prefill of at least this many tokens takes the tiled oneDNN path on CPU;
# below it, one SDPA call is as fast and costs fewer dispatches.
TILED_MIN_TOKENS = 512
_TILE = 256  # query rows per tile (times the query heads of one KV group); prefills run faster than with 128


def _use_tiled(q: torch.Tensor, q_len: int) -> bool:
    return q_len >= TILED_MIN_TOKENS and q.device.type == "cpu" and torch.backends.mkldnn.is_available()


def _tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact causal softmax attention, one query tile and one KV head at a time.

    q: [n, heads, d] for the last n positions; k, v: [kv_heads, ctx, d] for positions 0..ctx-1, so query
    i sits at position ctx - n + i. Returns [n, heads, d] in q's dtype. Each tile multiplies the query
    heads of one KV group (folded into rows) by the keys it can see, masks only the diagonal square,
    and takes a full-row softmax: no running max, so the result is the plain formula's.

    Scores and softmax are fp32. For bf16 inputs the probabilities are then rounded to bf16 and
    multiplied by bf16 V with fp32 accumulation, as PyTorch's own bf16 flash attention does (oneDNN's
    bf16 GEMMs outrun its fp32 ones on AVX512-BF16 CPUs); otherwise the P @ V product is fp32 too.
    """
    n, heads, d = q.shape
    kv_heads, ctx, _ = k.shape
    group, past = heads // kv_heads, ctx - n
    pv_dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    qh = (q.float() * scale).view(n, kv_heads, group, d).transpose(0, 1).contiguous()  # [kv_heads, n, group, d]
    kh = k.float().contiguous()
    # The P @ V product. fp32: oneDNN's linear, whose weight rows must be contiguous, on V transposed
    # (a [d, keys] copy per tile) beats MKL's mm on V as it lies. bf16: mm, which runs on oneDNN for
    # bf16, needs no copy and is the faster.
    if pv_dtype == torch.float32:
        vt = v.float().transpose(1, 2).contiguous()  # [kv_heads, d, ctx]

        def pv(probs, h, keys):
            return onednn_linear(probs, vt[h, :, :keys].contiguous())
    else:
        vs = v.to(pv_dtype).contiguous()  # [kv_heads, ctx, d]

        def pv(probs, h, keys):
            return torch.mm(probs, vs[h, :keys])
    out = torch.empty(n, kv_heads, group, d, dtype=pv_dtype)
    for start in range(0, n, _TILE):
        rows = min(_TILE, n - start)
        keys = past + start + rows  # the last query of the tile sees this many keys
        for h in range(kv_heads):
            scores = onednn_linear(qh[h, start:start + rows].view(rows * group, d), kh[h, :keys])
            probs = _masked_softmax(scores.view(rows, group, keys)).to(pv_dtype)
            out[start:start + rows, h] = pv(probs.view(rows * group, keys), h, keys).view(rows, group, d)
    return out.view(n, heads, d).to(q.dtype)


def _masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of one tile's scores [rows, group, keys] under the causal mask: query row i sees keys
    [0, keys - rows + i]."""
    rows, keys = scores.shape[0], scores.shape[2]
    # -inf above the diagonal, 0 elsewhere: an add on the strided diagonal square is cheaper than a
    # masked_fill with a broadcast boolean mask, and gives the same scores.
    above = torch.full((rows, rows), float("-inf")).triu_(1).unsqueeze(1)  # [rows, 1, rows]
    scores[:, :, keys - rows:].add_(above)
    return scores.softmax(-1)


class PagedKVCache:
    """A view of one rank's pool that reads and writes one layer's K/V by block and offset."""

    def __init__(self, pool: torch.Tensor, layout: str, scales: KVScales | None = None):
        if layout not in ("HND", "NHD"):
            raise ValueError(f"kv layout must be 'HND' or 'NHD', got {layout!r}")
        self.pool = pool
        self.layout = layout
        self.tokens_per_block = pool.shape[4] if layout == "HND" else pool.shape[3]
        # An FP8 pool (kv_quant.py) stores x / scale saturated; the native kernels read it through
        # dequant_table's values, which are the PyTorch path's.
        self.quantized = is_quantized(pool.dtype)
        self.scales = (scales or KVScales.ones(pool.shape[1])) if self.quantized else None
        if self.scales is not None and len(self.scales.k) != pool.shape[1]:
            raise ValueError(f"{len(self.scales.k)} KV scales for a pool of {pool.shape[1]} layers")

    @cached_property
    def _dequant_tables(self) -> torch.Tensor:
        return dequant_tables(self.scales)

    def dequant_table(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """An FP8 pool's [2, 256] fp32 table of what each byte of the layer's K and V reads back as in
        `dtype` (fp32 or bf16): what the native kernels read the pool through."""
        return self._dequant_tables[layer, int(dtype == torch.bfloat16)]

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v: [n, kv_heads, head_dim] -> [n, 2, kv_heads, head_dim] as the pool stores them."""
        if self.quantized:
            return torch.stack([quantize(k, self.scales.k[layer]), quantize(v, self.scales.v[layer])], dim=1)
        return torch.stack([k, v], dim=1).to(self.pool.dtype)

    def decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        """Stored k, v (any shape) -> their values in `dtype`."""
        if self.quantized:
            return dequantize(k, self.scales.k[layer], dtype), dequantize(v, self.scales.v[layer], dtype)
        return k.to(dtype), v.to(dtype)

    def encode_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """An MLA pool's one part: latents [n, latent_dim] as the pool stores them (FP8: by the layer's K scale)."""
        return quantize(latent, self.scales.k[layer]) if self.quantized else latent.to(self.pool.dtype)

    def decode_latent(self, layer: int, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored latents (any shape) -> their values in `dtype`."""
        return dequantize(stored, self.scales.k[layer], dtype) if self.quantized else stored.to(dtype)

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        """What a later read of fresh k, v returns: rounded through the pool's dtype (and scales)."""
        if not self.quantized:  # no stack: for an fp32 pool and fp32 q these are k and v themselves
            return k.to(self.pool.dtype).to(dtype), v.to(self.pool.dtype).to(dtype)
        kv = self.encode(layer, k, v)
        return self.decode(layer, kv[:, 0], kv[:, 1], dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        """k, v: [n_tokens, kv_heads, head_dim]."""
        kv = self.encode(layer, k, v)  # [n, 2, H, D]
        blocks, offs = md.slot_blocks, md.slot_offsets
        if self.layout == "HND":
            # pool[b, layer, :, :, off] is [2, H, D]
            self.pool[blocks, layer, :, :, offs] = kv
        else:
            self.pool[blocks, layer, :, offs] = kv

    def gather(self, layer: int, block_ids: torch.Tensor, length: int | None = None, dtype: torch.dtype | None = None):
        """block_ids: [..., nb] -> K, V as [..., kv_heads, nb * tokens_per_block, head_dim], in `dtype`
        when given (an FP8 pool's values dequantized), else as stored.

        One copy: the selected blocks land straight in head-major order, and K and V come back as
        views of it (last dim contiguous, which is all SDPA needs), without the second copy that
        gathering block-major and reordering afterwards would make."""
        lead, nb = block_ids.shape[:-1], block_ids.shape[-1]
        layer_pool = self.pool[:, layer]  # [NB, 2, H, T, D] (HND) or [NB, 2, T, H, D] (NHD)
        T, D = self.tokens_per_block, layer_pool.shape[-1]
        if self.layout == "HND":
            H = layer_pool.shape[2]
            kv = layer_pool.permute(1, 2, 0, 3, 4).index_select(2, block_ids.reshape(-1))  # [2, H, B*nb, T, D]
            kv = kv.view(2, H, *lead, nb * T, D).movedim(1, -3)  # [2, ..., H, nb*T, D]
        else:
            H = layer_pool.shape[3]
            kv = layer_pool.transpose(0, 1).index_select(1, block_ids.reshape(-1))  # [2, B*nb, T, H, D]
            kv = kv.view(2, *lead, nb * T, H, D).transpose(-3, -2)  # [2, ..., H, nb*T, D]
        k, v = kv[0], kv[1]
        if length is not None:
            k, v = k[..., :length, :], v[..., :length, :]
        return self.decode(layer, k, v, dtype) if dtype is not None else (k, v)


def _sdpa_decode(q: torch.Tensor, layer: int, cache: PagedKVCache, md: AttentionMetadata, scale: float,
                 window: int) -> torch.Tensor:
    """PyTorch decode attention, q: [b, heads, d] one query per decode sequence -> [b, kv_heads, group, d].
    The query heads of a KV group are folded into the "query length" axis so a single batched SDPA covers
    every sequence without repeating K/V. A sliding window masks all but each sequence's last keys."""
    kd, vd = cache.gather(layer, md.decode_blocks, dtype=q.dtype)  # [b, kv_heads, L, d]
    b, heads, d = q.shape
    qd = q.view(b, kd.shape[1], heads // kd.shape[1], d)
    mask = md.decode_mask
    if window:
        keys = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (keys.unsqueeze(0) >= (md.decode_lens - window).unsqueeze(1))[:, None, None, :]
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)


@functools.cache
def fused_decode():
    """triton_decode.paged_decode (one kernel, reading the pool where it lies), or None without Triton,
    which CUDA builds of torch ship with."""
    try:
        from pdserve.kernels import triton_decode
    except ImportError:
        return None
    return triton_decode.paged_decode


@functools.cache
def _fused_rope():
    """triton_rope.rope_cache_write (RoPE and the K/V write in one kernel), or None without Triton."""
    try:
        from pdserve.kernels import triton_rope
    except ImportError:
        return None
    return triton_rope.rope_cache_write


def rotate_and_cache(qkv: torch.Tensor, heads: int, rope_table: tuple[torch.Tensor, torch.Tensor], layer: int,
                     cache: PagedKVCache, md: AttentionMetadata) -> torch.Tensor:
    """RoPE on q and k of qkv [n, heads + 2 * kv_heads, d], and the new K and V written to the cache.
    Returns the rotated q and k side by side, [n, heads + kv_heads, d]. On CPU one native call
    (cpu.rope_cache_write, the same bits), on CUDA one Triton kernel (triton_rope.py, the same
    bits); elsewhere RotaryEmbedding.rotate + PagedKVCache.write."""
    native = cpu.native(cpu.ROPE_CACHE, qkv.dtype)  # (kernels/dispatch.py: where it beats PyTorch)
    qk = cpu.rope_cache_write(qkv, heads, *rope_table, cache.pool, cache.layout, layer, md.slot_blocks,
                              md.slot_offsets, cache.scales) if native else None
    if qk is None and qkv.is_cuda and _fused_rope() is not None:  # one kernel, the PyTorch form's bits
        qk = _fused_rope()(qkv, heads, *rope_table, cache.pool, cache.layout, layer, md.slot_blocks, md.slot_offsets)
    if qk is None:
        kv_heads = (qkv.shape[1] - heads) // 2
        qk = RotaryEmbedding.rotate(qkv[:, : heads + kv_heads], rope_table)  # q and k: one rotation covers both
        cache.write(layer, qk[:, heads:], qkv[:, heads + kv_heads:], md)
    return qk


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache,
                    md: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """q: [n, heads, d]; k, v: [n, kv_heads, d] for the new tokens, already in the cache
    (rotate_and_cache). Returns [n, heads * d]. With a sliding `window` (> 0) the query at position P
    attends to positions P - window + 1 .. P only."""
    n, heads, d = q.shape
    out = None if md.decode_only else torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    # SDPA gets 4-D [1, heads, len, d] inputs: with 3-D ones PyTorch's CPU backend falls back to the
    # math kernel and materialises the whole [heads, len, len] score matrix.
    flash = cpu.native(cpu.FLASH_PREFILL, q.dtype)  # (kernels/dispatch.py: where it beats PyTorch)
    stored = cache.quantized  # FP8 K/V go to the flash kernel as stored, with their dequantisation tables
    for s in md.prefills:
        rows = slice(s.q_start, s.q_start + s.q_len)
        if s.q_len == s.ctx_len:
            # Nothing cached before this chunk: attend to the fresh K/V, rounded through the cache
            # dtype so the result matches what a later step reads back.
            ks, vs = (cache.encode(layer, k[rows], v[rows]).unbind(1) if stored
                      else cache.round_trip(layer, k[rows], v[rows], q.dtype))
            ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [kv_heads, q_len, d]
        else:
            ks, vs = cache.gather(layer, s.block_ids, s.ctx_len, None if stored else q.dtype)  # [kv_heads, ctx, d]
        table = cache.dequant_table(layer, q.dtype) if stored else None
        if flash and cpu.flash_prefill(q[rows], ks, vs, scale, out=out[rows], window=window,
                                       dequant=table) is not None:
            continue  # written into out; None off CPU or without the native kernels
        if stored:
            ks, vs = cache.decode(layer, ks, vs, q.dtype)
        if _use_tiled(q, s.q_len) and not window:
            out[rows] = _tiled_causal_attention(q[rows], ks, vs, scale)
            continue
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        if s.q_len == s.ctx_len and not window:
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            # Query i sits at absolute position ctx_len - q_len + i and sees keys up to it (and within
            # the window).
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device).unsqueeze(1)
            kpos = torch.arange(s.ctx_len, device=q.device).unsqueeze(0)
            mask = (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if md.decode_rows.numel():
        # One query per sequence: the native kernel reads the pool directly; else SDPA over a gather.
        qd = q if md.decode_only else q[md.decode_rows]  # [b, heads, d]
        runs = cpu.native(cpu.PAGED_DECODE, q.dtype)  # (kernels/dispatch.py: where it beats PyTorch)
        o = cpu.paged_decode_attention(qd, cache.pool, cache.layout, layer, md.decode_blocks, md.decode_lens,
                                       scale, window, cache.scales) if runs else None
        if o is None and qd.is_cuda and fused_decode() is not None:  # no gather of the pool on the GPU
            o = fused_decode()(qd, cache.pool, cache.layout, layer, md.decode_blocks, md.decode_lens, scale, window)
        if o is None:
            o = _sdpa_decode(qd, layer, cache, md, scale, window)
        if md.decode_only:
            return o.reshape(n, heads * d)
        out[md.decode_rows] = o.reshape(-1, heads, d)
    return out.view(n, heads * d)
