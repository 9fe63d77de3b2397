"""Nemotron-H: a hybrid decoder whose every layer is one mixer behind an RMSNorm and a residual:

    out = x + mixer(norm(x)),   mixer = Mamba2Mixer ('linear_attention': a recurrent state per sequence)
                                      | attention ('full_attention': paged KV, no positional encoding)
                                      | MLP ('mlp': up, squared ReLU, down)
                                      | MoE ('moe', Nemotron 3: routed squared-ReLU experts and a shared one;
                                        moe.SparseMoeBlock)

Only the attention layers keep KV (the MLP and MoE layers keep neither KV nor a state); the cache's layer
index of one is its rank among this stage's attention layers, a Mamba2 layer's state index its rank among this
stage's Mamba2 layers. Norms scale by their weight in fp32 and cast once.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.attention import AttentionMetadata, PagedKVCache, paged_attention
from pdserve.models.config import ModelConfig
from pdserve.models.hybrid_stage import HybridStage
from pdserve.models.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pdserve.models.mamba2 import Mamba2Mixer, mamba2_state
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.recurrent_state import StateGeometry
from pdserve.parallel.state import ParallelState


class Fp32RMSNorm(nn.Module):
    """RMSNorm normalised and scaled in fp32, then cast to the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention without positions: Nemotron-H's Mamba2 layers carry the order."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, False, ps,
                                          dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ps, dtype)
        self.head_dim, self.scale = cfg.head_dim, cfg.head_dim ** -0.5

    def load(self, take, prefix: str) -> None:
        self.qkv_proj.load(take(prefix + "q_proj.weight"), take(prefix + "k_proj.weight"),
                           take(prefix + "v_proj.weight"))
        self.o_proj.load(take(prefix + "o_proj.weight"))

    def forward(self, x, layer: int, cache: PagedKVCache, md: AttentionMetadata, rows=None):
        n, heads, kv_heads = x.shape[0], self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q, k, v = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim).split([heads, kv_heads, kv_heads], 1)
        cache.write(layer, k, v, md)
        attn = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), layer, cache, md, self.scale)
        return self.o_proj(attn if rows is None else attn[rows])


class ReluSquaredMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, False, ps, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, ps, dtype)

    def load(self, take, prefix: str) -> None:
        self.up_proj.load(take(prefix + "up_proj.weight"))
        self.down_proj.load(take(prefix + "down_proj.weight"))

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, index: int, slot: int):
        super().__init__()
        self.kind = ("mamba" if cfg.is_recurrent(index) else "moe" if cfg.is_moe(index)
                     else "mlp" if index in cfg.cacheless_layers else "attention")
        self.slot = slot  # this layer's index in the KV cache (attention) or in the state (mamba)
        self.norm = Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps, ps, dtype)
        elif self.kind == "attention":
            self.mixer = Attention(cfg, ps, dtype)
        elif self.kind == "moe":
            self.mixer = SparseMoeBlock(cfg.moe, cfg.hidden_size, ps, dtype)
        else:
            self.mixer = ReluSquaredMLP(cfg, ps, dtype)

    def load(self, take, prefix: str) -> None:
        self.norm.load(take(prefix + "norm.weight"))
        self.mixer.load(take, prefix + "mixer.")

    def forward(self, x, cache, md, state, rows=None):
        """The block's output at `rows` only (default: all); every row still feeds the KV or the state."""
        normed = self.norm(x)
        if self.kind == "attention":
            out = self.mixer(normed, self.slot, cache, md, rows)
        else:
            out = (self.mixer(normed, state, self.slot, md.states) if self.kind == "mamba"
                   else self.mixer(normed if rows is None else normed[rows]))
            out = out if rows is None or self.kind != "mamba" else out[rows]
        return (x if rows is None else x[rows]) + out


class NemotronHForCausalLM(HybridStage):
    """The same interface as Qwen3_5ForCausalLM (hybrid_stage.py)."""

    # The published checkpoints' names -> pdserve's, applied in order (loader.py): every Nemotron-H checkpoint
    # names its weights backbone.* (transformers' conversion_mapping 'nemotron_h' renames them to model.* in
    # memory, and loads that spelling too), the embedding `embeddings` and the final norm `norm_f`.
    CHECKPOINT_RENAMES = ((r"^backbone\.", "model."), (r"^model\.embeddings\.", "model.embed_tokens."),
                          (r"^model\.norm_f\.", "model.norm."))

    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg, ps, dtype)
        self.layers = nn.ModuleList(NemotronHLayer(cfg, ps, dtype, index, slot) for index, slot in self.layer_slots())
        self.head(Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def state_geometry(self, dtype: torch.dtype) -> StateGeometry:
        return mamba2_state(self.cfg.mamba, self.ps.tp_size, dtype.itemsize)

    def forward(self, ids_or_hidden: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                md: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_layers(ids_or_hidden, out_rows, cache, md, self.state)
