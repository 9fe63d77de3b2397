"""The model's shape, read from a Hugging Face `config.json` through transformers' config class of its
`architectures`: what the engine needs of it, one small description per family."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.models.config_memo import remembered
from pdserve.models.shapes import LinearAttentionShape, Mamba2Shape, MlaShape, MoeShape, RopeScaling, YarnRope

# config.json 'architectures' -> transformers' model_type, whose config class reads the file
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    # Qwen3.5 as published: vision-language classes; pdserve serves their text model (text_config)
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "NemotronHForCausalLM": "nemotron_h",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# The vision-language classes whose config.json nests the text model's keys under `text_config`
VISION_LANGUAGE = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# Nemotron-H's checkpoints name each layer's one mixer (Nemotron 3's "moe": a mixture of experts).
NEMOTRON_H_LAYERS = ("linear_attention", "full_attention", "mlp", "moe")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    rope_scaling: RopeScaling | None = None
    # Layers that attend to only the last `sliding_window` positions (Mistral v0.1: all of them; Qwen2
    # with use_sliding_window: from max_window_layers on). Empty: every layer attends to everything.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Hybrid models (Qwen3.5, Nemotron-H): the layers that keep a recurrent state instead of KV, their
    # shape, and the full-attention layers' extras (Qwen3.5: an output gate, q/k norms, RoPE on a
    # fraction of each head).
    recurrent_layers: tuple[int, ...] = ()
    linear_attention: LinearAttentionShape | None = None
    partial_rotary_factor: float = 1.0
    # Nemotron-H: the Mamba2 mixers' shape, and the layers that keep neither KV nor a state (its MLP-only layers;
    # not Qwen3-MoE's `mlp_only_layers` key, which names its dense layers among the MoE ones)
    mamba: Mamba2Shape | None = None
    cacheless_layers: tuple[int, ...] = ()
    # Qwen3: q and k RMS-normalised per head (a [head_dim] weight each) before RoPE; o_proj carries a bias
    # where attention_bias says so (Qwen2's never does).
    qk_norm: bool = False
    o_proj_bias: bool = False
    # Qwen3-MoE: the layers whose MLP is a sparse MoE block (models/moe.py), and its shape.
    moe: MoeShape | None = None
    moe_layers: tuple[int, ...] = ()
    # DeepSeek-V3: latent attention. Its cache is one part of one "head" of width mla.latent_dim per token
    # (num_kv_heads 1, head_dim latent_dim, kv_parts 1), whole on every TP rank.
    mla: MlaShape | None = None

    @property
    def kv_parts(self) -> int:
        """Tensors the cache keeps per layer and token: K and V, or MLA's one latent."""
        return 1 if self.mla is not None else 2

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.recurrent_layers

    def kv_layers(self, first: int, count: int) -> list[int]:
        """The layers of [first, first + count) that keep KV (all but the recurrent and the MLP-only ones)."""
        return [i for i in range(first, first + count) if not self.is_recurrent(i) and i not in self.cacheless_layers]

    def window(self, layer: int) -> int:
        """Layer `layer`'s (global index) sliding window in positions; 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def splits_by(self, tp: int) -> bool:
        """Whether tensor parallelism can split this model `tp` ways: query heads and the MLP evenly, KV
        heads evenly or replicated (one of num_kv_heads and tp divides the other)."""
        if self.mamba is not None:  # Mamba2 heads and groups, attention and KV heads, the MLP, experts: all cut evenly
            cut = [self.num_heads, self.num_kv_heads, self.intermediate_size, self.mamba.num_heads, self.mamba.n_groups]
            if self.moe_layers:  # the shared expert always; the routed ones unless replicated whole (moe.py)
                cut.append(self.moe.shared_intermediate_size)
                cut += [] if self.moe.replicated else [self.moe.intermediate_size]
            return all(n % tp == 0 for n in cut)
        if self.linear_attention is not None:  # every projection cut by whole heads, KV heads too
            la = self.linear_attention
            experts = (self.moe.intermediate_size,) if self.moe_layers else ()  # each expert cut like an MLP
            return all(n % tp == 0 for n in (self.num_heads, self.num_kv_heads, self.intermediate_size,
                                             la.num_k_heads, la.num_v_heads, *experts))
        if self.moe_layers and self.moe.intermediate_size % tp:  # each expert cut like the dense MLP
            return False
        return (self.num_heads % tp == 0 and self.intermediate_size % tp == 0
                and (self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0))

    def layout_problem(self, tp: int, pp: int) -> str | None:
        """Why this model cannot run with tensor_parallel_size `tp` and pipeline_parallel_size `pp`, saying
        which sizes it can; None when it can. (Checked before any rank starts.)"""
        if not self.splits_by(tp):
            fits = [d for d in range(1, self.num_heads + 1) if self.splits_by(d)]
            return (f"tensor_parallel_size={tp} cannot split this model ({self.num_heads} attention heads, "
                    f"{self.num_kv_heads} KV heads, intermediate_size {self.intermediate_size}"
                    f"{f', moe_intermediate_size {self.moe.intermediate_size}' if self.moe_layers else ''}): "
                    f"use one of {fits}")
        if pp > self.num_layers:
            return (f"pipeline_parallel_size={pp} exceeds the model's {self.num_layers} layers: "
                    f"use at most {self.num_layers}")
        return None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], remember_in: Path | None = None) -> "ModelConfig":
        """The model config.json `cfg` describes, read as transformers reads it (transformers_config). With
        `remember_in` (a directory; config_memo.default_dir()), an answer read before for the same config,
        transformers and pdserve is taken from there instead, which spares this process importing transformers."""
        return remembered(cfg, cls._read_hf, cls, remember_in)

    @classmethod
    def _read_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = next((a for a in cfg.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {cfg.get('architectures')!r} (config.json 'architectures'); "
                f"pdserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        top = hf = transformers_config(cfg, arch)
        if arch in VISION_LANGUAGE:
            hf = top.text_config  # the text model (the vision tower's tensors are skipped: models/qwen3_5.py)
        if arch == "NemotronHForCausalLM":
            return _nemotron_h(cls, hf)
        if arch == "DeepseekV3ForCausalLM":
            return _deepseek_v3(cls, hf)
        act = hf.hidden_act
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; pdserve's MLP is SwiGLU (silu)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("unsupported mlp_bias: true; pdserve's MLP projections carry no bias")
        num_heads = hf.num_attention_heads
        rope = _rope(hf)
        rope_type = rope.get("rope_type", "default")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        family = SUPPORTED_ARCHITECTURES[arch]
        qwen3_5, qwen3_5_moe = family.startswith("qwen3_5"), family.startswith("qwen3_5_moe")
        qwen3 = family in ("qwen3", "qwen3_moe")
        # Qwen2's q/k/v always carry a bias, as transformers builds it (its config has no key for it)
        attention_bias = family == "qwen2" or bool(getattr(hf, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            # Qwen3.5-MoE has no dense MLP: its one MLP-shaped part is the shared expert
            intermediate_size=hf.shared_expert_intermediate_size if qwen3_5_moe else hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(top.tie_word_embeddings),  # the class's own config ties, not text_config
            attention_bias=attention_bias,
            rope_scaling=scaling,
            qk_norm=qwen3,
            o_proj_bias=qwen3 and attention_bias,
            **_sliding_window(hf, arch),
            **(_qwen3_5(hf, rope) if qwen3_5 else {}),
            **(_moe(hf) if family == "qwen3_moe" else {}),
            **(_qwen3_5_moe(hf) if qwen3_5_moe else {}),
        )


def transformers_config(cfg: dict[str, Any], arch: str):
    """config.json as transformers reads it: the config class of `arch`'s family, so aliases (Qwen3-MoE's
    `num_local_experts` for `num_experts`), defaults, old spellings (`rope_scaling`, Nemotron-H's
    `hybrid_override_pattern`) and encoded floats (`{"__float__": "Infinity"}`) are transformers', not a second
    parser's. The class is chosen by `arch`, whatever `model_type` says."""
    # imported here: only reading a model's config needs transformers, and it takes a second to import
    from huggingface_hub.errors import StrictDataclassError
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[SUPPORTED_ARCHITECTURES[arch]]
    try:
        return config_class.from_dict(PretrainedConfig._decode_special_floats(dict(cfg)))
    except (KeyError, TypeError, ValueError, StrictDataclassError) as e:  # what transformers refuses to read
        raise ValueError(f"config.json does not read as transformers' {config_class.__name__} ({arch}): "
                         f"{e}; fix the key it names") from e


def _rope(hf) -> dict[str, Any]:
    """transformers' rope_parameters (it folds the older rope_theta / rope_scaling keys into them)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _qwen3_5(hf, rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's recurrent layers (layer_types 'linear_attention'), their Gated DeltaNet shape and the
    fraction of each attention head RoPE rotates."""
    kinds = list(hf.layer_types or [])
    if len(kinds) != hf.num_hidden_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must name each of the {hf.num_hidden_layers} layers "
                         f"'linear_attention' or 'full_attention', got {kinds!r}")
    shape = LinearAttentionShape(
        num_k_heads=int(hf.linear_num_key_heads), num_v_heads=int(hf.linear_num_value_heads),
        k_head_dim=int(hf.linear_key_head_dim), v_head_dim=int(hf.linear_value_head_dim),
        conv_kernel=int(hf.linear_conv_kernel_dim))
    if shape.num_v_heads % shape.num_k_heads:
        raise ValueError(f"linear_num_value_heads={shape.num_v_heads} must be a multiple of "
                         f"linear_num_key_heads={shape.num_k_heads}")
    factor = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if int(head_dim * factor) % 2:
        raise ValueError(f"partial_rotary_factor={factor} of head_dim {head_dim} rotates an odd number of dims")
    return {"recurrent_layers": tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
            "linear_attention": shape, "partial_rotary_factor": factor}


def _moe(hf) -> dict[str, Any]:
    """Qwen3-MoE's experts (config.json's `num_experts`, or `num_local_experts` as transformers 5 writes it),
    and which layers are sparse as transformers picks them: every `decoder_sparse_step`-th layer (1-based)
    that `mlp_only_layers` does not name."""
    if int(hf.num_experts or 0) == 0:
        return {}  # no experts: every layer keeps the dense MLP
    shape = MoeShape(num_experts=int(hf.num_experts), top_k=int(hf.num_experts_per_tok),
                     intermediate_size=int(hf.moe_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob))
    if not 1 <= shape.top_k <= shape.num_experts:
        raise ValueError(f"num_experts_per_tok={shape.top_k} must be between 1 and num_experts={shape.num_experts}")
    step, dense = int(hf.decoder_sparse_step), set(hf.mlp_only_layers or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    layers = tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return {"moe": shape, "moe_layers": layers}


def _qwen3_5_moe(hf) -> dict[str, Any]:
    """Qwen3.5-MoE's block, in every layer: softmax top-k routing always renormalised (its config has no
    norm_topk_prob), plus one shared expert scaled by its sigmoid gate."""
    shape = MoeShape(num_experts=int(hf.num_experts), top_k=int(hf.num_experts_per_tok),
                     intermediate_size=int(hf.moe_intermediate_size), norm_topk_prob=True,
                     shared_intermediate_size=int(hf.shared_expert_intermediate_size), shared_gate=True)
    if not 1 <= shape.top_k <= shape.num_experts:
        raise ValueError(f"num_experts_per_tok={shape.top_k} must be between 1 and num_experts={shape.num_experts}")
    if shape.shared_intermediate_size < 1:
        raise ValueError(f"shared_expert_intermediate_size={shape.shared_intermediate_size} must be >= 1 "
                         "(every Qwen3.5-MoE layer has a shared expert)")
    return {"moe": shape, "moe_layers": tuple(range(hf.num_hidden_layers))}


def _nemotron_h(cls, hf) -> "ModelConfig":
    """Nemotron-H: one mixer per layer (Mamba2, attention without positions, a squared-ReLU MLP, or Nemotron 3's
    mixture of squared-ReLU experts), named by `layers_block_type` (transformers reads the older
    `hybrid_override_pattern`, M * - E, into it)."""
    kinds = list(hf.layers_block_type or [])
    unknown = sorted(set(kinds) - set(NEMOTRON_H_LAYERS))
    if not kinds or unknown:
        raise ValueError(f"NemotronHForCausalLM layers_block_type {kinds!r}: pdserve serves "
                         f"{sorted(NEMOTRON_H_LAYERS)} layers; {unknown or 'none given'} is not served yet")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf, key) != want:
            raise ValueError(f"unsupported {key} {getattr(hf, key)!r}; Nemotron-H's is {want!r}")
    for key in ("mlp_bias", "attention_bias", "use_bias", "mamba_proj_bias", "residual_in_fp32"):
        if getattr(hf, key, False):
            raise ValueError(f"unsupported {key}: true for NemotronHForCausalLM")
    heads = hf.num_attention_heads
    mamba = Mamba2Shape(num_heads=int(hf.mamba_num_heads), head_dim=int(hf.mamba_head_dim),
                        n_groups=int(hf.n_groups), state_size=int(hf.ssm_state_size),
                        conv_kernel=int(hf.conv_kernel), conv_bias=bool(hf.use_conv_bias),
                        time_step_min=float(hf.time_step_min))
    if mamba.num_heads % mamba.n_groups:
        raise ValueError(f"mamba_num_heads={mamba.num_heads} must be a multiple of n_groups={mamba.n_groups}")
    moe_layers = tuple(i for i, k in enumerate(kinds) if k == "moe")
    return cls(
        architecture="NemotronHForCausalLM", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=len(kinds), num_heads=heads,
        num_kv_heads=hf.num_key_value_heads or heads, head_dim=hf.head_dim or hf.hidden_size // heads,
        rms_norm_eps=float(hf.layer_norm_epsilon), rope_theta=10000.0,  # (no positions)
        max_position_embeddings=int(hf.max_position_embeddings), tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=False, recurrent_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
        cacheless_layers=tuple(i for i, k in enumerate(kinds) if k in ("mlp", "moe")), mamba=mamba,
        moe=_nemotron_h_moe(hf) if moe_layers else None, moe_layers=moe_layers)


def _nemotron_h_moe(hf) -> MoeShape:
    """Nemotron 3's experts: DeepSeek-V3's routing (sigmoid, correction bias, groups, scaling), squared-ReLU
    experts, one shared expert of `moe_shared_expert_intermediate_size`, Super's `moe_latent_size`."""
    moe = MoeShape(num_experts=int(hf.n_routed_experts), top_k=int(hf.num_experts_per_tok),
                   intermediate_size=int(hf.moe_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob),
                   scoring="sigmoid", n_group=int(hf.n_group or 1), topk_group=int(hf.topk_group or 1),
                   routed_scaling_factor=float(hf.routed_scaling_factor),
                   shared_intermediate_size=int(hf.moe_shared_expert_intermediate_size), activation="relu2",
                   latent_size=int(hf.moe_latent_size or 0))
    _check_groups(moe)
    return moe


def _check_groups(moe: MoeShape) -> None:
    """Sigmoid routing's groups split the experts evenly, and top_k fits in the topk_group groups kept."""
    if moe.num_experts % moe.n_group or not 1 <= moe.topk_group <= moe.n_group:
        raise ValueError(f"n_routed_experts={moe.num_experts}, n_group={moe.n_group}, topk_group={moe.topk_group}: "
                         "the groups must split the experts evenly and topk_group be between 1 and n_group")
    if not 1 <= moe.top_k <= moe.topk_group * moe.num_experts // moe.n_group:
        raise ValueError(f"num_experts_per_tok={moe.top_k} must be between 1 and the experts of topk_group groups")


def _yarn(rope: dict[str, Any], max_positions: int) -> YarnRope:
    """transformers' reading of a yarn rope_scaling / rope_parameters dict (its default factor and
    attention factor included)."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or max_positions / original)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = mscale(ms) / mscale(ms_all) if ms and ms_all else mscale(1.0)
    return YarnRope(factor=factor, original_max_position_embeddings=original,
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    attention_factor=float(attention_factor),
                    softmax_mscale=mscale(ms_all) ** 2 if ms_all else 1.0, truncate=bool(rope.get("truncate", True)))


def _deepseek_v3(cls, hf) -> "ModelConfig":
    """DeepSeek-V3: latent attention in every layer; the first `first_k_dense_replace` layers a dense SwiGLU
    MLP, the rest a sigmoid-routed, group-limited MoE with shared experts."""
    if hf.hidden_act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; DeepSeek-V3's MLP is SwiGLU (silu)")
    rope = _rope(hf)
    kind = rope["rope_type"]
    if kind not in ("default", "yarn"):
        raise ValueError(f"unsupported rope_type {kind!r} for DeepseekV3ForCausalLM; supported: default, yarn")
    max_positions = int(hf.max_position_embeddings)
    mla = MlaShape(q_lora_rank=int(hf.q_lora_rank) if hf.q_lora_rank else None, kv_lora_rank=int(hf.kv_lora_rank),
                   qk_nope_head_dim=int(hf.qk_nope_head_dim), qk_rope_head_dim=int(hf.qk_rope_head_dim),
                   v_head_dim=int(hf.v_head_dim), rope_interleave=bool(hf.rope_interleave),
                   yarn=_yarn(rope, max_positions) if kind == "yarn" else None)
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    layers, dense = int(hf.num_hidden_layers), int(hf.first_k_dense_replace or 0)
    moe = MoeShape(num_experts=int(hf.n_routed_experts), top_k=int(hf.num_experts_per_tok),
                   intermediate_size=int(hf.moe_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob),
                   scoring="sigmoid", n_group=int(hf.n_group or 1), topk_group=int(hf.topk_group or 1),
                   routed_scaling_factor=float(hf.routed_scaling_factor),
                   shared_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0))
    _check_groups(moe)
    return cls(
        architecture="DeepseekV3ForCausalLM", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=layers, num_heads=int(hf.num_attention_heads),
        num_kv_heads=1, head_dim=mla.latent_dim, rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 10000.0)), max_position_embeddings=max_positions,
        tie_word_embeddings=bool(hf.tie_word_embeddings), attention_bias=bool(hf.attention_bias), moe=moe,
        moe_layers=tuple(range(dense, layers)), mla=mla)


def _sliding_window(hf, arch: str) -> dict[str, Any]:
    """The window and the layers that slide, as transformers reads config.json: a `layer_types` list
    names them (transformers derives it for Qwen2 and Qwen3 from `use_sliding_window` and
    `max_window_layers`); else Mistral slides in every layer whenever `sliding_window` is set, and Qwen3-MoE
    with `use_sliding_window` in every layer."""
    window, layers = getattr(hf, "sliding_window", None), int(hf.num_hidden_layers)
    if not window:
        return {}
    if getattr(hf, "layer_types", None):
        sliding = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    elif arch == "Qwen3MoeForCausalLM":
        sliding = list(range(layers)) if hf.use_sliding_window else []
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(hf.max_window_layers)
        sliding = list(range(first, layers)) if hf.use_sliding_window else []
    else:
        sliding = list(range(layers))
    return {"sliding_window": int(window), "sliding_layers": tuple(sliding)} if sliding else {}
