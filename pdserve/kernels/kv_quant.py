"""The FP8 KV cache (`kv_cache_dtype: fp8_e4m3`): per-tensor static scales.

Each layer of the pool has one K scale and one V scale (floats, 1.0 unless the checkpoint carries
`model.layers.N.self_attn.k_scale` / `v_scale`). A value x is stored as

    q = float8_e4m3fn(clamp(x / scale, -448, 448))      (saturating: finite x never becomes NaN)

and read back as `q * scale`. The scales are fixed for the life of the instance, so a block's bytes
mean the same thing wherever they land: nothing but the bytes travels in the KV exchange, and the two
instances prove at first contact that they use the same dtype and the same scales
(RankInfo.kv_dtype / kv_scale_scheme / kv_scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
SCHEME = "per_tensor_static"  # RankInfo.kv_scale_scheme of an FP8 pool; "none" for an unscaled one


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == FP8


@dataclass(frozen=True)
class KVScales:
    """k[i], v[i]: the scales of the pool's layer i (its local KV layers, in pool order)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KV scales: {len(self.k)} K scales but {len(self.v)} V scales")
        for name, s in (("k_scale", self.k), ("v_scale", self.v)):
            bad = [x for x in s if not (math.isfinite(x) and x > 0)]
            if bad:
                raise ValueError(f"KV {name} must be finite and positive, got {bad[0]!r}")

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @classmethod
    def from_checkpoint(cls, found: dict[int, tuple[float, float]], layer_ids: list[int]) -> "KVScales":
        """`found`: global layer -> (k_scale, v_scale) read from the checkpoint (loader.read_kv_scales);
        layer_ids: the pool's layers. No scales at all means 1.0; some layers without them is an error."""
        if not found:
            return cls.ones(len(layer_ids))
        missing = [i for i in layer_ids if i not in found]
        if missing:
            raise ValueError(f"the checkpoint carries KV scales (self_attn.k_scale / v_scale) for some layers but "
                             f"not for layers {missing[:8]}: an FP8 KV cache needs both scales of every attention "
                             "layer, or none (then 1.0)")
        return cls(tuple(float(found[i][0]) for i in layer_ids), tuple(float(found[i][1]) for i in layer_ids))


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn, saturated to +-448 (inf to 448; NaN stays NaN)."""
    y = x.float() / scale if scale != 1.0 else x.float()
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn q -> q * scale in `dtype` (every e4m3 value is exact in bf16, fp16 and fp32)."""
    if scale == 1.0:
        return q.to(dtype)
    return (q.float() * scale).to(dtype)


def dequant_tables(scales: KVScales) -> torch.Tensor:
    """[layers, 2, 2, 256] float32: [layer, c, part, byte] is what `byte` of that layer's K (part 0) or V
    (part 1) reads back as through `dequantize`, in compute dtype c (0 fp32, 1 bf16), widened to fp32
    (exactly). The native kernels read an FP8 pool through these tables (csrc/fp8.h), so they see the
    very values the PyTorch path reads."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    return torch.stack([torch.stack([torch.stack([dequantize(codes, s, dtype).float() for s in (k, v)])
                                     for dtype in (torch.float32, torch.bfloat16)])
                        for k, v in zip(scales.k, scales.v)]).contiguous()
