"""Tiny random-weight models saved as real Hugging Face directories.

`make_tiny_model(dir, num_layers=3, num_heads=6, num_kv_heads=2, arch="qwen2")` writes config.json,
model.safetensors, tokenizer.json, tokenizer_config.json (with a ChatML chat template) and
generation_config.json, exactly as `save_pretrained` would, so the engine's loader, transformers
and vLLM all read the same files. Every tensor is random but seeded: the same arguments give the
same bytes.

Weights are scaled so each residual branch contributes at unit scale and the final logits have a
standard deviation of a few units. With the usual 0.02 init every logit is near zero, greedy decoding
repeats one token, and a test comparing token streams would pass even with a broken attention.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer

from pdserve.testing.tiny_hybrid import hybrid_config_extras, hybrid_weights
from pdserve.testing.tiny_qwen3 import QWEN3_ARCHS, qwen3_config_extras, save_qwen3
from pdserve.testing.tiny_tokenizer import (  # noqa: F401 (re-exported: tests import them from here)
    BOS_TOKEN,
    BOS_TOKEN_ID,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    MIN_VOCAB_SIZE,
    QWEN2_SPLIT,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    build_tiny_tokenizer,
    write_tokenizer_files,
)
from pdserve.weights.hf_dir import (
    CONFIG_FILE,
    ShardedWriter,
    write_json,
)

Arch = Literal["llama", "qwen2", "mistral", "qwen3_5", "qwen3", "qwen3_moe"]

_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_5": "Qwen3_5ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

def _check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} unsupported by tiny models; use rope_type='llama3' or None")
    need = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    if missing := need - rope_scaling.keys():
        raise ValueError(f"llama3 rope_scaling is missing {sorted(missing)}")


def tiny_config(
    *,
    arch: Arch,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    rope_scaling: dict[str, Any] | None,
    rope_theta: float,
    max_position_embeddings: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    moe_shape: dict[str, Any] | None = None,
    linear_shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json dict, in the legacy (rope_theta / rope_scaling) form real checkpoints use."""
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]],
        "model_type": "qwen3_5_text" if arch == "qwen3_5" else arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "qwen3_5":
        cfg.update(hybrid_config_extras(num_layers, head_dim, rope_theta, linear_shape))
    elif arch in QWEN3_ARCHS:
        cfg.update(qwen3_config_extras(arch, num_layers, moe_shape))
    elif arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        cfg.update(sliding_window=sliding_window)
    else:  # qwen2: with a window, the second half of the layers slides (those from max_window_layers on)
        cfg.update(use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                   max_window_layers=num_layers // 2 if sliding_window else num_layers)
    return cfg


def tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights under HF parameter names (see module docstring for the scales)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=0.1)

    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    # Hidden states reach lm_head RMS-normalised (~unit per element), so a head of std 4/sqrt(h)
    # gives logits ~N(0, 16). With tied embeddings the head is the embedding itself, and the token's
    # own embedding, still in the residual stream, scores sum_j g_j * e_j^2 > 0 and makes greedy
    # decoding repeat the last token. Two measures (chosen by measuring distinct greedy tokens):
    # a smaller embedding next to the unit-scale residual branches, and a final-norm gain g of
    # random sign, which cancels the bias in expectation while setting the logit scale.
    logit_std = 4.0 / math.sqrt(h)
    tied = cfg["tie_word_embeddings"]
    embed_std = 1.0 / 3.0 if tied else 1.0
    if tied:
        sign = torch.randint(0, 2, (h,), generator=g).float() * 2 - 1
        final_gain = sign * (logit_std / embed_std)
    else:
        final_gain = torch.ones(h)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, h, std=embed_std)}
    if cfg["model_type"] == "qwen3_5_text":
        return {**w, **hybrid_weights(cfg, randn, linear, logit_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        # q and k at twice unit scale: sharper, position-dependent attention; near-uniform attention
        # over a repeated token makes greedy decoding lock into a loop.
        w[p + "self_attn.q_proj.weight"] = 2.0 * linear(q_out, h)
        w[p + "self_attn.k_proj.weight"] = 2.0 * linear(kv_out, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, h)
        if cfg["model_type"] == "qwen2":
            w[p + "self_attn.q_proj.bias"] = randn(q_out, std=0.2)
            w[p + "self_attn.k_proj.bias"] = randn(kv_out, std=0.2)
            w[p + "self_attn.v_proj.bias"] = randn(kv_out, std=0.2)
        w[p + "self_attn.o_proj.weight"] = linear(h, q_out)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = norm(h) * final_gain
    if not tied:
        w["lm_head.weight"] = randn(vocab, h, std=logit_std)
    return w


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int | None = None,
    intermediate_size: int = 64,
    vocab_size: int = 512,
    arch: Arch = "llama",
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    moe_shape: dict[str, Any] | None = None,
    linear_shape: dict[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write a random-weight HF model directory to `out_dir` (created if needed) and return it.

    hidden_size defaults to num_heads * head_dim. rope_scaling takes a llama3 dict
    ({"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}). sliding_window: layers attend to only that many last
    positions (mistral: every layer; qwen2: the second half of them). arch="qwen3_5" is the hybrid
    Qwen3.5 text model (tiny_hybrid.py: every fourth layer full attention, the others Gated DeltaNet);
    "qwen3" and "qwen3_moe" add q/k norms and, for the MoE, 8 experts in every layer but layer 1, and are written
    by transformers' save_pretrained, in `max_shard_size` shards if given (tiny_qwen3.py);
    `moe_shape` overrides the MoE's config keys (num_experts, num_experts_per_tok, moe_intermediate_size, ...),
    `linear_shape` Qwen3.5's Gated DeltaNet keys (linear_num_key_heads, linear_key_head_dim, ...).
    """
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"arch={arch!r} unknown; choose one of {sorted(_ARCH_CLASSES)}")
    if min(num_layers, num_heads, num_kv_heads, head_dim, intermediate_size) < 1:
        raise ValueError("num_layers, num_heads, num_kv_heads, head_dim, intermediate_size must all be >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA groups)")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
    hidden_size = hidden_size if hidden_size is not None else num_heads * head_dim
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}: transformers refuses "
            "other configs, and tiny models exist to be compared with transformers"
        )
    _check_rope_scaling(rope_scaling)
    if sliding_window is not None and arch == "llama":
        raise ValueError("sliding_window: Llama has none; use arch='mistral' or 'qwen2'")
    tokenizer = build_tiny_tokenizer(vocab_size, arch)
    cfg = tiny_config(
        arch=arch,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=dict(rope_scaling) if rope_scaling is not None else None,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        moe_shape=moe_shape,
        linear_shape=linear_shape,
        dtype=dtype,
    )
    if arch in QWEN3_ARCHS:  # written by transformers' save_pretrained (tiny_qwen3.py)
        return save_qwen3(out_dir, cfg, seed=seed, dtype=dtype, tokenizer=tokenizer, max_shard_size=max_shard_size)
    if max_shard_size is not None:
        raise ValueError(f"max_shard_size: arch={arch!r}'s tiny model is one file (only qwen3 and qwen3_moe shard)")
    return write_model_dir(out_dir, cfg, tiny_weights(cfg, seed), tokenizer, max_position_embeddings, dtype)


def write_model_dir(out_dir: str | os.PathLike, cfg: dict[str, Any], weights: dict[str, torch.Tensor],
                    tokenizer: Tokenizer, max_position_embeddings: int, dtype: torch.dtype) -> Path:
    """A Hugging Face model directory as `save_pretrained` writes one: config, weights (in `dtype`), the
    tiny tokenizer with the ChatML template, and the generation config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out)
    for name, tensor in weights.items():
        writer.add(name, tensor.to(dtype))
    writer.close()
    write_json(out / CONFIG_FILE, cfg)
    write_tokenizer_files(out, tokenizer, max_position_embeddings)
    return out
