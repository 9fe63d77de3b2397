"""DeepSeek-V3: latent attention (mla.py) in every layer, a dense SwiGLU MLP in the first
`first_k_dense_replace` layers and a sigmoid-routed MoE with shared experts (moe.py) in the others.

    h = x + mla(rms_norm(x));  out = h + mlp_or_moe(rms_norm(h))

Every layer keeps KV: its latent, at the layer's index in this stage's pool. The multi-token-prediction
layers some checkpoints carry (past num_hidden_layers) are not served, as transformers does not run them.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import ModelConfig
from pdserve.models.hybrid_stage import HybridStage
from pdserve.models.layers import RMSNorm
from pdserve.models.llama import MLP
from pdserve.models.mla import MlaAttention, MlaRotary
from pdserve.models.moe import SparseMoeBlock
from pdserve.parallel.state import ParallelState


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, index: int, slot: int):
        super().__init__()
        self.slot = slot  # this layer's index in the stage's latent pool
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MlaAttention(cfg.mla, cfg.hidden_size, cfg.num_heads, cfg.rms_norm_eps, cfg.attention_bias,
                                      ps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, ps, dtype) if cfg.is_moe(index) else MLP(cfg, ps, dtype)

    def load(self, take, prefix: str) -> None:
        self.self_attn.load(take, prefix + "self_attn.")
        self.mlp.load(take, prefix + "mlp.")
        self.input_layernorm.load(take(prefix + "input_layernorm.weight"))
        self.post_attention_layernorm.load(take(prefix + "post_attention_layernorm.weight"))

    def forward(self, x, rope_table, cache, md, rows=None):
        """The block's output at `rows` only (default: all), though every row's latent is cached."""
        attn = self.self_attn(self.input_layernorm(x), rope_table, self.slot, cache, md, rows)
        x = x if rows is None else x[rows]
        h, h_normed = self.post_attention_layernorm.add_and_norm(x, attn)
        return h + self.mlp(h_normed)


class DeepseekV3ForCausalLM(HybridStage):
    """The same interface as LlamaForCausalLM; the cache it reads is the latent pool (mla.py)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg, ps, dtype)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, ps, dtype, index, slot)
                                    for index, slot in self.layer_slots())
        self.rope = MlaRotary(cfg.mla.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.mla.yarn)
        self.head(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype))

    def forward(self, ids_or_hidden: torch.Tensor, positions: torch.Tensor, cache, md: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_layers(ids_or_hidden, out_rows, self.rope.table(positions), cache, md)
