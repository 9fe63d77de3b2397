"""Multi-head latent attention (DeepSeek-V3) over a paged cache of latents.

    q      = q_b_proj(rms_norm(q_a_proj(x)))            [n, heads, nope + rope]   (or q_proj(x): q_lora_rank None)
    c, k_pe = kv_a_proj_with_mqa(x)                     [n, kv_lora], [n, rope]   (one of each per token)
    latent = [rms_norm(c) | rope(k_pe)]                 [n, kv_lora + rope]       what the cache keeps
    k, v   = [kv_b_proj(c)_k | k_pe], kv_b_proj(c)_v    [ctx, heads, nope + rope], [ctx, heads, v_dim]
    out    = o_proj(softmax(q k^T * scale) v)

The cache holds only the latent, one vector per token and layer, whatever the head count: the engine's
block-major pool with one part and one "head" of width latent_dim,

    pool[num_blocks, num_layers, 1, 1, tokens_per_block, latent_dim]      (HND; NHD is the same bytes)

and every TP rank keeps all of it (the heads are cut, the latent is not): the KV exchange sends it as a
REPLICATED pool.

Prefill expands the latent of the sequence's context to per-head K and V (the plain form). Decode attends in
the latent space instead (the absorbed form): q_nope times each head's K block of kv_b_proj gives a query of
width kv_lora, so every head scores [q_lat | q_pe] against the cached latents themselves (one shared KV head,
the values the latents' first kv_lora dims), and each head's V block of kv_b_proj maps its output back:
per step that costs O(heads * ctx * latent_dim) instead of expanding every cached token through kv_b_proj.
benchmarks/bench_mla_decode.py times both forms.

DeepSeek's checkpoints lay the RoPE dims of q and k_pe out in interleaved pairs (rope_interleave). Those rows
of q_b_proj and kv_a_proj_with_mqa are reordered at load, evens first, which makes RoPE the rotate-half form
(RotaryEmbedding.rotate) with the same result; the latent cache holds k_pe in that order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.attention import AttentionMetadata, PagedKVCache
from pdserve.models.shapes import MlaShape, YarnRope
from pdserve.models.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from pdserve.parallel.state import ParallelState


def yarn_inv_freq(dim: int, theta: float, yarn: YarnRope) -> torch.Tensor:
    """YaRN's blend of interpolated (slowed by `factor`) and extrapolated frequencies, [dim // 2]."""
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (yarn.factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate


class MlaRotary(RotaryEmbedding):
    """Rotate-half RoPE over the rope dims, plain or YaRN-scaled (cos and sin times its attention factor)."""

    def __init__(self, dim: int, max_positions: int, theta: float, yarn: YarnRope | None):
        super().__init__(dim, max_positions, theta, None)
        if yarn is not None:
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), yarn_inv_freq(dim, theta, yarn))
            f = yarn.attention_factor
            self.cos = torch.cat([freqs, freqs], dim=-1).cos() * f
            sin = freqs.sin() * f
            self.signed_sin = torch.cat([-sin, sin], dim=-1)


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """RoPE rows [..., rope, in] of interleaved pairs (x0, x1), (x2, x3), ... reordered evens first."""
    return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)


def latent_rows(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, num_layers, tokens_per_block, latent_dim] (one part, one head: both layouts)."""
    return pool.view(pool.shape[0], pool.shape[1], -1, pool.shape[-1])


class MlaAttention(nn.Module):
    def __init__(self, shape: MlaShape, hidden: int, num_heads: int, eps: float, bias: bool, ps: ParallelState,
                 dtype: torch.dtype, absorb_decode: bool = True):
        super().__init__()
        s = self.shape = shape
        self.heads = num_heads // ps.tp_size
        if shape.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * s.qk_head_dim, False, ps, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, shape.q_lora_rank, bias, ps, dtype)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(shape.q_lora_rank, num_heads * s.qk_head_dim, False, ps, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, s.latent_dim, bias, ps, dtype)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(s.kv_lora_rank, num_heads * (s.qk_nope_head_dim + s.v_head_dim), False,
                                              ps, dtype)
        self.o_proj = RowParallelLinear(num_heads * s.v_head_dim, hidden, ps, dtype, bias=bias)
        self.scale = s.qk_head_dim ** -0.5 * (s.yarn.softmax_mscale if s.yarn is not None else 1.0)
        self.absorb_decode = absorb_decode
        # this rank's heads' blocks of kv_b_proj, kept plain for the absorbed decode (set by load):
        # w_uk [heads, nope, kv_lora] (q_nope -> latent query), w_uv [heads, kv_lora, v_dim] (latent -> value)
        self.register_buffer("w_uk", torch.empty(self.heads, s.qk_nope_head_dim, s.kv_lora_rank, dtype=dtype),
                             persistent=False)
        self.register_buffer("w_uv", torch.empty(self.heads, s.kv_lora_rank, s.v_head_dim, dtype=dtype),
                             persistent=False)

    def load(self, take, prefix: str) -> None:
        """`prefix` is `model.layers.N.self_attn.`."""
        s = self.shape
        q_name = "q_proj" if s.q_lora_rank is None else "q_b_proj"
        q = take(prefix + q_name + ".weight")
        kv_a = take(prefix + "kv_a_proj_with_mqa.weight")
        kv_a_bias = take(prefix + "kv_a_proj_with_mqa.bias") if self.kv_a_proj_with_mqa.bias is not None else None
        if s.rope_interleave:
            q = q.view(-1, s.qk_head_dim, q.shape[-1])
            q = torch.cat([q[:, :s.qk_nope_head_dim], _deinterleave(q[:, s.qk_nope_head_dim:])], 1).flatten(0, 1)
            kv_a = torch.cat([kv_a[:s.kv_lora_rank], _deinterleave(kv_a[s.kv_lora_rank:])])
            if kv_a_bias is not None:
                r = kv_a_bias[s.kv_lora_rank:]
                kv_a_bias = torch.cat([kv_a_bias[:s.kv_lora_rank], r[0::2], r[1::2]])
        if s.q_lora_rank is None:
            self.q_proj.load(q)
        else:
            self.q_a_proj.load(take(prefix + "q_a_proj.weight"),
                               take(prefix + "q_a_proj.bias") if self.q_a_proj.bias is not None else None)
            self.q_a_layernorm.load(take(prefix + "q_a_layernorm.weight"))
            self.q_b_proj.load(q)
        self.kv_a_proj_with_mqa.load(kv_a, kv_a_bias)
        self.kv_a_layernorm.load(take(prefix + "kv_a_layernorm.weight"))
        self.kv_b_proj.load(take(prefix + "kv_b_proj.weight"))
        self.o_proj.load(take(prefix + "o_proj.weight"),
                         take(prefix + "o_proj.bias") if self.o_proj.bias is not None else None)
        kv_b = self.kv_b_proj.weight.view(self.heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        self.w_uk.copy_(kv_b[:, :s.qk_nope_head_dim])
        self.w_uv.copy_(kv_b[:, s.qk_nope_head_dim:].transpose(1, 2))

    def forward(self, x, rope_table, layer: int, cache: PagedKVCache, md: AttentionMetadata, rows=None):
        """Every row's latent goes to the cache and every row attends; o_proj covers `rows` only (default: all).
        An FP8 pool stores each latent by its layer's static scale, saturated (kv_quant.py)."""
        s, n = self.shape, x.shape[0]
        q = self.q_proj(x) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.heads, s.qk_head_dim)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        q_pe = RotaryEmbedding.rotate(q[..., s.qk_nope_head_dim:].contiguous(), rope_table)
        latent = torch.cat([self.kv_a_layernorm(c.contiguous()),
                            RotaryEmbedding.rotate(k_pe.contiguous().unsqueeze(1), rope_table).squeeze(1)], dim=-1)
        stored = cache.encode_latent(layer, latent)
        pool = latent_rows(cache.pool)  # [blocks, layers, T, latent_dim]
        pool[md.slot_blocks, layer, md.slot_offsets] = stored
        q = torch.cat([q[..., :s.qk_nope_head_dim], q_pe], dim=-1)  # [n, heads, qk_head_dim]
        out = None if md.decode_only else torch.empty(n, self.heads, s.v_head_dim, dtype=x.dtype, device=x.device)
        for sl in md.prefills:
            at = slice(sl.q_start, sl.q_start + sl.q_len)
            if sl.q_len == sl.ctx_len:  # nothing cached before: the fresh latents, rounded as the cache keeps them
                ctx = cache.decode_latent(layer, stored[at], x.dtype)
            else:
                ctx = pool[:, layer].index_select(0, sl.block_ids).flatten(0, 1)[:sl.ctx_len]
                ctx = cache.decode_latent(layer, ctx, x.dtype)
            out[at] = self._expanded(q[at], ctx)
        if md.decode_rows.numel():
            qd = q if md.decode_only else q[md.decode_rows]
            ctx = pool[:, layer].index_select(0, md.decode_blocks.flatten())  # [b * max_blocks, T, latent_dim]
            ctx = cache.decode_latent(layer, ctx.view(qd.shape[0], -1, s.latent_dim), x.dtype)
            o = self._absorbed(qd, ctx, md.decode_mask) if self.absorb_decode else self._expanded_decode(qd, ctx, md)
            if md.decode_only:
                out = o
            else:
                out[md.decode_rows] = o
        out = out.reshape(n, self.heads * s.v_head_dim)
        return self.o_proj(out if rows is None else out[rows])

    def _expand(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [..., L, latent_dim] -> K [..., heads, L, qk_head_dim], V [..., heads, L, v_dim]."""
        s = self.shape
        kv = self.kv_b_proj(ctx[..., :s.kv_lora_rank]).unflatten(-1, (self.heads, -1)).transpose(-3, -2)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k_pe = ctx[..., s.kv_lora_rank:].unsqueeze(-3).expand(*k_nope.shape[:-1], s.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _expanded(self, q: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """The plain form for one sequence: q [q_len, heads, qk] (the last q_len of ctx's positions), ctx
        [ctx_len, latent_dim] -> [q_len, heads, v_dim]."""
        k, v = self._expand(ctx)
        q_len, ctx_len = q.shape[0], ctx.shape[0]
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, qk]
        # V padded with zeros to K's width: PyTorch's flash kernel needs one head dim, and the math fallback
        # it takes otherwise was 80% of a 2048-token prefill here (4.6x slower than the padded flash call)
        v_dim = v.shape[-1]
        v = F.pad(v, (0, k.shape[-1] - v_dim)) if v_dim < k.shape[-1] else v
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(qs, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=self.scale)
        else:
            qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qs, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=self.scale)
        return o[0, ..., :v_dim].transpose(0, 1)

    def _expanded_decode(self, q: torch.Tensor, ctx: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The plain form for decode rows: q [b, heads, qk], ctx [b, L, latent_dim] -> [b, heads, v_dim]."""
        k, v = self._expand(ctx)  # [b, heads, L, ...]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=md.decode_mask, scale=self.scale)
        return o.squeeze(2)

    def _absorbed(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The latent-space form (module docstring): q [b, heads, qk], ctx [b, L, latent_dim], mask [b, 1, 1, L]
        -> [b, heads, v_dim]."""
        s = self.shape
        q_lat = torch.bmm(q[..., :s.qk_nope_head_dim].transpose(0, 1), self.w_uk).transpose(0, 1)  # [b, heads, kv_lora]
        q_cat = torch.cat([q_lat, q[..., s.qk_nope_head_dim:]], dim=-1).unsqueeze(1)  # [b, 1, heads, latent_dim]
        kv = ctx.unsqueeze(1)  # [b, 1, L, latent_dim]: one KV head for every query head
        o_lat = F.scaled_dot_product_attention(q_cat, kv, kv[..., :s.kv_lora_rank], attn_mask=mask, scale=self.scale)
        return torch.bmm(o_lat.squeeze(1).transpose(0, 1), self.w_uv).transpose(0, 1)  # [b, heads, v_dim]
