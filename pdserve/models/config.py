"""The model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Nemotron-H's checkpoints name each layer's one mixer; the MoE kind is not served yet (refused by name).
NEMOTRON_H_LAYERS = ("linear_attention", "full_attention", "mlp")


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 mixer's shape (Nemotron-H): `num_heads` heads of `head_dim` channels share `n_groups` groups of
    B and C vectors of `state_size`; the causal conv runs over [x | B | C] channels."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    time_step_min: float  # dt = softplus(dt_raw + dt_bias), clamped below here

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's shape (Qwen3.5's `linear_attention` layers). Key heads serve
    num_v_heads // num_k_heads value heads each; the causal conv runs over [q | k | v] channels."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class MoeShape:
    """A sparse MoE block's shape (Qwen3-MoE): a router picks `top_k` of `num_experts` SwiGLU experts of
    `intermediate_size` per token; with `norm_topk_prob` the chosen probabilities are rescaled to sum to 1.

    DeepSeek-V3 scores by sigmoid instead of softmax and picks among the `topk_group` best of `n_group`
    expert groups (a group ranked by the sum of its two best biased scores), the weights times
    `routed_scaling_factor`; `shared_intermediate_size` > 0 adds a shared SwiGLU expert every token takes."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3: with a per-expert e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    # how tensor parallelism places the routed experts (EngineConfig.moe_experts; moe.py), not the checkpoint's
    replicated: bool = False


@dataclass(frozen=True)
class YarnRope:
    """YaRN frequency scaling (DeepSeek-V3's rope_scaling type 'yarn'): the interpolated and extrapolated
    frequencies blended over the dims between the beta_fast and beta_slow rotations; cos and sin times
    `attention_factor`, and attention's softmax scale times mscale(factor, mscale_all_dim) squared."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    softmax_mscale: float  # the scale's factor, 1.0 without mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V3). q comes through a rank-`q_lora_rank` bottleneck (None: one
    q_proj); k and v through one shared latent of `kv_lora_rank` plus a `qk_rope_head_dim` RoPE key that every
    head shares. The cache keeps that latent, one `latent_dim` vector per token and layer."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    yarn: YarnRope | None = None

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1+). `None` on ModelConfig means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
        if self.mamba is not None:  # Mamba2 heads and groups, attention and KV heads, the MLP: all cut evenly
            return all(n % tp == 0 for n in (self.num_heads, self.num_kv_heads, self.intermediate_size,
                                             self.mamba.num_heads, self.mamba.n_groups))
        if self.linear_attention is not None:  # every projection cut by whole heads, KV heads too
            la = self.linear_attention
            return all(n % tp == 0 for n in (self.num_heads, self.num_kv_heads, self.intermediate_size,
                                             la.num_k_heads, la.num_v_heads))
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
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if "NemotronHForCausalLM" in archs:
            return _nemotron_h(cls, cfg)
        if "DeepseekV3ForCausalLM" in archs:
            return _deepseek_v3(cls, cfg)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs!r}; pdserve serves "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (config.json 'architectures')"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; pdserve's MLP is SwiGLU (silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias: true; pdserve's MLP projections carry no bias")
        num_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or legacy_scaling.get("rope_type") or legacy_scaling.get("type")
        scaling = None
        if rope_type == "llama3":
            src = rope if "factor" in rope else legacy_scaling
            scaling = RopeScaling(
                factor=float(src["factor"]),
                low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]),
            )
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        default_bias = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        hybrid = _qwen3_5(cfg, rope) if arch == "Qwen3_5ForCausalLM" else {}
        qwen3 = SUPPORTED_ARCHITECTURES[arch] in ("qwen3", "qwen3_moe")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", default_bias)),
            rope_scaling=scaling,
            qk_norm=qwen3,
            o_proj_bias=qwen3 and bool(cfg.get("attention_bias", False)),
            **_sliding_window(cfg, arch),
            **hybrid,
            **(_moe(cfg) if arch == "Qwen3MoeForCausalLM" else {}),
        )


def _qwen3_5(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's recurrent layers (layer_types 'linear_attention'), their Gated DeltaNet shape and the
    fraction of each attention head RoPE rotates."""
    kinds = cfg.get("layer_types") or []
    if len(kinds) != cfg["num_hidden_layers"] or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must name each of the {cfg['num_hidden_layers']} layers "
                         f"'linear_attention' or 'full_attention', got {kinds!r}")
    shape = LinearAttentionShape(
        num_k_heads=int(cfg["linear_num_key_heads"]), num_v_heads=int(cfg["linear_num_value_heads"]),
        k_head_dim=int(cfg["linear_key_head_dim"]), v_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    if shape.num_v_heads % shape.num_k_heads:
        raise ValueError(f"linear_num_value_heads={shape.num_v_heads} must be a multiple of "
                         f"linear_num_key_heads={shape.num_k_heads}")
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if int(head_dim * factor) % 2:
        raise ValueError(f"partial_rotary_factor={factor} of head_dim {head_dim} rotates an odd number of dims")
    return {"recurrent_layers": tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
            "linear_attention": shape, "partial_rotary_factor": factor}


def _moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's experts, and which layers are sparse as transformers picks them: every
    `decoder_sparse_step`-th layer (1-based) that `mlp_only_layers` does not name."""
    if int(cfg.get("num_experts", 0)) == 0:
        return {}  # no experts: every layer keeps the dense MLP
    shape = MoeShape(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if not 1 <= shape.top_k <= shape.num_experts:
        raise ValueError(f"num_experts_per_tok={shape.top_k} must be between 1 and num_experts={shape.num_experts}")
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return {"moe": shape, "moe_layers": layers}


def _nemotron_h(cls, cfg: dict[str, Any]) -> "ModelConfig":
    """Nemotron-H: one mixer per layer (Mamba2, attention without positions, or a squared-ReLU MLP), named by
    `layers_block_type` (or the older `hybrid_override_pattern`, M * - E)."""
    kinds = cfg.get("layers_block_type") or [{"M": "linear_attention", "*": "full_attention", "-": "mlp",
                                              "E": "moe"}.get(c, c) for c in cfg.get("hybrid_override_pattern", "")]
    unknown = sorted(set(kinds) - set(NEMOTRON_H_LAYERS))
    if not kinds or unknown:
        raise ValueError(f"NemotronHForCausalLM layers_block_type {kinds!r}: pdserve serves "
                         f"{sorted(NEMOTRON_H_LAYERS)} layers; {unknown or 'none given'} is not served yet")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ValueError(f"unsupported {key} {cfg[key]!r}; Nemotron-H's is {want!r}")
    for key in ("mlp_bias", "attention_bias", "use_bias", "mamba_proj_bias", "residual_in_fp32"):
        if cfg.get(key):
            raise ValueError(f"unsupported {key}: true for NemotronHForCausalLM")
    heads = cfg["num_attention_heads"]
    mamba = Mamba2Shape(num_heads=int(cfg["mamba_num_heads"]), head_dim=int(cfg["mamba_head_dim"]),
                        n_groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 1))),
                        state_size=int(cfg["ssm_state_size"]),
                        conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
                        conv_bias=bool(cfg.get("use_conv_bias", True)),
                        time_step_min=float(cfg.get("time_step_min", 0.001)))
    if mamba.num_heads % mamba.n_groups:
        raise ValueError(f"mamba_num_heads={mamba.num_heads} must be a multiple of n_groups={mamba.n_groups}")
    return cls(
        architecture="NemotronHForCausalLM", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=len(kinds), num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,  # (no positions)
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=False,
        recurrent_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
        cacheless_layers=tuple(i for i, k in enumerate(kinds) if k == "mlp"), mamba=mamba)


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


def _deepseek_v3(cls, cfg: dict[str, Any]) -> "ModelConfig":
    """DeepSeek-V3: latent attention in every layer; the first `first_k_dense_replace` layers a dense SwiGLU
    MLP, the rest a sigmoid-routed, group-limited MoE with shared experts."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; DeepSeek-V3's MLP is SwiGLU (silu)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise ValueError(f"unsupported rope_type {kind!r} for DeepseekV3ForCausalLM; supported: default, yarn")
    max_positions = int(cfg.get("max_position_embeddings", 4096))
    q_lora = cfg.get("q_lora_rank")
    mla = MlaShape(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)),
                   yarn=_yarn(rope, max_positions) if kind == "yarn" else None)
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    layers, dense = int(cfg["num_hidden_layers"]), int(cfg.get("first_k_dense_replace") or 0)
    moe = MoeShape(num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                   intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), scoring="sigmoid",
                   n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                   shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0))
    if moe.num_experts % moe.n_group or not 1 <= moe.topk_group <= moe.n_group:
        raise ValueError(f"n_routed_experts={moe.num_experts}, n_group={moe.n_group}, topk_group={moe.topk_group}: "
                         "the groups must split the experts evenly and topk_group be between 1 and n_group")
    if not 1 <= moe.top_k <= moe.topk_group * moe.num_experts // moe.n_group:
        raise ValueError(f"num_experts_per_tok={moe.top_k} must be between 1 and the experts of topk_group groups")
    heads = int(cfg["num_attention_heads"])
    return cls(
        architecture="DeepseekV3ForCausalLM", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads, num_kv_heads=1,
        head_dim=mla.latent_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=max_positions, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), moe=moe, moe_layers=tuple(range(dense, layers)),
        mla=mla)


def _sliding_window(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The window and the layers that slide, as transformers reads config.json: a `layer_types` list
    names them; else Mistral slides in every layer whenever `sliding_window` is set, Qwen2 and Qwen3 only
    with `use_sliding_window`, in the layers from `max_window_layers` on, and Qwen3-MoE with
    `use_sliding_window` in every layer."""
    window, layers = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    if not window:
        return {}
    if cfg.get("layer_types"):
        sliding = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention"]
    elif arch == "Qwen3MoeForCausalLM":
        sliding = list(range(layers)) if cfg.get("use_sliding_window", False) else []
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(cfg.get("max_window_layers", 0))
        sliding = list(range(first, layers)) if cfg.get("use_sliding_window", False) else []
    else:
        sliding = list(range(layers))
    return {"sliding_window": int(window), "sliding_layers": tuple(sliding)} if sliding else {}
