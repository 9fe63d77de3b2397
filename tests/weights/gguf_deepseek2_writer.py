"""A tiny DeepSeek-V3 HF directory written as llama.cpp's converter writes its `deepseek2` GGUF: its tensor names,
kv_b_proj split into attn_k_b (each head's K block, transposed) and attn_v_b, the experts stacked, the KV head
count 1, the latent's and the heads' lengths, the router's keys (sigmoid gating, groups, scale)."""

import json
from pathlib import Path

import gguf
import numpy as np
from gguf_writers import _add_tensors_and_close, _add_tokenizer, _stack_experts, _tokenizer_files
from safetensors.torch import load_file

_ATTN = {"q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b", "q_proj": "attn_q",
         "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
          **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
          **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
          **{f"self_attn.{hf}.weight": f"{g}.weight" for hf, g in _ATTN.items()}}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    rope, kv_lora = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    w.add_name("tiny deepseek2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA read as MQA over the latent
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg["q_lora_rank"] is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    yarn = cfg.get("rope_scaling")
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
        w.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(yarn["beta_slow"])


def _tensors(hf_dir: Path, cfg: dict) -> dict[str, np.ndarray]:
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out, experts = {}, {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = a
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in name:
            experts[name] = a
        elif rest == "self_attn.kv_b_proj.weight":
            kv_b = a.reshape(heads, nope + v, a.shape[-1])
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            out[f"blk.{layer}.{_LAYER[rest]}"] = a
    return out | _stack_experts(experts)


def write_deepseek2_gguf(hf_dir: Path, path: Path, *, quant: str = "Q8_0") -> Path:
    """`quant` as write_tiny_gguf's: F32 keeps every tensor exact, Q8_0 quantizes those q8_0_kept takes."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(w, cfg)
    tok, tok_cfg = _tokenizer_files(hf_dir)
    _add_tokenizer(w, tok, tok_cfg, "default")
    return _add_tensors_and_close(w, _tensors(hf_dir, cfg), quant, path)
