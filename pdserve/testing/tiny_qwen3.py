"""The Qwen3 part of the tiny models (`make_tiny_model(arch="qwen3" | "qwen3_moe")`): config keys, and the
checkpoint as transformers' `save_pretrained` of Qwen3ForCausalLM / Qwen3MoeForCausalLM writes it
(tiny_published.py): the MoE's config says `num_local_experts`, its experts are stored one tensor per expert
and projection, as Qwen/Qwen3-30B-A3B ships them.

Both have per-head q/k RMSNorms. Their projections' scale is normalised away, so the norm weights
(around 1.5) set how sharp attention is: the logits of two unit-RMS heads times 1.5 each, which keeps
greedy decoding from locking into a loop as tiny.py's doubled q/k do for the other families.

- qwen3 (dense) sets attention_bias: q/k/v and o_proj carry biases (real Qwen3 checkpoints do not; the
  tiny model does so a test covers the key).
- qwen3_moe: 8 experts of 32, top 2, renormalised (norm_topk_prob, as Qwen3-30B-A3B); every layer sparse
  but layer 1 (`mlp_only_layers`), which keeps the dense MLP. Router weights at twice unit scale make the
  routing decisive (routing logits ~N(0, 4)): near-ties would let rounding pick another expert.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pdserve.testing.tiny_published import Randn, ValueRule, around_one, projection, save_published

QWEN3_ARCHS = ("qwen3", "qwen3_moe")
MOE_SHAPE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
             "decoder_sparse_step": 1}


def qwen3_config_extras(arch: str, num_layers: int, moe_shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """`moe_shape`: MoE config keys to set instead of MOE_SHAPE's (qwen3_moe only)."""
    if arch == "qwen3":
        if moe_shape:
            raise ValueError("moe_shape is for arch='qwen3_moe'; the dense Qwen3 has no experts")
        return {"attention_bias": True, "use_sliding_window": False, "sliding_window": None}
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "mlp_only_layers": [1] if num_layers > 1 else [], **MOE_SHAPE, **(moe_shape or {})}


def save_qwen3(out_dir: str | os.PathLike, cfg: dict[str, Any], *, seed: int, dtype: torch.dtype,
               tokenizer: Tokenizer, max_shard_size: int | str | None = None) -> Path:
    """`cfg` (tiny.py's config.json dict) read by transformers' config class, and its model saved by
    transformers with weights drawn at tiny.py's scales."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    config_class = Qwen3MoeConfig if cfg["model_type"] == "qwen3_moe" else Qwen3Config
    config = config_class.from_dict({k: v for k, v in cfg.items() if k != "torch_dtype"})
    return save_published(out_dir, config, _value_rule(config), seed=seed, dtype=dtype, tokenizer=tokenizer,
                          max_position_embeddings=cfg["max_position_embeddings"], max_shard_size=max_shard_size)


def _value_rule(config: Any) -> ValueRule:
    """tiny.py's scales for Qwen3's parameters as transformers holds them (a sparse layer's experts stacked:
    experts.gate_up_proj [experts, 2 * inter, hidden], experts.down_proj [experts, hidden, inter])."""
    h = config.hidden_size
    logit_std, tied = 4.0 / math.sqrt(h), config.tie_word_embeddings
    embed_std = 1.0 / 3.0 if tied else 1.0  # (tiny.py's tiny_weights says why a tied head needs these)

    def value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
        leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            return randn(*shape, std=embed_std)
        if name == "lm_head.weight":
            return randn(*shape, std=logit_std)
        if name == "model.norm.weight":
            gain = (torch.sign(randn(h, std=1.0)) * (logit_std / embed_std)) if tied else 1.0
            return around_one(shape, randn) * gain
        if name.endswith(".bias"):
            return randn(*shape, std=0.2)
        if leaf in ("q_norm", "k_norm"):  # (the module docstring says why 1.5)
            return 1.5 * around_one(shape, randn)
        if leaf in ("input_layernorm", "post_attention_layernorm"):
            return around_one(shape, randn)
        if leaf in ("q_proj", "k_proj") or name.endswith("mlp.gate.weight"):  # sharp attention; decisive routing
            return projection(shape, randn, gain=2.0)
        if leaf in ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"):
            return projection(shape, randn)
        raise ValueError(f"tiny Qwen3: no value rule for transformers' parameter {name!r}; add one")
    return value
