"""The shapes of the parts a family's layers are built from (a Mamba2 mixer, a Gated DeltaNet layer, an MoE
block, latent attention, RoPE scalings), as ModelConfig (config.py) carries them: read from config.json there,
built into layers by the modules named in each docstring."""

from __future__ import annotations

from dataclasses import dataclass


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
    Qwen3.5-MoE adds one shared expert of `shared_intermediate_size` whose output every token takes times
    sigmoid(x @ shared_expert_gate) (`shared_gate`).

    DeepSeek-V3 scores by sigmoid instead of softmax and picks among the `topk_group` best of `n_group`
    expert groups (a group ranked by the sum of its two best biased scores), the weights times
    `routed_scaling_factor`; `shared_intermediate_size` > 0 adds a shared SwiGLU expert every token takes.

    Nemotron-H (Nemotron 3) routes as DeepSeek-V3 does, but its experts, shared one included, are
    `activation` "relu2": not gated, down(relu(up(x))^2); with `latent_size` > 0 (Super) the routed experts
    work in a latent of that width, between a down projection of x and an up projection of their sum."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3: with a per-expert e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    activation: str = "silu"  # "silu": SwiGLU experts; "relu2": squared-ReLU, not gated (Nemotron-H)
    latent_size: int = 0
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
