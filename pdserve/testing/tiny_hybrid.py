"""The hybrid part of the tiny models: Qwen3.5's config keys and weights (`make_tiny_model(arch="qwen3_5")`).

Layers 3, 7, ... (every fourth) are gated full attention; the others are Gated DeltaNet with 2 key
heads and 4 value heads of 8 dims and a 4-tap conv. Norms are zero-centred (the weight scales by
1 + w), so their random weights are small around 0; the DeltaNet's gated norm scales by w itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

FULL_ATTENTION_EVERY = 4
LINEAR_SHAPE = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}


def hybrid_config_extras(num_layers: int, head_dim: int, rope_theta: float,
                         linear_shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Qwen3.5's config keys: layer_types, the Gated DeltaNet shape (LINEAR_SHAPE, or `linear_shape` over it)
    and RoPE on a quarter of each head."""
    kinds = ["full_attention" if i % FULL_ATTENTION_EVERY == FULL_ATTENTION_EVERY - 1 else "linear_attention"
             for i in range(num_layers)]
    return {"layer_types": kinds, "attention_bias": False, **LINEAR_SHAPE, **(linear_shape or {}),
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25},
            "rope_scaling": None}


def hybrid_weights(cfg: dict[str, Any], randn: Callable[..., torch.Tensor], linear: Callable[[int, int], torch.Tensor],
                   logit_std: float) -> dict[str, torch.Tensor]:
    """Every tensor but the embedding, under Qwen3_5ForCausalLM's names."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, taps = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    channels = 2 * nk * dk + nv * dv
    w: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = randn(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = randn(h, std=0.1)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = linear(channels, h)
            w[a + "in_proj_z.weight"] = linear(nv * dv, h)
            w[a + "in_proj_b.weight"] = linear(nv, h)
            w[a + "in_proj_a.weight"] = linear(nv, h)
            w[a + "conv1d.weight"] = randn(channels, 1, taps, std=1.0 / math.sqrt(taps))
            # decay rates exp(A_log) from 0.5 to 8: some heads remember long, some forget fast
            w[a + "A_log"] = torch.linspace(math.log(0.5), math.log(8.0), nv)
            w[a + "dt_bias"] = randn(nv, std=0.5)
            w[a + "norm.weight"] = 1.0 + randn(dv, std=0.1)
            w[a + "out_proj.weight"] = linear(h, nv * dv)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = 2.0 * linear(heads * 2 * d, h)
            w[a + "k_proj.weight"] = 2.0 * linear(kv_heads * d, h)
            w[a + "v_proj.weight"] = linear(kv_heads * d, h)
            w[a + "o_proj.weight"] = linear(h, heads * d)
            w[a + "q_norm.weight"] = randn(d, std=0.1)
            w[a + "k_norm.weight"] = randn(d, std=0.1)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = randn(h, std=0.1)
    w["lm_head.weight"] = randn(cfg["vocab_size"], h, std=logit_std)
    return w
