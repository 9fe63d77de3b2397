"""Tiny random-weight Nemotron-H models (Mamba2 + attention + squared-ReLU MLP layers), written as real
Hugging Face directories that transformers' NemotronHForCausalLM and pdserve both load.

`make_tiny_nemotron_h(dir, pattern="M-*-M-")`: one layer per character, M a Mamba2 mixer, * attention,
- an MLP (the older `hybrid_override_pattern` notation). 8 Mamba heads of 8 channels in 2 groups of
16-dim B and C vectors, a 4-tap conv; weights scaled as in tiny.py so greedy decoding is not degenerate.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from pdserve.testing.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer, write_model_dir

_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
MAMBA = {"mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4}


def make_tiny_nemotron_h(out_dir: str | os.PathLike, *, pattern: str = "M-*-M-", hidden_size: int = 64,
                         num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                         vocab_size: int = 512, max_position_embeddings: int = 2048, seed: int = 0,
                         dtype: torch.dtype = torch.float32, mamba: dict | None = None) -> Path:
    """`mamba` overrides MAMBA's config keys (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, ...)."""
    if set(pattern) - set(_KINDS):
        raise ValueError(f"pattern {pattern!r}: one of {sorted(_KINDS)} per layer")
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "layers_block_type": [_KINDS[c] for c in pattern], "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "layer_norm_epsilon": 1e-5,
        "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
        "mlp_bias": False, "attention_bias": False, "time_step_min": 0.001, "chunk_size": 16,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "torch_dtype": str(dtype).removeprefix("torch."),
        **MAMBA, **(mamba or {}),
    }
    return write_model_dir(out_dir, cfg, _weights(cfg, seed), build_tiny_tokenizer(vocab_size, "llama"),
                           max_position_embeddings, dtype)


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return randn(out_f, in_f, std=1.0 / math.sqrt(in_f))

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    mh, mp, groups, n, taps = (cfg[k] for k in ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                                                 "conv_kernel"))
    inner, conv = mh * mp, mh * mp + 2 * groups * n
    w = {"model.embeddings.weight": randn(cfg["vocab_size"], h, std=1.0)}
    for i, kind in enumerate(cfg["layers_block_type"]):
        p = f"model.layers.{i}."
        w[p + "norm.weight"] = 1.0 + randn(h, std=0.1)
        if kind == "linear_attention":
            w[p + "mixer.in_proj.weight"] = linear(inner + conv + mh, h)
            w[p + "mixer.conv1d.weight"] = randn(conv, 1, taps, std=1.0 / math.sqrt(taps))
            w[p + "mixer.conv1d.bias"] = randn(conv, std=0.1)
            # decay rates exp(A_log) from 0.5 to 8: some heads remember long, some forget fast
            w[p + "mixer.A_log"] = torch.linspace(math.log(0.5), math.log(8.0), mh)
            w[p + "mixer.D"] = 1.0 + randn(mh, std=0.1)
            w[p + "mixer.dt_bias"] = randn(mh, std=0.5)
            w[p + "mixer.norm.weight"] = 1.0 + randn(inner, std=0.1)
            w[p + "mixer.out_proj.weight"] = linear(h, inner)
        elif kind == "full_attention":
            w[p + "mixer.q_proj.weight"] = 2.0 * linear(heads * d, h)
            w[p + "mixer.k_proj.weight"] = 2.0 * linear(kv * d, h)
            w[p + "mixer.v_proj.weight"] = linear(kv * d, h)
            w[p + "mixer.o_proj.weight"] = linear(h, heads * d)
        else:
            w[p + "mixer.up_proj.weight"] = linear(inter, h)
            w[p + "mixer.down_proj.weight"] = linear(h, inter) * 0.5  # relu^2 doubles the scale of a unit input
    w["model.norm_f.weight"] = 1.0 + randn(h, std=0.1)
    w["lm_head.weight"] = randn(cfg["vocab_size"], h, std=4.0 / math.sqrt(h))
    return w
