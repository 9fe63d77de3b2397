"""Tiny checkpoints in the published format: transformers' own `save_pretrained` of the class a publisher
ships, so every tensor name, shard and config.json key is the one a downloaded checkpoint has (Nemotron-H's
`backbone.*`, Qwen3-MoE's `num_local_experts` and per-expert tensors), never a spelling of pdserve's.

Only the values are pdserve's: transformers' 0.02 init gives logits near zero, and greedy decoding then
repeats one token, so a test comparing token streams would pass even with a broken layer. Each family gives a
rule, `value(name, shape, randn)`, that draws a parameter (named as transformers' module holds it in memory)
at the scale tiny.py's docstring explains; parameters are drawn in transformers' order from one seeded
generator, so the same arguments give the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import Tokenizer

Randn = Callable[..., torch.Tensor]
ValueRule = Callable[[str, tuple[int, ...], Randn], torch.Tensor]


def save_published(out_dir: str | os.PathLike, config: Any, value: ValueRule, *, seed: int, dtype: torch.dtype,
                   tokenizer: Tokenizer, max_position_embeddings: int, max_shard_size: int | str | None = None,
                   original_format: bool = True, buffers: tuple[str, ...] = ()) -> Path:
    """Write `config`'s model (a transformers config object; its `architectures[0]` is the class) with
    parameters drawn by `value` as `save_pretrained` writes it, sharded when the weights exceed
    `max_shard_size` (model.safetensors.index.json), plus the tiny tokenizer files. `original_format=False`
    is save_pretrained's `save_original_format=False`: tensors as transformers holds them (an MoE's experts
    fused into 3-D tensors), as checkpoints written by transformers 5 without its reverse mapping are. The
    saved buffers whose names end in one of `buffers` are drawn by `value` too (Nemotron-H's
    e_score_correction_bias: its zero init would leave a test blind to it)."""
    import transformers

    from pdserve.testing.tiny_tokenizer import write_tokenizer_files

    model_class = getattr(transformers, config.architectures[0])
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is the embedding's one parameter
            param.copy_(value(name, tuple(param.shape), randn))
        for name, buffer in model.named_buffers():
            if buffers and name.endswith(buffers):
                buffer.copy_(value(name, tuple(buffer.shape), randn))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, save_original_format=original_format,
                                    **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    write_tokenizer_files(out, tokenizer, max_position_embeddings)
    return out


def projection(shape: tuple[int, ...], randn: Randn, gain: float = 1.0) -> torch.Tensor:
    """A linear weight (or a stack of experts' weights) `[..., out, in]` that keeps a unit-scale input at unit
    scale."""
    return randn(*shape, std=gain / shape[-1] ** 0.5)


def around_one(shape: tuple[int, ...], randn: Randn) -> torch.Tensor:
    """A norm's weight near 1."""
    return 1.0 + randn(*shape, std=0.1)
