"""Load a Hugging Face checkpoint (one safetensors file or the shards its model.safetensors.index.json names)
into one rank's model shard: the top-level tensors here, each decoder layer's by its own `load`, every name
as the model class's CHECKPOINT_RENAMES maps it; the parts of a published checkpoint pdserve does not serve (a
vision-language checkpoint's vision tower) skipped as its CHECKPOINT_SKIPS says, with one log line each."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from torch import nn

from pdserve.weights.fp8 import Fp8Scheme, dequantize_weights, scaled_tensor
from pdserve.weights.hf_dir import read_config, weight_files
from pdserve.weights.mtp import MtpWeights

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors some checkpoints carry that are computed from the config anyway (RoPE's inverse frequencies).
_DERIVED = ("rotary_emb.inv_freq",)
_TOP_LEVEL = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # outside the layers
# transformers' in-memory layout of an MoE's experts, one 3-D tensor per projection (fused_experts)
_FUSED_EXPERTS = re.compile(r"^(.+\.experts\.)(gate_up_proj|down_proj)$")
# An FP8 KV cache's static scales (kv_quant.py): read by read_kv_scales for the cache, not the model's.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")


def load_weights(model: nn.Module, model_dir: Path, show_progress: bool = False) -> None:
    """Read only the tensors this stage needs; each parallel layer slices its own shard."""
    wanted: dict[str, torch.Tensor] = {}
    lo, hi = model.first_layer, model.first_layer + model.num_local_layers
    need_embed = model.embed_tokens is not None or (model.ps.is_last_stage and model.cfg.tie_word_embeddings)
    files = weight_files(model_dir)
    foreign = []  # outside the layers and not ours: every stage refuses them
    rename = checkpoint_renamer(model)
    skips = [(re.compile(pattern), what, []) for pattern, what in getattr(model, "CHECKPOINT_SKIPS", ())]
    config = read_config(model_dir)
    fp8, mtp = Fp8Scheme.from_config(config), MtpWeights(config, model.cfg.num_layers)
    for path in tqdm(files, desc="loading weights", disable=not show_progress):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                skip = next((names for pattern, _, names in skips if pattern.match(stored)), None)
                if skip is not None:
                    skip.append(stored)
                    continue
                name = rename(stored)
                m = _LAYER.match(name)
                top = scaled_tensor(name)  # an FP8 scale goes where its weight goes
                if _KV_SCALE.match(name) or mtp.claims(name):
                    keep = False
                elif m:
                    keep = lo <= int(m.group(1)) < hi
                    if int(m.group(1)) >= model.cfg.num_layers:  # a layer config.json does not name
                        foreign.append(name)
                elif top in _TOP_LEVEL:
                    keep = need_embed if top == "model.embed_tokens.weight" else model.ps.is_last_stage
                else:
                    keep = False
                    if not name.endswith(_DERIVED):
                        foreign.append(name)
                if keep:
                    for part, tensor in fused_experts(name, f.get_tensor(stored)):
                        if part in wanted:
                            raise ValueError(f"checkpoint holds {part!r} twice (once as {stored!r}): keep one spelling")
                        wanted[part] = tensor
    _refuse_unused(foreign)
    dequantize_weights(wanted, fp8, _serving_dtype(model))
    if model.ps.rank == 0:
        mtp.report()
        for _, what, names in skips:
            if names:
                log.info("skipped %d tensors of %s (%s, ...): pdserve does not serve it", len(names), what, names[0])
    _assign(model, wanted)


def _serving_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the projections are served in (a norm may be kept in float32 beside bf16 projections)."""
    return next((p.dtype for p in model.parameters() if p.ndim == 2 and p.is_floating_point()), torch.float32)


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """A stored tensor's name -> the name pdserve's layers load it by. A family whose published checkpoints
    name tensors otherwise (Nemotron-H's backbone.*) lists its `(pattern, replacement)` regexes, applied in
    order, as its model class's CHECKPOINT_RENAMES: the one place that family's mapping lives. (Its
    CHECKPOINT_SKIPS, `(pattern, what they are)` pairs, name the stored tensors it leaves unread.)"""
    renames = [(re.compile(pattern), repl) for pattern, repl in getattr(model, "CHECKPOINT_RENAMES", ())]

    def rename(stored: str) -> str:
        for pattern, repl in renames:
            stored = pattern.sub(repl, stored)
        return stored
    return rename


def fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the per-expert tensors the MoE block loads. Experts stored as transformers 5 holds
    them (save_pretrained(save_original_format=False)): `experts.gate_up_proj` [experts, 2 * inter, hidden], gate
    rows first, and `experts.down_proj` [experts, hidden, inter] -> `experts.{e}.gate_proj.weight`, ... (views);
    any other tensor as it is."""
    m = _FUSED_EXPERTS.match(name)
    if m is None or tensor.ndim != 3:
        return [(name, tensor)]
    prefix, kind = m.groups()
    if kind == "down_proj":
        return [(f"{prefix}{e}.down_proj.weight", down) for e, down in enumerate(tensor)]
    gate, up = tensor.chunk(2, dim=1)
    return [(f"{prefix}{e}.{proj}.weight", w[e]) for e in range(len(tensor)) for proj, w in (("gate_proj", gate),
                                                                                              ("up_proj", up))]


def read_kv_scales(model_dir: Path, rename: Callable[[str], str] = str) -> dict[int, tuple[float, float]]:
    """Global layer -> (k_scale, v_scale) of every layer whose checkpoint tensors carry both (scalars), each
    stored name read as `rename` (checkpoint_renamer of the model) maps it, as load_weights reads them."""
    found: dict[int, dict[str, float]] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                m = _KV_SCALE.match(name := rename(stored))
                if m:
                    t = f.get_tensor(stored)
                    if t.numel() != 1:
                        raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}: pdserve's FP8 KV "
                                         "cache takes one scale per layer (a scalar)")
                    found.setdefault(int(m.group(1)), {})[m.group(2)] = float(t.float().item())
    half = sorted(i for i, s in found.items() if len(s) != 2)
    if half:
        raise ValueError(f"checkpoint layers {half[:8]} carry only one of self_attn.k_scale / v_scale; both or neither")
    return {i: (s["k"], s["v"]) for i, s in found.items()}


def _refuse_unused(names: list[str]) -> None:
    if names:
        names = sorted(names)
        raise ValueError(f"checkpoint holds {len(names)} tensors pdserve's decoder has no place for "
                         f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): pdserve does not "
                         "implement what they compute, and without them the model would compute something else")


def _assign(model: nn.Module, w: dict[str, torch.Tensor]) -> None:
    def take(name: str) -> torch.Tensor:
        try:
            return w.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    cfg = model.cfg
    with torch.no_grad():
        if model.embed_tokens is not None:
            embed = w["model.embed_tokens.weight"]
            model.embed_tokens.load(embed)
        if model.ps.is_last_stage:
            model.norm.load(take("model.norm.weight"))
            if model.lm_head is not model.embed_tokens:
                head = w.get("lm_head.weight") if not cfg.tie_word_embeddings else None
                model.lm_head.load(head if head is not None else w["model.embed_tokens.weight"])
        for i, layer in enumerate(model.layers):
            layer.load(take, f"model.layers.{model.first_layer + i}.")
    w.pop("model.embed_tokens.weight", None)
    w.pop("lm_head.weight", None)  # tied: the embedding serves as the head
    _refuse_unused([n for n in w if not n.endswith(_DERIVED)])
