"""One tiny checkpoint per family in its published format: `FAMILIES[name](out_dir, max_shard_size)` writes it by
transformers' `save_pretrained` of the class its publisher ships (tiny_published.py's `save_published`), in bf16
as the publishers ship them, sharded by `max_shard_size`, and returns its directory.

- llama (LlamaForCausalLM, untied head), qwen2 (Qwen2ForCausalLM: q/k/v biases, tied head): the dense rule
  below, tiny.py's scales (shared with Mistral, whose class is Llama's with a window).
- qwen3, qwen3_moe (Qwen3ForCausalLM, Qwen3MoeForCausalLM): tiny_qwen3.py's rule.
- nemotron_h (NemotronHForCausalLM, Mamba2 + attention + MLP layers, `backbone.*`): tiny_nemotron_h.py's rule.
- deepseek_v3 (DeepseekV3ForCausalLM, one dense layer and one MoE layer): the DeepSeek rule below,
  tiny_deepseek_v3.py's scales. Its router's `e_score_correction_bias` is a buffer, not a parameter, so it
  stays transformers' zeros.
- deepseek_v3_fp8: that checkpoint with the MTP layer DeepSeek ships, its projections quantized to FP8 in
  [16, 24] blocks as DeepSeek quantizes them in [128, 128] (fp8_checkpoint.py), in 3 shards whatever
  `max_shard_size`; `oracle_dir` gives the dequantized copy transformers loads.

- qwen3_5, qwen3_5_moe (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: the
  vision-language checkpoints Qwen publishes, `model.language_model.*` beside a one-block vision tower):
  tiny_qwen3_5.py's rule.
- nemotron_h_moe (NemotronHForCausalLM with Nemotron 3's MoE layers: Mamba2, MoE, attention, MoE): the
  Nemotron-H rule.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import torch

from pdserve.testing.fp8_checkpoint import (
    dequantized_copy,
    quantize_checkpoint,
    with_deepseek_mtp_layer,
)
from pdserve.testing.tiny import build_tiny_tokenizer, make_tiny_model, tiny_config
from pdserve.testing.tiny_deepseek_v3 import SHAPE as DEEPSEEK_SHAPE
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.testing.tiny_published import (
    Randn,
    ValueRule,
    around_one,
    projection,
    save_published,
)
from pdserve.testing.tiny_qwen3_5 import make_tiny_qwen3_5
from pdserve.testing.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID

Writer = Callable[[Path, "int | str"], Path]
DTYPE = torch.bfloat16
VOCAB, HIDDEN, MAX_POSITIONS = 512, 64, 2048


def _leaf(name: str) -> str:
    """The module a parameter belongs to: `q_proj` of `model.layers.0.self_attn.q_proj.weight`."""
    return name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]


def _head_and_norm(config: Any) -> ValueRule:
    """The embedding, lm_head and final norm at tiny.py's scales: logits ~N(0, 16); a tied head (the embedding
    itself) smaller, behind a final norm gain of random sign (tiny.py's tiny_weights says why)."""
    logit_std, tied = 4.0 / math.sqrt(config.hidden_size), config.tie_word_embeddings
    embed_std = 1.0 / 3.0 if tied else 1.0

    def value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
        if name.endswith("embed_tokens.weight"):
            return randn(*shape, std=embed_std)
        if name == "lm_head.weight":
            return randn(*shape, std=logit_std)
        gain = torch.sign(randn(*shape, std=1.0)) * (logit_std / embed_std) if tied else 1.0
        return around_one(shape, randn) * gain
    return value


def dense_value_rule(config: Any) -> ValueRule:
    """A Llama-like dense decoder (Llama, Qwen2, Mistral) as transformers holds it: q and k at twice unit scale
    (sharp, position-dependent attention), the other projections at unit scale, biases small."""
    ends = _head_and_norm(config)

    def value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
        leaf = _leaf(name)
        if name.endswith("embed_tokens.weight") or name in ("lm_head.weight", "model.norm.weight"):
            return ends(name, shape, randn)
        if name.endswith(".bias"):
            return randn(*shape, std=0.2)
        if leaf in ("input_layernorm", "post_attention_layernorm"):
            return around_one(shape, randn)
        if leaf in ("q_proj", "k_proj"):
            return projection(shape, randn, gain=2.0)
        if leaf in ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            return projection(shape, randn)
        raise ValueError(f"tiny dense decoder: no value rule for transformers' parameter {name!r}; add one")
    return value


def deepseek_value_rule(config: Any) -> ValueRule:
    """DeepSeek-V3 as transformers holds it (a MoE layer's experts stacked: experts.gate_up_proj
    [experts, 2 * inter, hidden], experts.down_proj [experts, hidden, inter]): q and the RoPE key at twice unit
    scale and the latent's norm near 2 (sharp attention), the router at twice unit scale (decisive routing)."""
    ends = _head_and_norm(config)
    latent = config.kv_lora_rank

    def value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
        leaf = _leaf(name)
        if name.endswith("embed_tokens.weight") or name in ("lm_head.weight", "model.norm.weight"):
            return ends(name, shape, randn)
        if leaf == "kv_a_layernorm":
            return 2.0 * around_one(shape, randn)
        if leaf in ("input_layernorm", "post_attention_layernorm", "q_a_layernorm"):
            return around_one(shape, randn)
        if leaf == "kv_a_proj_with_mqa":  # [latent | RoPE key]: the key, shared by every head, at twice
            w = projection(shape, randn)
            w[latent:] *= 2.0
            return w
        if leaf in ("q_b_proj", "q_proj") or name.endswith("mlp.gate.weight"):
            return projection(shape, randn, gain=2.0)
        if leaf in ("q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"):
            return projection(shape, randn)
        raise ValueError(f"tiny DeepSeek-V3: no value rule for transformers' parameter {name!r}; add one")
    return value


def _dense(arch: str, tied: bool) -> Writer:
    def write(out_dir: Path, max_shard_size: int | str) -> Path:
        import transformers

        cfg = tiny_config(arch=arch, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=HIDDEN,
                          intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=tied, rope_scaling=None,
                          rope_theta=10000.0, max_position_embeddings=MAX_POSITIONS, dtype=DTYPE)
        config_class = getattr(transformers, f"{cfg['architectures'][0].removesuffix('ForCausalLM')}Config")
        config = config_class.from_dict({k: v for k, v in cfg.items() if k != "torch_dtype"})
        return save_published(out_dir, config, dense_value_rule(config), seed=0, dtype=DTYPE,
                              tokenizer=build_tiny_tokenizer(VOCAB, arch), max_position_embeddings=MAX_POSITIONS,
                              max_shard_size=max_shard_size)
    return write


def _qwen3(arch: str, num_layers: int) -> Writer:
    def write(out_dir: Path, max_shard_size: int | str) -> Path:
        return make_tiny_model(out_dir, arch=arch, num_layers=num_layers, dtype=DTYPE, max_shard_size=max_shard_size)
    return write


def _nemotron_h(pattern: str) -> Writer:
    def write(out_dir: Path, max_shard_size: int | str) -> Path:
        return make_tiny_nemotron_h(out_dir, pattern=pattern, dtype=DTYPE, max_shard_size=max_shard_size)
    return write


def _qwen3_5(moe: bool) -> Writer:
    def write(out_dir: Path, max_shard_size: int | str) -> Path:
        return make_tiny_qwen3_5(out_dir, moe=moe, dtype=DTYPE, max_shard_size=max_shard_size)
    return write


def _deepseek_v3(out_dir: Path, max_shard_size: int | str) -> Path:
    """Two layers: layer 0 dense, layer 1 MoE (8 experts in 4 groups, one shared), tiny_deepseek_v3.py's shape."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6, rope_interleave=True, tie_word_embeddings=False, num_nextn_predict_layers=0,
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, **DEEPSEEK_SHAPE)
    return save_published(out_dir, config, deepseek_value_rule(config), seed=0, dtype=DTYPE,
                          tokenizer=build_tiny_tokenizer(VOCAB, "llama"), max_position_embeddings=MAX_POSITIONS,
                          max_shard_size=max_shard_size)


def _deepseek_v3_fp8(out_dir: Path, max_shard_size: int | str) -> Path:
    out_dir = Path(out_dir)
    src = _deepseek_v3(out_dir.with_name(out_dir.name + "-bf16"), max_shard_size)
    mtp = with_deepseek_mtp_layer(src, out_dir.with_name(out_dir.name + "-mtp"))
    return quantize_checkpoint(mtp, out_dir, block=(16, 24))


FAMILIES: dict[str, Writer] = {
    "llama": _dense("llama", tied=False),
    "qwen2": _dense("qwen2", tied=True),
    "qwen3": _qwen3("qwen3", num_layers=1),
    "qwen3_moe": _qwen3("qwen3_moe", num_layers=2),
    "qwen3_5": _qwen3_5(moe=False),
    "qwen3_5_moe": _qwen3_5(moe=True),
    "nemotron_h": _nemotron_h("M-*"),
    "nemotron_h_moe": _nemotron_h("ME*E"),
    "deepseek_v3": _deepseek_v3,
    "deepseek_v3_fp8": _deepseek_v3_fp8,
}


def oracle_dir(model_dir: str | os.PathLike) -> Path:
    """The directory transformers loads to give `model_dir`'s tokens: itself, or for an FP8 checkpoint its
    dequantized copy beside it (each weight multiplied out by a plain loop over its blocks, fp8_checkpoint.py)."""
    model_dir = Path(model_dir)
    if '"quantization_config"' not in (model_dir / "config.json").read_text():
        return model_dir
    return dequantized_copy(model_dir, model_dir.with_name(model_dir.name + "-dequantized"))
