"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2, Qwen3, Qwen3-MoE), written as the textbook
block:

    h = x + attn(rms_norm(x));  out = h + mlp(rms_norm(h))

Qwen3 adds an RMSNorm of each q and k head before RoPE (`qk_norm`); Qwen3-MoE, besides, has a sparse
mixture of experts (moe.SparseMoeBlock) for the MLP of the layers `ModelConfig.moe_layers` names.

The decoder owns one pipeline stage: layers [first_layer, first_layer + num_local_layers). Only the
first stage embeds tokens and only the last computes logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.attention import AttentionMetadata, PagedKVCache, paged_attention, rotate_and_cache
from pdserve.models.config import ModelConfig
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.parallel.state import ParallelState


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, window: int = 0):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, ps, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ps, dtype,
                                        bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = window  # > 0: a sliding window, each query sees its last `window` positions

    def forward(self, x, rope_table, layer: int, cache: PagedKVCache, md: AttentionMetadata, rows=None):
        """Every row's K and V go to the cache and every row attends; o_proj, and so the output, covers
        `rows` only (default: all)."""
        n, heads, kv_heads = x.shape[0], self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv, heads, kv_heads)
        qk = rotate_and_cache(qkv, heads, rope_table, layer, cache, md)  # RoPE on q and k; K, V into the cache
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        attn = paged_attention(q, k, v, layer, cache, md, self.scale, self.window)
        return self.o_proj(attn if rows is None else attn[rows])

    def _norm_heads(self, qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv [n, heads + 2 * kv_heads, d] with each q and k head RMS-normalised; v as it was."""
        q = self.q_norm(qkv[:, :heads].contiguous())
        k = self.k_norm(qkv[:, heads:heads + kv_heads].contiguous())
        return torch.cat([q, k, qkv[:, heads + kv_heads:]], dim=1)

    def load(self, take, prefix: str) -> None:
        """`prefix` is `model.layers.N.self_attn.`."""
        biases = [take(prefix + f"{x}_proj.bias") for x in "qkv"] if self.qkv_proj.bias is not None else [None] * 3
        self.qkv_proj.load(take(prefix + "q_proj.weight"), take(prefix + "k_proj.weight"),
                           take(prefix + "v_proj.weight"), *biases)
        self.o_proj.load(take(prefix + "o_proj.weight"),
                         take(prefix + "o_proj.bias") if self.o_proj.bias is not None else None)
        if self.q_norm is not None:
            self.q_norm.load(take(prefix + "q_norm.weight"))
            self.k_norm.load(take(prefix + "k_norm.weight"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, ps, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, ps, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one [tokens, intermediate] buffer fewer

    def load(self, take, prefix: str) -> None:
        """`prefix` is `model.layers.N.mlp.`."""
        self.gate_up_proj.load([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")])
        self.down_proj.load(take(prefix + "down_proj.weight"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, ps, dtype, cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = (SparseMoeBlock(cfg.moe, cfg.hidden_size, ps, dtype) if cfg.is_moe(index)
                    else MLP(cfg, ps, dtype))

    def load(self, take, prefix: str) -> None:
        """Checkpoint tensors under `prefix` (`model.layers.N.`); `take(name)` hands each one over once."""
        self.self_attn.load(take, prefix + "self_attn.")
        self.mlp.load(take, prefix + "mlp.")
        self.input_layernorm.load(take(prefix + "input_layernorm.weight"))
        self.post_attention_layernorm.load(take(prefix + "post_attention_layernorm.weight"))

    def forward(self, x, rope_table, layer, cache, md, rows=None):
        """The block's output at `rows` only (default: all), though every row's K and V is cached."""
        attn = self.self_attn(self.input_layernorm(x), rope_table, layer, cache, md, rows)
        x = x if rows is None else x[rows]
        h, h_normed = self.post_attention_layernorm.add_and_norm(x, attn)  # h = x + attn, and its norm
        return h + self.mlp(h_normed)


def stage_layers(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts per pipeline stage; earlier stages take the remainder."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if i < extra else 0) for i in range(pp_size)]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.ps = ps
        counts = stage_layers(cfg.num_layers, ps.pp_size)
        self.first_layer = sum(counts[: ps.pp_rank])
        self.num_local_layers = counts[ps.pp_rank]
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps, dtype)
                             if ps.is_first_stage else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ps, dtype, self.first_layer + i)
                                    for i in range(self.num_local_layers))
        self.num_kv_layers, self.num_recurrent_layers = self.num_local_layers, 0  # every layer keeps KV
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.stage_decoder = None  # stage_decoder.StageDecoder, set by the model runner where it applies
        if ps.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = self.embed_tokens  # tied: one tensor embeds and projects
            else:
                self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps, dtype)

    def forward(self, ids_or_hidden: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                md: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes token ids [n]; later stages take hidden states [n, hidden]. Returns the
        hidden states [n, hidden]; on the last stage with `out_rows` (the rows that sample), those rows'
        only [len(out_rows), hidden]: nothing after the last layer reads the others, so its o_proj and
        MLP run on those rows only (every row still attends, and its K and V are cached)."""
        h = self.embed_tokens(ids_or_hidden) if self.embed_tokens is not None else ids_or_hidden
        rope_table = self.rope.table(positions)
        if self.stage_decoder is not None:  # decode tokens only, on CPU: the same layers in one native call
            out = self.stage_decoder(h, rope_table, cache, md)
            if out is not None:
                return out if out_rows is None else out[out_rows]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, rope_table, i, cache, md, out_rows if i == last and self.ps.is_last_stage else None)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] (only the positions that sample) -> [n, vocab] float32."""
        return self.lm_head.logits(self.norm(h)).float()
