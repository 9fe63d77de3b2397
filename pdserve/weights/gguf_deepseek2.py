"""llama.cpp's `deepseek2` GGUF architecture -> a Hugging Face DeepseekV3ForCausalLM directory (gguf_convert.py
writes it). What llama.cpp's converter changed, undone here:

* latent attention's kv_b_proj [heads * (nope + v), kv_lora] is stored split for the absorbed form, as
  `attn_k_b` [heads, kv_lora, nope] (each head's K block, transposed) and `attn_v_b` [heads, v, kv_lora]
  (torch order); joined back per layer. A file that keeps `attn_kv_b` whole is taken as it is.
* the KV head count is written as 1 (MLA read as MQA over the latent); the HF config has one per query head;
* the head sizes: `attention.key_length` / `value_length` are the latent's (kv_lora + rope, kv_lora), the
  per-head ones `key_length_mla` (nope + rope) and `value_length_mla` (v) (older files: the plain keys are the
  per-head sizes);
* the router's score bias `e_score_correction_bias` is `exp_probs_b.bias`; the shared experts are `*_shexp`.

The RoPE dims stay in the checkpoint's interleaved order (llama.cpp's deepseek2 rotates pairs), so the config
says rope_interleave as DeepSeek's own does; yarn scaling comes back from the rope.scaling keys (_yarn). Only DeepSeek-V3's routing is served (sigmoid scores with the bias,
`expert_gating_func` 2); a DeepSeek-V2 file (softmax routing) is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

ARCH = "deepseek2"
SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid scores (1: softmax)

# Per-layer GGUF tensor suffix -> HF suffix under model.layers.N., beyond gguf_convert's shared names.
LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SCORE_BIAS_RE = re.compile(r"^blk\.(\d+)\.exp_probs_b\.bias$")
_KV_HALF_RE = re.compile(r"^blk\.(\d+)\.attn_([kv])_b\.weight$")


def _get(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if default is None and f"{ARCH}.{key}" not in meta:
        raise ValueError(f"GGUF metadata lacks {ARCH}.{key!r}; the DeepSeek file is incomplete")
    return meta.get(f"{ARCH}.{key}", default)


def deepseek2_config(meta: Mapping[str, Any], tensors: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """The DeepseekV3 keys of config.json (beyond what every architecture has) from a deepseek2 file."""
    routed = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    gating = int(_get(meta, "expert_gating_func", 1))
    if gating != SIGMOID or any(f"blk.{i}.exp_probs_b.bias" not in tensors for i in routed):
        raise ValueError(f"this {ARCH} GGUF routes its experts by softmax (expert_gating_func {gating}) or has no "
                         "score bias (exp_probs_b): DeepSeek-V2's routing, which pdserve does not serve; "
                         "DeepSeek-V3 files (sigmoid scores with a bias) are supported")
    rope = int(_get(meta, "rope.dimension_count"))
    if f"{ARCH}.attention.key_length_mla" in meta:
        qk_head, v_head = int(_get(meta, "attention.key_length_mla")), int(_get(meta, "attention.value_length_mla"))
    else:
        qk_head, v_head = int(_get(meta, "attention.key_length")), int(_get(meta, "attention.value_length"))
    first_dense = int(_get(meta, "leading_dense_block_count", 0))
    if routed != list(range(first_dense, n_layers)):
        raise ValueError(f"GGUF {ARCH}: the layers with a router are {routed}, but leading_dense_block_count "
                         f"{first_dense} says layers {first_dense}..{n_layers - 1}")
    heads = int(_get(meta, "attention.head_count"))
    q_lora = meta.get(f"{ARCH}.attention.q_lora_rank")
    cfg = {
        "num_key_value_heads": heads,
        "q_lora_rank": int(q_lora) if q_lora is not None else None,
        "kv_lora_rank": int(_get(meta, "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk_head - rope,
        "v_head_dim": v_head,
        "head_dim": rope,  # transformers' DeepseekV3Config: the RoPE width
        "rope_interleave": True,
        "attention_bias": False,
        "first_k_dense_replace": first_dense,
        "n_routed_experts": int(_get(meta, "expert_count")),
        "num_experts_per_tok": int(_get(meta, "expert_used_count")),
        "moe_intermediate_size": int(_get(meta, "expert_feed_forward_length")),
        "n_shared_experts": int(_get(meta, "expert_shared_count", 0)),
        "routed_scaling_factor": float(_get(meta, "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(_get(meta, "expert_weights_norm", False)),
        "n_group": int(_get(meta, "expert_group_count", 1)),
        "topk_group": int(_get(meta, "expert_group_used_count", 1)),
        "num_nextn_predict_layers": 0,
    }
    scaling = meta.get(f"{ARCH}.rope.scaling.type", "none")
    if scaling == "yarn":
        cfg["rope_scaling"] = _yarn(meta)
    elif scaling != "none":
        raise NotImplementedError(f"GGUF {ARCH} with rope scaling {scaling!r}: DeepSeek files scale RoPE by yarn or "
                                  "not at all")
    return cfg


def _yarn(meta: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' yarn rope_scaling. The file keeps 0.1 * mscale_all_dim (yarn_log_multiplier) and not mscale,
    which is taken equal to it, as DeepSeek-V3's config has them (both 1.0): the attention factor of cos and sin
    is then 1 and the softmax takes the whole mscale_all_dim correction."""
    mscale_all_dim = round(float(_get(meta, "rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
    return {"type": "yarn", "rope_type": "yarn", "factor": float(_get(meta, "rope.scaling.factor")),
            "original_max_position_embeddings": int(_get(meta, "rope.scaling.original_context_length")),
            "beta_fast": float(_get(meta, "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(_get(meta, "rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale_all_dim, "mscale_all_dim": mscale_all_dim}


class Deepseek2Tensors:
    """The HF tensors of a deepseek2 file's tensors, as gguf_convert's loop meets them: the score bias renamed,
    and each layer's attn_k_b / attn_v_b held until both are in, then given back as one kv_b_proj."""

    def __init__(self, cfg: Mapping[str, Any]):
        self.heads, self.nope, self.v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        self.halves: dict[int, dict[str, torch.Tensor]] = {}

    def take(self, gguf_name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[(HF name, tensor)], or None when the name is not one of deepseek2's own (gguf_convert maps it)."""
        m = _SCORE_BIAS_RE.match(gguf_name)
        if m:
            return [(f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias", w)]
        m = _KV_HALF_RE.match(gguf_name)
        if m is None:
            return None
        layer, half = int(m.group(1)), m.group(2)
        want = (self.heads, w.shape[1], self.nope) if half == "k" else (self.heads, self.v, w.shape[-1])
        if w.dim() != 3 or tuple(w.shape) != want:
            raise ValueError(f"GGUF tensor {gguf_name!r} has shape {tuple(w.shape)}; expected {want} "
                             "(heads, kv_lora, nope) for attn_k_b or (heads, v, kv_lora) for attn_v_b")
        both = self.halves.setdefault(layer, {})
        both[half] = w
        if len(both) < 2:
            return []
        del self.halves[layer]
        kv_b = torch.cat([both["k"].transpose(1, 2), both["v"]], dim=1)  # [heads, nope + v, kv_lora]
        return [(f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1]).contiguous())]

    def finish(self) -> None:
        if self.halves:
            raise ValueError(f"GGUF {ARCH}: layers {sorted(self.halves)} have attn_k_b or attn_v_b but not both; "
                             "the file is incomplete")
