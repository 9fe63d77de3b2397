"""config.json files of published models at their real sizes, with no weights: written by transformers'
config class of the family (`save_pretrained`), never downloaded. `pdserve plan` sizes memory from them.

- deepseek_v3: `DeepseekV3Config()`'s defaults, which are DeepSeek-V3's sizes (61 layers, hidden 7168, 128
  heads, a 512 + 64 latent, 256 routed experts of 2048 and one shared, the first 3 layers dense, vocabulary
  129280), but for the context: 4096 positions, without the published YaRN scaling to 163840.
- qwen3_moe: Qwen3-30B-A3B's published sizes over `Qwen3MoeConfig()` (whose defaults are a 24-layer model):
  48 layers, hidden 2048, 32 query and 4 KV heads of 128, 128 experts of 768 with 8 routed a token.
- nemotron_h: NVIDIA-Nemotron-Nano-9B-v2's published sizes over `NemotronHConfig()`: 56 layers (27 Mamba2, 4
  attention, 25 MLP), hidden 4480, Mamba2 128 heads of 80 with a state of 128 in 8 groups, attention 40 query
  and 8 KV heads of 128, MLP 15680, vocabulary 131072, 131072 positions.
"""

from __future__ import annotations

import os
from pathlib import Path

QWEN3_30B_A3B = {"num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False}

NEMOTRON_NANO_9B_V2 = {"num_hidden_layers": 56,
                       "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
                       "hidden_size": 4480, "intermediate_size": 15680, "vocab_size": 131072,
                       "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
                       "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
                       "max_position_embeddings": 131072, "tie_word_embeddings": False}


def write_published_config(out_dir: str | os.PathLike, family: str) -> Path:
    """`out_dir`/config.json of `family` ("deepseek_v3", "qwen3_moe" or "nemotron_h") at its published sizes;
    returns out_dir."""
    from transformers import DeepseekV3Config, NemotronHConfig, Qwen3MoeConfig

    if family == "deepseek_v3":
        config, arch = DeepseekV3Config(), "DeepseekV3ForCausalLM"
    elif family == "qwen3_moe":
        config, arch = Qwen3MoeConfig(**QWEN3_30B_A3B), "Qwen3MoeForCausalLM"
    elif family == "nemotron_h":
        config, arch = NemotronHConfig(**NEMOTRON_NANO_9B_V2), "NemotronHForCausalLM"
    else:
        raise ValueError(f"no published config of {family!r}: deepseek_v3, qwen3_moe or nemotron_h")
    config.architectures = [arch]
    out = Path(out_dir)
    config.save_pretrained(out)
    return out
