"""FP8 weights as published (config.json `quantization_config: {quant_method: fp8, ...}`): DeepSeek-V3 / R1 /
V3.1, Qwen3, Qwen3.5 and Nemotron FP8 checkpoints. pdserve dequantizes each such weight once, at load, to the
serving dtype; the products then run as for any unquantized checkpoint.

A quantized projection is stored as two tensors, the rest of the checkpoint (embeddings, lm_head, norms, a MoE
router's gate, biases) as it is:

    X.weight            float8_e4m3fn  [..., out, in]
    X.weight_scale_inv  float32        [..., ceil(out / bo), ceil(in / bi)]   weight_block_size [bo, bi]
      or, per tensor (no weight_block_size), one scalar: X.weight_scale_inv (transformers) or X.weight_scale (vLLM)

    weight[r, c] = fp8[r, c] * scale[r // bo, c // bi]          (despite its name, `_inv` multiplies)

      in ->   bi     bi    edge
            +------+------+---+
       bo   | s00  | s01  |s02|    a dimension that is no multiple of the block size ends in a partial block:
            +------+------+---+    its scale covers only the rows / columns that are there
     edge   | s10  | s11  |s12|
            +------+------+---+

`input_scale` / `activation_scale` (static activation quantization) scale activations into FP8 for an FP8
product; dequantized weights multiply unquantized activations, so they are read and dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_METHODS = ("fp8",)
_WEIGHT_SCALES = (".weight_scale_inv", ".weight_scale")
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
_FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 weights are scaled: `block` (rows, columns) per scale, None for one per tensor."""

    block: tuple[int, int] | None
    ue8m0: bool = False  # scales may be stored as bytes holding a power of two's exponent (DeepSeek-V3.1's scale_fmt)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Scheme | None:
        """The scheme config.json's quantization_config describes; None when the checkpoint is not quantized."""
        q = config.get("quantization_config")
        if q is None and isinstance(config.get("text_config"), dict):  # a vision-language wrapper's text model
            q = config["text_config"].get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method")
        if method not in SUPPORTED_METHODS:
            raise ValueError(f"config.json quantization_config.quant_method is {method!r}: pdserve loads "
                             f"{list(SUPPORTED_METHODS)} only (float8_e4m3fn weights with block-wise weight_scale_inv "
                             "or one scale per tensor); use the checkpoint's unquantized (bf16) release, or an FP8 one")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"config.json quantization_config.fmt is {fmt!r}: pdserve's FP8 weights are e4m3 "
                             "(float8_e4m3fn) only")
        scale_fmt = q.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"config.json quantization_config.scale_fmt is {scale_fmt!r}: pdserve reads 'float' "
                             "and 'ue8m0' scales")
        block = q.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"config.json quantization_config.weight_block_size is {block!r}: two positive "
                                 "integers [rows, columns] (DeepSeek-V3's is [128, 128]), or absent for one scale "
                                 "per tensor")
            block = (block[0], block[1])
        return cls(block=block, ue8m0=scale_fmt == "ue8m0")

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`name`'s FP8 `weight` times its `scale` (module docstring), in `dtype`."""
        if weight.dtype not in _FP8_DTYPES:
            raise ValueError(f"checkpoint tensor {name} is {weight.dtype} beside a scale: an FP8 weight is "
                             "float8_e4m3fn")
        scale = self._scale_values(name, scale)
        w = weight.to(torch.float32)
        if scale.numel() == 1 and self.block is None:
            return (w * scale.reshape(())).to(dtype)
        if self.block is None:
            raise ValueError(f"checkpoint tensor {name}'s scale has shape {tuple(scale.shape)} but config.json "
                             "names no weight_block_size: one scale per tensor expected")
        (bo, bi), (rows, cols) = self.block, w.shape[-2:]
        grid = (*w.shape[:-2], math.ceil(rows / bo), math.ceil(cols / bi))
        if tuple(scale.shape) != grid:
            raise ValueError(f"checkpoint tensor {name} of shape {tuple(w.shape)} has a scale of shape "
                             f"{tuple(scale.shape)}; weight_block_size {list(self.block)} gives {grid}")
        # Pad to whole blocks, view as [..., grid_rows, bo, grid_cols, bi] and scale each block by broadcasting
        # (4x faster than expanding the scales to the weight's shape), then crop the padding off.
        w = torch.nn.functional.pad(w, (0, grid[-1] * bi - cols, 0, grid[-2] * bo - rows))
        w = w.unflatten(-1, (grid[-1], bi)).unflatten(-3, (grid[-2], bo)).mul_(scale[..., :, None, :, None])
        return w.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(dtype).contiguous()

    def _scale_values(self, name: str, scale: torch.Tensor) -> torch.Tensor:
        if scale.dtype == torch.uint8:
            if not self.ue8m0:
                raise ValueError(f"checkpoint tensor {name}'s scale is stored as bytes (uint8), which config.json's "
                                 "quantization_config allows only with scale_fmt 'ue8m0'")
            return scale.view(torch.float8_e8m0fnu).to(torch.float32)
        if not scale.dtype.is_floating_point:
            raise ValueError(f"checkpoint tensor {name}'s scale is {scale.dtype}: a float scale expected")
        return scale.to(torch.float32)


def scaled_tensor(name: str) -> str:
    """The weight a scale belongs to (`X.weight_scale_inv` -> `X.weight`); any other name as it is."""
    for suffix in _WEIGHT_SCALES + _ACTIVATION_SCALES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return name


def dequantize_weights(tensors: dict[str, torch.Tensor], scheme: Fp8Scheme | None, dtype: torch.dtype) -> int:
    """In place: each FP8 weight in `tensors` replaced by its dequantized values in `dtype`, and every scale
    removed. Returns how many weights were dequantized. A quantized tensor without its scale, a scale without
    its weight, or FP8 tensors in a checkpoint whose config.json declares no quantization are errors: loaded
    any other way the model would compute something else."""
    scales = {n: tensors.pop(n) for n in [n for n in tensors if n.endswith(_WEIGHT_SCALES)]}
    for n in [n for n in tensors if n.endswith(_ACTIVATION_SCALES)]:
        del tensors[n]
    if scheme is None:
        fp8 = sorted(n for n, t in tensors.items() if t.dtype in _FP8_DTYPES) + sorted(scales)
        if fp8:
            raise ValueError(f"checkpoint holds FP8 weights or their scales ({', '.join(fp8[:3])}"
                             f"{', ...' if len(fp8) > 3 else ''}) but config.json has no quantization_config: add "
                             "the publisher's ({quant_method: fp8, weight_block_size: [...]}) or use an unquantized "
                             "checkpoint")
        return 0
    for scale_name, scale in scales.items():
        name = scaled_tensor(scale_name)
        if name not in tensors:
            raise ValueError(f"checkpoint holds the FP8 scale {scale_name} but not the weight {name} it scales")
        tensors[name] = scheme.dequantize(name, tensors[name], scale, dtype)
    unscaled = sorted(n for n, t in tensors.items() if t.dtype in _FP8_DTYPES)
    if unscaled:
        raise ValueError(f"checkpoint tensors {unscaled[:3]} are FP8 with no weight_scale_inv / weight_scale beside "
                         "them: without it their values are unknown")
    return len(scales)
