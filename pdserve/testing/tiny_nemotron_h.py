"""Tiny random-weight Nemotron-H models (Mamba2, attention, squared-ReLU MLP and MoE layers), written by
transformers' `save_pretrained` of NemotronHForCausalLM (tiny_published.py): the published format, weights
named `backbone.embeddings`, `backbone.layers.N.mixer.*` (each routed expert on its own,
`mixer.experts.E.up_proj.weight`), `backbone.norm_f`.

`make_tiny_nemotron_h(dir, pattern="M-*-M-")`: one layer per character, M a Mamba2 mixer, * attention,
- an MLP, E a mixture of experts (Nemotron 3; the older `hybrid_override_pattern` notation). 8 Mamba heads of
8 channels in 2 groups of 16-dim B and C vectors, a 4-tap conv; MoE layers route each token to 2 of 8
squared-ReLU experts (sigmoid scores, 2 of 4 groups, a random correction bias, scaled by 2.5) beside one
shared expert. Weights scaled as in tiny.py so greedy decoding is not degenerate.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from pdserve.testing.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer
from pdserve.testing.tiny_published import Randn, around_one, projection, save_published

_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
MAMBA = {"mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4}
MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "moe_shared_expert_intermediate_size": 48, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
       "routed_scaling_factor": 2.5}


def make_tiny_nemotron_h(out_dir: str | os.PathLike, *, pattern: str = "M-*-M-", hidden_size: int = 64,
                         num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                         vocab_size: int = 512, max_position_embeddings: int = 2048, seed: int = 0,
                         dtype: torch.dtype = torch.float32, mamba: dict | None = None,
                         max_shard_size: int | str | None = None, moe: dict | None = None) -> Path:
    """`mamba` overrides MAMBA's config keys (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, ...),
    `moe` MOE's (n_routed_experts, moe_latent_size for Super's latent projections, ...);
    `max_shard_size` (save_pretrained's) writes the weights in shards."""
    from transformers import NemotronHConfig

    if set(pattern) - set(_KINDS):
        raise ValueError(f"pattern {pattern!r}: one of {sorted(_KINDS)} per layer")
    config = NemotronHConfig(
        architectures=["NemotronHForCausalLM"], vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, layers_block_type=[_KINDS[c] for c in pattern],
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        # transformers' chunked scan in chunks of 16: the tiny tests' prompts span several
        chunk_size=16, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, **{**MAMBA, **(mamba or {})},
        **{**MOE, **(moe or {})})
    return save_published(out_dir, config, _value, seed=seed, dtype=dtype,
                          tokenizer=build_tiny_tokenizer(vocab_size, "llama"),
                          max_position_embeddings=max_position_embeddings, max_shard_size=max_shard_size,
                          buffers=("e_score_correction_bias",))


def _value(name: str, shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
    """A NemotronHForCausalLM parameter (named as transformers holds it: model.layers.N.mixer.*, the routed
    experts stacked, mixer.experts.up_proj [experts, out, in])."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
    if name.endswith("embeddings.weight"):
        return randn(*shape, std=1.0)
    if name == "lm_head.weight":
        return randn(*shape, std=4.0 / math.sqrt(shape[1]))
    if leaf in ("norm", "norm_f", "D"):  # the layer's and the Mamba2 gated norms, the skip
        return around_one(shape, randn)
    if leaf == "A_log":  # decay rates exp(A_log) from 0.5 to 8: some heads remember long, some forget fast
        return torch.linspace(math.log(0.5), math.log(8.0), shape[0])
    if leaf == "dt_bias":
        return randn(*shape, std=0.5)
    if leaf == "conv1d":  # weight [channels, 1, taps]
        return randn(*shape, std=0.1) if name.endswith("bias") else randn(*shape, std=1.0 / math.sqrt(shape[-1]))
    if leaf in ("q_proj", "k_proj"):  # sharper, position-dependent attention (tiny.py)
        return projection(shape, randn, gain=2.0)
    if leaf == "down_proj":  # relu^2 doubles the scale of a unit input
        return projection(shape, randn, gain=0.5)
    if leaf == "e_score_correction_bias":  # (a buffer) decisive routing: no near-ties for rounding to flip
        return randn(*shape, std=0.1)
    if leaf in ("in_proj", "out_proj", "v_proj", "o_proj", "up_proj", "gate", "fc1_latent_proj", "fc2_latent_proj"):
        return projection(shape, randn)
    raise ValueError(f"tiny Nemotron-H: no value rule for transformers' parameter {name!r}; add one")
