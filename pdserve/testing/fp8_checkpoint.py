"""FP8 test checkpoints, quantized from a checkpoint transformers' `save_pretrained` wrote, the way DeepSeek
publishes DeepSeek-V3 (and Qwen its Qwen3 FP8 releases): every projection weight of two dimensions to
float8_e4m3fn with one float32 `weight_scale_inv` per block (amax / 448, so a block's largest value maps to
e4m3's largest), or one per tensor; embeddings, lm_head, norms, a MoE router's gate, biases and MTP's eh_proj
stay as they were. config.json gains the publisher's `quantization_config`.

`make_tiny_deepseek_v3_fp8` makes the whole thing from the tiny DeepSeek-V3. `with_deepseek_mtp_layer` adds the multi-token-prediction layer DeepSeek-V3 ships past its decoder layers
(`num_nextn_predict_layers: 1`), named as the published checkpoint names it. `dequantized_copy` writes the
oracle's directory: the same checkpoint with every quantized weight multiplied out by a plain loop over its
blocks, for transformers to load as an unquantized model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
INDEX = "model.safetensors.index.json"
_UNQUANTIZED_PROJECTIONS = ("eh_proj",)  # DeepSeek's MTP input projection is published in bf16


def read_tensors(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def write_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor],
                     config: dict, shards: int = 3) -> Path:
    """`src_dir`'s tokenizer and generation files, `config`, and `tensors` in `shards` files named by an index,
    dealt round-robin in name order so that a weight and its scale mostly land in different shards."""
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (INDEX, "config.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}
    for file in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == file}, str(out / file),
                  metadata={"format": "pt"})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


def is_published_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The publisher's rule: a projection's 2-D weight, but for MTP's eh_proj."""
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return (name.endswith(".weight") and tensor.ndim == 2 and leaf.endswith(("_proj", "_proj_with_mqa"))
            and leaf not in _UNQUANTIZED_PROJECTIONS)


def quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale): one scale per `block` of [rows, columns], partial blocks at the
    edges; one scalar scale for `block` None."""
    w = weight.to(torch.float32)
    if block is None:
        scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12)
        return (w / scale).to(torch.float8_e4m3fn), scale
    (bo, bi), (rows, cols) = block, w.shape
    scale = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            scale[i, j] = (part.abs().max() / FP8_MAX).clamp(min=1e-12)
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp8 times its scale, block by block (float32)."""
    w = q.to(torch.float32)
    if block is None:
        return w * scale.to(torch.float32).reshape(())
    bo, bi = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] *= scale[i, j].item()
    return w


def quantize_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        block: tuple[int, int] | None = (128, 128), scale_name: str = "weight_scale_inv") -> Path:
    """`src_dir` (any checkpoint) with its projections in FP8 as the publisher quantizes them. `scale_name`:
    weight_scale_inv (DeepSeek, Qwen, transformers) or weight_scale (vLLM's per-tensor spelling)."""
    tensors = {}
    for name, t in read_tensors(src_dir).items():
        if is_published_quantized(name, t):
            q, s = quantize(t, block)
            tensors[name] = q
            tensors[name.removesuffix("weight") + scale_name] = s
        else:
            tensors[name] = t
    config = json.loads((Path(src_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if block else {})}
    return write_checkpoint(src_dir, out_dir, tensors, config)


def with_deepseek_mtp_layer(model_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """`model_dir` (a DeepSeek-V3 checkpoint) plus the MTP layer DeepSeek-V3 publishes as
    model.layers.{num_hidden_layers}: a decoder layer shaped as the last one, and enorm, hnorm, eh_proj
    [hidden, 2 * hidden], embed_tokens and shared_head.{norm, head}; config.json says num_nextn_predict_layers 1."""
    tensors = read_tensors(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    last, mtp, h = config["num_hidden_layers"] - 1, config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            tensors[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = torch.randn(t.shape, generator=g).to(t.dtype)
    p, dtype = f"model.layers.{mtp}.", tensors["model.embed_tokens.weight"].dtype
    extra = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,),
             "embed_tokens.weight": (config["vocab_size"], h), "shared_head.head.weight": (config["vocab_size"], h)}
    for name, shape in extra.items():
        tensors[p + name] = torch.randn(shape, generator=g).to(dtype)
    config["num_nextn_predict_layers"] = 1
    return write_checkpoint(model_dir, out_dir, tensors, config)


def dequantized_copy(fp8_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """The oracle's checkpoint: `fp8_dir` with each FP8 weight multiplied out (dequantize_reference), its scales
    and quantization_config gone, and MTP layers (which transformers' class does not build) left out."""
    config = json.loads((Path(fp8_dir) / "config.json").read_text())
    q = config.pop("quantization_config")
    block = tuple(q["weight_block_size"]) if q.get("weight_block_size") else None
    layers = config.get("num_hidden_layers")  # (none in Nemotron-H's, which counts layers_block_type)
    tensors = read_tensors(fp8_dir)
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if layers is not None and name.startswith("model.layers.") and int(parts[2]) >= layers:
            continue
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
        out[name] = dequantize_reference(t, scale, block) if scale is not None else t
    config["num_nextn_predict_layers"] = 0
    return write_checkpoint(fp8_dir, out_dir, out, config, shards=1)


def make_tiny_deepseek_v3_fp8(root: str | os.PathLike, block: tuple[int, int] = (16, 24), **tiny) -> tuple[Path, Path]:
    """(FP8 checkpoint, the oracle's dequantized copy) under `root`: the tiny DeepSeek-V3 (`tiny`: its
    make_tiny_deepseek_v3 arguments) saved by transformers' save_pretrained of DeepseekV3ForCausalLM, its MTP
    layer added and its projections quantized in `block`s, in 3 shards."""
    import transformers

    from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

    root = Path(root)
    src = make_tiny_deepseek_v3(root / "src", **tiny)
    published = root / "published"
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(published)
    for f in src.iterdir():  # save_pretrained of a model writes no tokenizer
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, published / f.name)
    fp8 = quantize_checkpoint(with_deepseek_mtp_layer(published, root / "mtp"), root / "fp8", block=block)
    return fp8, dequantized_copy(fp8, root / "dequantized")
