"""Tiny random-weight Qwen3.5 checkpoints as Qwen publishes the family: transformers' `save_pretrained` of the
vision-language class (tiny_published.py), Qwen3_5ForConditionalGeneration or, with `moe=True`,
Qwen3_5MoeForConditionalGeneration. config.json nests the text model under `text_config` beside a
`vision_config`; the text model's tensors are named `model.language_model.*`, the vision tower's
`model.visual.*`, the head `lm_head.weight`; the MoE's experts are stored one tensor per expert and projection
(as save_pretrained writes them by default) or fused (`fused_experts`). `vision=False` writes the text model's
own class instead (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM).

`make_tiny_qwen3_5(dir)`: 4 text layers (3 Gated DeltaNet, then gated attention: tiny_hybrid.py's shape), and
a vision tower of one block of width 16, never run: pdserve serves the text model. The MoE has 8 experts of
32, top 2, and a shared expert of 64 behind its sigmoid gate. Weights are scaled as tiny.py's docstring
explains; router weights at twice unit scale keep routing decisive (as tiny_qwen3.py's).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from pdserve.testing.tiny_hybrid import hybrid_config_extras
from pdserve.testing.tiny_published import Randn, around_one, projection, save_published
from pdserve.testing.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 1, "patch_size": 4,
          "num_position_embeddings": 16}


def make_tiny_qwen3_5(out_dir: str | os.PathLike, *, moe: bool = False, num_layers: int = 4, hidden_size: int = 64,
                      num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                      vocab_size: int = 512, max_position_embeddings: int = 2048, seed: int = 0,
                      dtype: torch.dtype = torch.float32, moe_shape: dict | None = None,
                      max_shard_size: int | str | None = None, fused_experts: bool = False,
                      vision: bool = True) -> Path:
    """`moe_shape` overrides MOE's config keys (moe only); `max_shard_size` (save_pretrained's) writes the
    weights in shards; `fused_experts` stores the experts as transformers holds them, one 3-D tensor per
    projection (save_original_format=False); `vision=False` writes the text model's class alone
    (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM: `model.*`, no text_config). `intermediate_size` is the dense
    model's MLP (the MoE has none)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if moe_shape and not moe:
        raise ValueError("moe_shape is for moe=True; the dense Qwen3.5 has no experts")
    extras = hybrid_config_extras(num_layers, head_dim, 10000.0)
    extras.pop("rope_scaling")
    # the published text_config's multimodal RoPE keys (transformers' default sections, [11, 11, 10], split 32
    # rotated frequencies; the tiny model rotates 2); text-only positions make it plain RoPE
    extras["rope_parameters"] |= {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
    text = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
            "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
            "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, **extras,
            **({**MOE, **(moe_shape or {})} if moe else {"intermediate_size": intermediate_size})}
    if vision:
        config_class, arch = ((Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration") if moe else
                              (Qwen3_5Config, "Qwen3_5ForConditionalGeneration"))
        config = config_class(text_config=text, vision_config={**VISION, "out_hidden_size": hidden_size},
                              architectures=[arch], bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    else:
        config_class, arch = ((Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM") if moe else
                              (Qwen3_5TextConfig, "Qwen3_5ForCausalLM"))
        config = config_class(**text, architectures=[arch])
    return save_published(out_dir, config, _value, seed=seed, dtype=dtype,
                          tokenizer=build_tiny_tokenizer(vocab_size, "qwen2"),
                          max_position_embeddings=max_position_embeddings, max_shard_size=max_shard_size,
                          original_format=not fused_experts)


def _value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
    """A Qwen3_5(Moe)ForConditionalGeneration parameter, named as transformers holds it (the MoE's experts
    stacked: mlp.experts.gate_up_proj [experts, 2 * inter, hidden], mlp.experts.down_proj [experts, hidden,
    inter]). Norms are zero-centred (scale 1 + w), so theirs are small around 0."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
    if name.startswith("model.visual."):  # never run by either side of a text-only test
        return randn(*shape, std=0.02)
    if name.endswith("embed_tokens.weight"):
        return randn(*shape, std=1.0)
    if name == "lm_head.weight":
        return randn(*shape, std=4.0 / math.sqrt(shape[1]))
    if name.endswith("linear_attn.norm.weight"):  # the DeltaNet's gated norm scales by w itself
        return around_one(shape, randn)
    if leaf in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm"):
        return randn(*shape, std=0.1)
    if leaf == "A_log":  # decay rates exp(A_log) from 0.5 to 8: some heads remember long, some forget fast
        return torch.linspace(math.log(0.5), math.log(8.0), shape[0])
    if leaf == "dt_bias":
        return randn(*shape, std=0.5)
    if leaf == "conv1d":  # weight [channels, 1, taps]
        return randn(*shape, std=1.0 / math.sqrt(shape[-1]))
    if leaf in ("q_proj", "k_proj") or name.endswith("mlp.gate.weight"):  # sharp attention; decisive routing
        return projection(shape, randn, gain=2.0)
    if leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "v_proj", "o_proj", "gate_proj",
                "up_proj", "down_proj", "gate_up_proj", "shared_expert_gate"):
        return projection(shape, randn)
    raise ValueError(f"tiny Qwen3.5: no value rule for transformers' parameter {name!r}; add one")

