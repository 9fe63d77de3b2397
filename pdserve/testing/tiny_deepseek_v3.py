"""Tiny random-weight DeepSeek-V3 models (latent attention + sigmoid-routed MoE with shared experts), written as
real Hugging Face directories that transformers' DeepseekV3ForCausalLM and pdserve both load.

`make_tiny_deepseek_v3(dir)`: hidden 64, 3 layers (layer 0 dense, layers 1-2 MoE), 4 heads; q through a rank-32
LoRA (q_lora_rank=None: one q_proj), a 32-dim KV latent and 8 RoPE dims (so the cache keeps 40 values per
token and layer), 16 nope and 16 value dims per head; 8 experts of 32 in 4 groups, top 2 within the best 2
groups, one shared expert, routed_scaling_factor 2.5, RoPE interleaved as DeepSeek's checkpoints have it.
`rope_scaling` takes a yarn dict ({"type": "yarn", "factor", "original_max_position_embeddings", "mscale",
"mscale_all_dim", ...}).

Scales as tiny.py: each branch at unit scale. q and the latent's norm weight at twice unit scale make attention
sharp enough that greedy decoding does not lock into a loop; router weights at twice unit scale and a small
random score bias make routing decisive (near-ties would let rounding pick another expert).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from pdserve.testing.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer, write_model_dir

SHAPE = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1}


def make_tiny_deepseek_v3(out_dir: str | os.PathLike, *, num_layers: int = 3, hidden_size: int = 64, num_heads: int = 4,
                          intermediate_size: int = 128, vocab_size: int = 512, max_position_embeddings: int = 2048,
                          rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                          dtype: torch.dtype = torch.float32, shape: dict[str, Any] | None = None) -> Path:
    """`shape` overrides SHAPE's config keys (q_lora_rank, kv_lora_rank, n_routed_experts, ...)."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": rope_scaling, "rope_interleave": True, "attention_bias": False,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID, "torch_dtype": str(dtype).removeprefix("torch."), **SHAPE, **(shape or {}),
    }
    return write_model_dir(out_dir, cfg, _weights(cfg, seed), build_tiny_tokenizer(vocab_size, "llama"),
                           max_position_embeddings, dtype)


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f, std=1.0 / math.sqrt(in_f))

    h, heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    q_lora, kv_lora, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v, experts, inter = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    w = {"model.embed_tokens.weight": randn(vocab, h, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w[p + "input_layernorm.weight"] = 1.0 + randn(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(h, std=0.1)
        if q_lora:
            w[a + "q_a_proj.weight"] = linear(q_lora, h)
            w[a + "q_a_layernorm.weight"] = 1.0 + randn(q_lora, std=0.1)
            w[a + "q_b_proj.weight"] = 2.0 * linear(heads * (nope + rope), q_lora)
        else:
            w[a + "q_proj.weight"] = 2.0 * linear(heads * (nope + rope), h)
        kv_a = linear(kv_lora + rope, h)
        kv_a[kv_lora:] *= 2.0  # the RoPE key, shared by every head, at twice unit scale too
        w[a + "kv_a_proj_with_mqa.weight"] = kv_a
        w[a + "kv_a_layernorm.weight"] = 2.0 * (1.0 + randn(kv_lora, std=0.1))
        w[a + "kv_b_proj.weight"] = linear(heads * (nope + v), kv_lora)
        w[a + "o_proj.weight"] = linear(h, heads * v)
        if i < cfg["first_k_dense_replace"]:
            mlp = {"": cfg["intermediate_size"]}
        else:
            w[m + "gate.weight"] = 2.0 * linear(experts, h)
            w[m + "gate.e_score_correction_bias"] = randn(experts, std=0.1)
            mlp = {f"experts.{e}.": inter for e in range(experts)}
            mlp["shared_experts."] = inter * cfg["n_shared_experts"]
        for name, size in mlp.items():
            w[f"{m}{name}gate_proj.weight"] = linear(size, h)
            w[f"{m}{name}up_proj.weight"] = linear(size, h)
            w[f"{m}{name}down_proj.weight"] = linear(h, size)
    w["model.norm.weight"] = 1.0 + randn(h, std=0.1)
    w["lm_head.weight"] = randn(vocab, h, std=4.0 / math.sqrt(h))
    return w
