"""GGUF file -> Hugging Face model directory (dequantized safetensors, config, tokenizer, template).

The engine has one loading path, the HF directory; a GGUF is converted into one first. What the
conversion undoes, relative to how llama.cpp wrote the file:

* quantization: every tensor is dequantized with `gguf.quants.dequantize` (float32), then cast;
* tensor names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...; a MoE layer's
  experts, stacked in one tensor per projection (`blk.N.ffn_gate_exps.weight`: [experts, out, in]), are
  split back into the checkpoints' per-expert tensors (`model.layers.N.mlp.experts.E.gate_proj.weight`);
* the rotary permutation: for the `llama` architecture llama.cpp reorders each head's rows of
  attn_q / attn_k from HF's "rotate half" layout [x0 .. x(d/2-1) | x(d/2) .. x(d-1)] to interleaved
  pairs [x0 x(d/2) x1 x(d/2+1) ...]; we invert that (qwen2 files keep HF's layout);
* metadata: config.json, generation_config.json, tokenizer.json and tokenizer_config.json
  (see gguf_tokenizer.py) are rebuilt from the GGUF key/value fields;
* DeepSeek-V3 (`deepseek2`): latent attention's split kv_b, its head sizes and the router's score bias
  (gguf_deepseek2.py).

The result loads in transformers and gives the same tensors as transformers' own
`from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm.auto import tqdm

from pdserve.weights.gguf_deepseek2 import ARCH as DEEPSEEK2
from pdserve.weights.gguf_deepseek2 import LAYER_NAMES as DEEPSEEK2_LAYER_NAMES
from pdserve.weights.gguf_deepseek2 import Deepseek2Tensors, deepseek2_config
from pdserve.weights.gguf_tokenizer import build_tokenizer_files
from pdserve.weights.hf_dir import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    ShardedWriter,
    write_json,
)

# GGUF architecture -> (HF architecture class, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    DEEPSEEK2: ("DeepseekV3ForCausalLM", "deepseek_v3"),
}

# Per-layer GGUF tensor suffix -> HF suffix under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3: RMSNorm of each q and k head
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    **DEEPSEEK2_LAYER_NAMES,
}
# A MoE layer's experts, one GGUF tensor per projection: [experts, out, in] in torch order.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp stores llama3 rope frequency factors as a tensor; config.json carries them as rope_scaling.
_ROPE_FREQS = "rope_freqs.weight"


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF key/value fields as Python values (str, int, float, bool or lists of them)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def hf_tensor_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor; ValueError for tensors this converter does not know.
    A stacked experts tensor names `...mlp.experts.{}.<proj>.weight`, formatted with each expert's index."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_NAMES and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_EXPERT_NAMES[m.group(2)]}.weight"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in pdserve's converter "
        f"(known: {sorted(_GLOBAL_NAMES)} and blk.N.{{{','.join([*_LAYER_NAMES, *_EXPERT_NAMES])}}}); "
        "this GGUF holds a model family pdserve does not support"
    )


def hf_tensors(gguf_name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one GGUF tensor holds: itself renamed, or one per expert of a stacked experts tensor."""
    name = hf_tensor_name(gguf_name)
    if "{}" not in name:
        return [(name, w)]
    if w.dim() != 3:
        raise ValueError(f"GGUF tensor {gguf_name!r} has shape {tuple(w.shape)}; stacked experts are "
                         "[experts, out, in]")
    return [(name.format(e), w[e].contiguous()) for e in range(w.shape[0])]


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head q/k row permutation (works for weights [out, in] and biases [out]).

    llama.cpp: w.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2)  (rotate-half -> interleaved pairs)
    inverse:   w.reshape(n_heads, d/2, 2, ...).swapaxes(1, 2)
    """
    out = w.shape[0]
    if out % (2 * n_heads):
        raise ValueError(f"rotary rows {out} are not divisible by 2 * heads ({n_heads})")
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _get(meta: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if required:
        raise ValueError(f"GGUF metadata lacks {key!r}; the file is incomplete or not a decoder LLM")
    return default


def _f32(x: float) -> float:
    """The shortest decimal for a value stored as float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def llama3_rope_scaling(freq_factors: np.ndarray, rope_theta: float, head_dim: int,
                        original_context: int) -> dict[str, Any]:
    """Recover the llama3 rope_scaling dict from llama.cpp's per-frequency divisors.

    llama3 divides inverse frequency i by: 1 when wavelen_i < L/high, `factor` when wavelen_i > L/low,
    and otherwise 1 / ((1 - s)/factor + s) with s = (L/wavelen_i - low) / (high - low). The smooth
    entries give s_i linear in 1/wavelen_i: s = a/wavelen + b with a = L/(high-low), b = -low/(high-low),
    so with L known, (factor, low, high) follow. The result is checked by recomputing the divisors.
    """
    f = freq_factors.astype(np.float64)
    factor = float(f.max())
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    if factor <= 1.0 or len(f) != len(inv_freq):
        raise ValueError(f"rope_freqs has {len(f)} entries with max {factor}; expected {len(inv_freq)} with max > 1")
    smooth = (f > 1.0 + 1e-6) & (f < factor - 1e-6 * factor)
    if smooth.sum() < 2:
        raise NotImplementedError("rope_freqs has fewer than two smoothed frequencies: llama3 parameters are ambiguous")
    s = (1.0 / f[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(1.0 / wavelen[smooth], s, 1)
    low = -b * original_context / a
    high = low + original_context / a
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(original_context),
    }
    ratio = original_context / wavelen
    s_all = np.clip((ratio - scaling["low_freq_factor"])
                    / (scaling["high_freq_factor"] - scaling["low_freq_factor"]), 0, 1)
    rebuilt = 1.0 / ((1 - s_all) / factor + s_all)
    if not np.allclose(rebuilt, f, rtol=1e-3):
        raise ValueError("rope_freqs does not follow the llama3 formula; this rope scaling is not supported")
    return scaling


def build_config(meta: Mapping[str, Any], tensors: Mapping[str, ReaderTensor], dtype: torch.dtype) -> dict[str, Any]:
    """config.json for the GGUF's architecture, from its metadata and tensor inventory."""
    arch = _get(meta, "general.architecture", required=True)
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)}); "
            "use a Llama-family model (Llama, Mistral, SmolLM2, Qwen2), Qwen3, Qwen3-MoE or DeepSeek-V3"
        )
    cls, model_type = _ARCHS[arch]
    name = str(_get(meta, "general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        # llama.cpp writes Mistral as arch "llama"; the weights and math are Llama's.
        cls, model_type = "MistralForCausalLM", "mistral"
    hidden = int(_get(meta, f"{arch}.embedding_length", required=True))
    heads = int(_get(meta, f"{arch}.attention.head_count", required=True))
    kv_heads = int(_get(meta, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_get(meta, f"{arch}.attention.key_length", hidden // heads))
    if model_type == "deepseek_v3":  # key_length is the latent's; the head sizes are deepseek2_config's
        head_dim = int(_get(meta, f"{arch}.rope.dimension_count", required=True))
    rotary_dim = int(_get(meta, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise NotImplementedError(f"partial rotary (rope.dimension_count={rotary_dim} < head_dim={head_dim}) "
                                  "is not supported")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims are [hidden, vocab]
    if int(_get(meta, f"{arch}.vocab_size", vocab)) != vocab:
        raise ValueError(f"GGUF says vocab_size={meta[f'{arch}.vocab_size']} but token_embd has {vocab} rows")
    context = int(_get(meta, f"{arch}.context_length", 2048))
    rope_theta = _f32(_get(meta, f"{arch}.rope.freq_base", 10000.0))
    n_layers = int(_get(meta, f"{arch}.block_count", required=True))
    moe = _moe_config(meta, tensors, arch, n_layers) if model_type == "qwen3_moe" else \
        deepseek2_config(meta, tensors, n_layers) if model_type == "deepseek_v3" else {}
    # A MoE file may leave out the dense MLP's width; then the experts' stands in.
    dense_ff = _get(meta, f"{arch}.feed_forward_length", moe.get("moe_intermediate_size"), required=not moe)
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(dense_ff),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _f32(_get(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf_key] = int(meta[f"tokenizer.ggml.{key}"])
    scaling_type = _get(meta, f"{arch}.rope.scaling.type")
    original = int(_get(meta, f"{arch}.rope.scaling.original_context_length", 0))
    if _ROPE_FREQS in tensors:
        factors = dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type).reshape(-1)
        cfg["rope_scaling"] = llama3_rope_scaling(factors, rope_theta, head_dim, original or 8192)
    elif scaling_type in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": scaling_type,
                               "factor": _f32(_get(meta, f"{arch}.rope.scaling.factor", 1.0))}
        if original:
            cfg["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling_type not in (None, "none"):
        raise NotImplementedError(f"rope scaling type {scaling_type!r} is not supported")
    if model_type == "llama":
        cfg.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
    elif model_type == "mistral":
        cfg.update(sliding_window=None)
    elif model_type == "deepseek_v3":
        cfg.update(moe)
        del cfg["head_dim"]  # transformers' DeepseekV3Config derives it (the RoPE width)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    if model_type in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias="blk.0.attn_q.bias" in tensors, **moe)
    return cfg


def _moe_config(meta: Mapping[str, Any], tensors: Mapping[str, ReaderTensor], arch: str,
                n_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert keys. A layer without a router (`ffn_gate_inp`) keeps a dense MLP
    (`mlp_only_layers`); llama.cpp's qwen3moe renormalises the top-k probabilities unless the file says
    otherwise (`expert_weights_norm`)."""
    experts = int(_get(meta, f"{arch}.expert_count", required=True))
    sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not sparse:
        raise ValueError(f"GGUF architecture {arch!r} says {experts} experts, but no layer has a router "
                         "(blk.N.ffn_gate_inp.weight); the file is incomplete")
    stacked = tensors[f"blk.{sparse[0]}.ffn_gate_exps.weight"].shape  # GGUF order: [hidden, inter, experts]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(_get(meta, f"{arch}.expert_used_count", required=True)),
        "moe_intermediate_size": int(_get(meta, f"{arch}.expert_feed_forward_length", int(stacked[1]))),
        "norm_topk_prob": bool(_get(meta, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n_layers) if i not in sparse],
    }


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `gguf_path` as an HF model directory at `out_dir` (must be absent or empty); return it."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} not found")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty; pass a new directory (conversion never overwrites)")
    if not (dtype.is_floating_point and dtype.itemsize >= 2):
        raise ValueError(f"dtype {dtype} unsupported: use torch.float32, torch.bfloat16 or torch.float16")
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{gguf_path} has no token_embd.weight tensor; it is not a decoder language model")
    cfg = build_config(meta, tensors, dtype)
    permute = meta["general.architecture"] == "llama"
    deepseek = Deepseek2Tensors(cfg) if cfg["model_type"] == "deepseek_v3" else None
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out, max_shard_bytes)
    bar = tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor", disable=not progress)
    for t in bar:
        if t.name == _ROPE_FREQS:
            continue  # carried by config.json's rope_scaling
        arr = dequantize(t.data, t.tensor_type)
        if not arr.flags.writeable:
            arr = arr.copy()  # F32 tensors come back as read-only views of the memory-mapped file
        w = torch.from_numpy(arr)
        # GGUF lists dims innermost-first; numpy/torch order is the reverse.
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if permute and ".attn_q." in t.name:
            w = unpermute_rotary(w, cfg["num_attention_heads"])
        elif permute and ".attn_k." in t.name:
            w = unpermute_rotary(w, cfg["num_key_value_heads"])
        own = deepseek.take(t.name, w) if deepseek is not None else None
        for name, part in own if own is not None else hf_tensors(t.name, w):
            writer.add(name, part.to(dtype))
    if deepseek is not None:
        deepseek.finish()
    writer.close()
    write_json(out / CONFIG_FILE, cfg)
    tokenizer, tokenizer_config, generation_config = build_tokenizer_files(
        meta, context_length=cfg["max_position_embeddings"])
    tokenizer.save(str(out / TOKENIZER_FILE))
    write_json(out / TOKENIZER_CONFIG_FILE, tokenizer_config)
    write_json(out / GENERATION_CONFIG_FILE, generation_config)
    return out
