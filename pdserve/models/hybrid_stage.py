"""What every hybrid decoder's pipeline stage shares (Qwen3.5, Nemotron-H): its layer range, the
embedding on the first stage, the final norm and LM head on the last, the recurrent state the model runner
gives it, and which cache or state index each of its layers takes.

A layer that keeps KV takes the next index of the stage's KV pool; a recurrent layer the next index of the
stage's RecurrentState; a layer with neither (Nemotron-H's MLP layers) takes none.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.config import ModelConfig
from pdserve.models.layers import VocabParallelEmbedding
from pdserve.models.llama import stage_layers
from pdserve.models.recurrent_state import RecurrentState
from pdserve.parallel.state import ParallelState


class HybridStage(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.ps, self.dtype = cfg, ps, dtype
        counts = stage_layers(cfg.num_layers, ps.pp_size)
        self.first_layer = sum(counts[: ps.pp_rank])
        self.num_local_layers = counts[ps.pp_rank]
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps, dtype)
                             if ps.is_first_stage else None)
        self.state: RecurrentState | None = None  # allocated by the model runner (num_recurrent_layers)
        self.stage_decoder = None  # the native decode step is the Llama block's only

    def layer_slots(self) -> list[tuple[int, int]]:
        """(global layer index, its KV or state index) for this stage's layers; sets num_kv_layers and
        num_recurrent_layers."""
        out, kv, recurrent = [], 0, 0
        for index in range(self.first_layer, self.first_layer + self.num_local_layers):
            if self.cfg.is_recurrent(index):
                out.append((index, recurrent))
                recurrent += 1
            else:
                out.append((index, kv))
                kv += index not in self.cfg.cacheless_layers
        self.num_kv_layers, self.num_recurrent_layers = kv, recurrent
        return out

    def head(self, norm: nn.Module) -> None:
        """On the last stage: the final norm and the LM head (the embedding itself when they are tied)."""
        if not self.ps.is_last_stage:
            return
        self.norm = norm
        if self.cfg.tie_word_embeddings and self.embed_tokens is not None:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(self.cfg.vocab_size, self.cfg.hidden_size, self.ps, self.dtype)

    def run_layers(self, ids_or_hidden: torch.Tensor, out_rows: torch.Tensor | None, *args) -> torch.Tensor:
        """Embed (first stage), then every layer as layer(h, *args, rows); the last stage's last layer keeps
        `out_rows` only (the rows that sample)."""
        h = self.embed_tokens(ids_or_hidden) if self.embed_tokens is not None else ids_or_hidden
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, *args, out_rows if i == last and self.ps.is_last_stage else None)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] (only the positions that sample) -> [n, vocab] float32."""
        return self.lm_head.logits(self.norm(h)).float()
