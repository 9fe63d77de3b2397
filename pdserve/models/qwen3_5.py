"""Qwen3.5 (text): a hybrid decoder, Gated DeltaNet layers with a gated full-attention layer between.

    h = x + mixer(norm(x));  out = h + mlp(norm(h))
    mixer = GatedDeltaNet (layer_types 'linear_attention', a recurrent state per sequence)
          | GatedAttention ('full_attention': paged KV, q/k norms, RoPE on part of each head,
                            the output times sigmoid of a per-head gate)
    mlp   = a SwiGLU MLP (Qwen3.5), or in every layer of Qwen3.5-MoE a sparse MoE block with a
            sigmoid-gated shared expert (moe.py)

Qwen3.5 is published as a vision-language model (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
the text model's tensors under `model.language_model.*`, the vision tower's under `model.visual.*`, `mtp.*` beside
them. pdserve serves the text model and skips the vision tower (Qwen3_5ForConditionalGeneration below); text-only
positions make the published multimodal RoPE (mrope: one position per axis, all three equal) plain RoPE.

Norms are zero-centred: the weight w scales by (1 + w), in fp32. Only the attention layers keep KV;
the cache's layer index of one is its rank among this stage's attention layers, and the recurrent
layers' state (`RecurrentState`) is indexed by its rank among this stage's recurrent layers.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.attention import AttentionMetadata, PagedKVCache, paged_attention
from pdserve.models.config import ModelConfig
from pdserve.models.gated_deltanet import GatedDeltaNet, deltanet_state
from pdserve.models.hybrid_stage import HybridStage
from pdserve.models.recurrent_state import StateGeometry
from pdserve.models.layers import ColumnParallelLinear, MergedColumnParallelLinear, RotaryEmbedding, RowParallelLinear
from pdserve.models.llama import MLP
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight w scales by (1 + w); normalised and scaled in fp32, then cast."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)  # 1 + w

    def load(self, weight: torch.Tensor) -> None:
        self.scale.copy_(1.0 + weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        tp, d = ps.tp_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, d
        # q_proj rows are [q | gate] per head, so cutting by rows cuts by heads
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * 2 * d, cfg.attention_bias, ps, dtype)
        self.kv_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.num_kv_heads * d] * 2, ps, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, ps, dtype)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.rotary_dim = int(d * cfg.partial_rotary_factor)
        self.scale = d ** -0.5

    def load(self, take, prefix: str) -> None:
        self.q_proj.load(take(prefix + "q_proj.weight"))
        self.kv_proj.load([take(prefix + "k_proj.weight"), take(prefix + "v_proj.weight")])
        self.o_proj.load(take(prefix + "o_proj.weight"))
        self.q_norm.load(take(prefix + "q_norm.weight"))
        self.k_norm.load(take(prefix + "k_norm.weight"))

    def forward(self, x, rope_table, layer: int, cache: PagedKVCache, md: AttentionMetadata, rows=None):
        n, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(n, self.heads, 2 * d).chunk(2, dim=-1)
        k, v = self.kv_proj(x).view(n, 2 * self.kv_heads, d).split(self.kv_heads, dim=1)
        q, k = self.q_norm(q), self.k_norm(k)
        r = self.rotary_dim  # RoPE on the first r dims of each head; the rest pass through
        qk = torch.cat([q, k], dim=1)
        qk[..., :r] = RotaryEmbedding.rotate(qk[..., :r].contiguous(), rope_table)
        q, k = qk[:, : self.heads], qk[:, self.heads:]
        cache.write(layer, k, v, md)
        attn = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), layer, cache, md, self.scale)
        attn = attn * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(attn if rows is None else attn[rows])


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, index: int, slot: int):
        super().__init__()
        self.recurrent = cfg.is_recurrent(index)
        self.slot = slot  # this layer's index in the KV cache (attention) or in the state (recurrent)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg.linear_attention, cfg.hidden_size, cfg.rms_norm_eps, ps, dtype)
        else:
            self.self_attn = GatedAttention(cfg, ps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, ps, dtype) if cfg.is_moe(index) else MLP(cfg, ps, dtype)

    def load(self, take, prefix: str) -> None:
        if self.recurrent:
            self.linear_attn.load(take, prefix + "linear_attn.")
        else:
            self.self_attn.load(take, prefix + "self_attn.")
        if isinstance(self.mlp, SparseMoeBlock):
            self.mlp.load(take, prefix + "mlp.")
        else:
            self.mlp.gate_up_proj.load([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")])
            self.mlp.down_proj.load(take(prefix + "mlp.down_proj.weight"))
        self.input_layernorm.load(take(prefix + "input_layernorm.weight"))
        self.post_attention_layernorm.load(take(prefix + "post_attention_layernorm.weight"))

    def forward(self, x, rope_table, cache, md, state, rows=None):
        """The block's output at `rows` only (default: all); every row still feeds the KV or the state."""
        normed = self.input_layernorm(x)
        if self.recurrent:
            mixed = self.linear_attn(normed, state, self.slot, md.states)
            mixed = mixed if rows is None else mixed[rows]
        else:
            mixed = self.self_attn(normed, rope_table, self.slot, cache, md, rows)
        h = (x if rows is None else x[rows]) + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5ForCausalLM(HybridStage):
    """The same interface as LlamaForCausalLM, plus `state` (hybrid_stage.py). Serves Qwen3_5MoeForCausalLM too:
    ModelConfig.moe_layers says which layers take the MoE block."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg, ps, dtype)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, ps, dtype, index, slot)
                                    for index, slot in self.layer_slots())
        self.rope = RotaryEmbedding(int(cfg.head_dim * cfg.partial_rotary_factor), max_positions, cfg.rope_theta,
                                    cfg.rope_scaling)
        self.head(OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def state_geometry(self, dtype: torch.dtype) -> StateGeometry:
        return deltanet_state(self.cfg.linear_attention, self.ps.tp_size, dtype.itemsize)

    def forward(self, ids_or_hidden: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                md: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_layers(ids_or_hidden, out_rows, self.rope.table(positions), cache, md, self.state)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5 as published (dense or MoE): the text model of a vision-language checkpoint. Its tensors are
    renamed to Qwen3_5ForCausalLM's; the vision tower's are skipped (a chat request with images is refused
    before it gets here: server/chat_prompt.py); `mtp.*` is the MTP weights' (weights/mtp.py)."""

    CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
    CHECKPOINT_SKIPS = ((r"^model\.visual\.", "the vision tower (model.visual.*)"),)
