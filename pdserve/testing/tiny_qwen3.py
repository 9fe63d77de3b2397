"""The Qwen3 part of the tiny models (`make_tiny_model(arch="qwen3" | "qwen3_moe")`): config keys and the
tensors a Llama layer lacks.

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

from typing import Any, Callable

import torch

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


def is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    return (cfg["model_type"] == "qwen3_moe" and i not in cfg["mlp_only_layers"]
            and (i + 1) % cfg["decoder_sparse_step"] == 0)


def qwen3_layer_weights(cfg: dict[str, Any], i: int, randn: Callable[..., torch.Tensor],
                        linear: Callable[[int, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer i's q/k norms, the attention biases where attention_bias is set, and for a sparse layer its
    router and experts (under the checkpoints' per-expert names)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    w = {a + "q_norm.weight": 1.5 * (1.0 + randn(d, std=0.1)), a + "k_norm.weight": 1.5 * (1.0 + randn(d, std=0.1))}
    if cfg["attention_bias"]:
        w.update({a + "q_proj.bias": randn(q_out, std=0.2), a + "k_proj.bias": randn(kv_out, std=0.2),
                  a + "v_proj.bias": randn(kv_out, std=0.2), a + "o_proj.bias": randn(h, std=0.2)})
    if is_moe_layer(cfg, i):
        inter = cfg["moe_intermediate_size"]
        w[m + "gate.weight"] = 2.0 * linear(cfg["num_experts"], h)
        for e in range(cfg["num_experts"]):
            w[f"{m}experts.{e}.gate_proj.weight"] = linear(inter, h)
            w[f"{m}experts.{e}.up_proj.weight"] = linear(inter, h)
            w[f"{m}experts.{e}.down_proj.weight"] = linear(h, inter)
    return w
