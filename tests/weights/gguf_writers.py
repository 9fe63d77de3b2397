"""Tiny GGUF files written from tiny HF models, as llama.cpp's converter lays them out (imported by the
checkpoint tests and their fixtures; a module of its own, since `conftest` names a different module in
each test folder)."""

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
_GLOBAL_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{kind}"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: rotate-half halves -> interleaved pairs, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors stacked as llama.cpp stores them: one `blk.N.ffn_<proj>_exps.weight` per layer and
    projection, [experts, out, in]; every other tensor under its GGUF name."""
    out, experts = {}, {}
    for name, a in weights.items():
        m = _EXPERT_RE.match(name)
        if m:
            experts.setdefault(f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight", {})[int(m.group(2))] = a
        else:
            out[_gguf_name(name)] = a
    for name, parts in experts.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def write_tiny_gguf(hf_dir: Path, path: Path, *, quant: str = "Q8_0", pre: str = "default",
                    rope_freqs: np.ndarray | None = None) -> Path:
    """Write a tiny HF directory as llama.cpp would: permuted q/k (llama), GGUF names, stacked experts
    (qwen3moe), metadata.

    quant: "F32" keeps weights exact (so a conversion must reproduce them bit for bit); "Q8_0"
    quantizes every 2-D or 3-D weight whose rows are a multiple of 32.
    """
    cfg = _config(hf_dir)
    tok, tok_cfg = _tokenizer_files(hf_dir)
    arch = _GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch.startswith("qwen3"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if not cfg["norm_topk_prob"]:  # llama.cpp's qwen3moe renormalises unless the file says otherwise
            w.add_expert_weights_norm(False)
    _add_tokenizer(w, tok, tok_cfg, pre)
    weights = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = _permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            a = _permute(a, cfg["num_key_value_heads"])
        weights[name] = a
    tensors = _stack_experts(weights)
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs.astype(np.float32)
    return _add_tensors_and_close(w, tensors, quant, path)


def _config(hf_dir: Path) -> dict:
    """config.json with the keys read here as transformers reads them: `rope_theta` out of transformers 5's
    rope_parameters, `num_experts` from Qwen3-MoE's `num_local_experts`."""
    from transformers import AutoConfig

    cfg, hf = json.loads((hf_dir / "config.json").read_text()), AutoConfig.from_pretrained(hf_dir)
    return cfg | {"rope_theta": hf.rope_parameters["rope_theta"], "num_experts": getattr(hf, "num_experts", None)}


def _tokenizer_files(hf_dir: Path) -> tuple[dict, dict]:
    return (json.loads((hf_dir / "tokenizer.json").read_text()),
            json.loads((hf_dir / "tokenizer_config.json").read_text()))


def _add_tokenizer(w: gguf.GGUFWriter, tok: dict, tok_cfg: dict, pre: str) -> None:
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])


def q8_0_kept(a: np.ndarray) -> bool:
    """Whether write_*_gguf(quant="Q8_0") quantizes this weight: 2-D or 3-D, rows a multiple of 32."""
    return a.ndim in (2, 3) and a.shape[-1] % 32 == 0


def _add_tensors_and_close(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray], quant: str, path: Path) -> Path:
    for name, a in tensors.items():
        if quant == "Q8_0" and q8_0_kept(a):
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SP_PIECES = ["▁", "t", "h", "e", "a", "n", "d", "o", "r", "s", "i", "l", "he", "▁t", "▁the", "▁a", "an", "▁an",
             "and", "▁and", "in", "er", "re", "on", "▁o", "▁on", "is", "▁is", "it", "▁it", "es", "ed", "or",
             "▁or", "ll", "▁he", "lo", "hel", "hell", "hello", "▁hello", "▁w", "▁wor", "ld", "▁world", "▁▁", "x"]


def write_sentencepiece_gguf(model_gguf: Path, path: Path, vocab_size: int = 512) -> Path:
    """Copy a tiny GGUF's model, replacing its tokenizer by a llama-style (sentencepiece BPE) one:
    <unk> <s> </s>, 256 byte-fallback tokens, scored pieces (no merges stored), padding tokens."""
    r = gguf.GGUFReader(model_gguf)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * len(SP_PIECES)
    scores = [0.0] * 259 + [-float(i) if len(p) > 1 else -1000.0 - i for i, p in enumerate(SP_PIECES)]
    pad = vocab_size - len(tokens)
    tokens += [f"<extra_{i}>" for i in range(pad)]
    types += [gguf.TokenType.USER_DEFINED] * pad
    scores += [0.0] * pad
    w = gguf.GGUFWriter(str(path), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith(("GGUF.", "tokenizer.ggml", "general.architecture")):
            continue
        v = f.contents()
        {str: w.add_string, bool: w.add_bool, int: w.add_uint32, float: w.add_float32}[type(v)](f.name, v)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
