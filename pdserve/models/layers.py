"""Building blocks that know their tensor-parallel shard and how to load it.

Each parallel layer takes the *full* checkpoint tensor in `load` and keeps only its slice, so the
model file never does shard arithmetic.

On CPU, `pack_for_cpu(model)` then hands every linear weight to oneDNN once, in its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`), and `linear` runs oneDNN's GEMM on it, which streams
the weights faster than the plain F.linear path (MKL) in decode and prefill alike. Elsewhere (CUDA,
fp16 on CPU, bf16 on a CPU whose oneDNN cannot take it: `onednn_packs`) the weights stay plain and
`linear` is F.linear.

A decode step of a few sequences is the exception: oneDNN's GEMM streams the weights slower there
than a plain loop over their rows, so `pack_for_cpu(model, gemv=True)` keeps each linear's plain
weight beside the packed one as `gemv_weight`, and `linear` sends decode steps (`decode_step`) of
`cpu.SKINNY_ROWS` rows (up to 16, but for 9-11 fp32 rows) to the native GEMV
(`cpu.skinny_linear`). That costs the linear weights' memory a second time
(`cpu_decode_gemv` in the engine config).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.host_malloc import huge_page_buffer
from pdserve.kernels import cpu, gemm
from pdserve.models.shapes import RopeScaling
from pdserve.parallel.state import ParallelState


log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes oneDNN's GEMM and the native GEMV may take


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's CPU GEMM takes `dtype` on this machine. fp32 everywhere oneDNN is built in; bf16
    only where torch's own check passes (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere packing a bf16
    weight raises, and so does oneDNN's linear on a plain one, so such a machine keeps bf16 weights plain
    and multiplies them with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Whether the step being run has decode rows only. Only then do linears take the GEMV: a prefill chunk
# keeps oneDNN's GEMM whatever its length, so a prompt's logits do not depend on how it was chunked
# (oneDNN's rows come out the same at any row count; a chunk of a few rows on the GEMV would not).
_DECODE_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("decode_step", default=False)


@contextlib.contextmanager
def decode_step(decode_only: bool):
    """Marks the model calls inside as a step of decode rows only (AttentionMetadata.decode_only)."""
    token = _DECODE_STEP.set(decode_only)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gemv_weight: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] @ weight: [out, in] (plain, or packed by `pack_for_cpu`) -> [..., out]; in a decode
    step (`decode_step`) of cpu.SKINNY_ROWS rows, the native GEMV, when the layer keeps a plain
    `gemv_weight`; a plain bf16 weight where oneDNN takes no bf16, the native bf16 GEMM (kernels/gemm.py)."""
    if (gemv_weight is not None and _DECODE_STEP.get()
            and x.numel() // x.shape[-1] in cpu.SKINNY_ROWS.get(x.dtype, ())):
        out = cpu.skinny_linear(x, gemv_weight, bias)
        if out is not None:
            return out
    if weight.is_mkldnn:
        return onednn_linear(x, weight, bias)
    if (x.dtype == torch.bfloat16 and x.numel() >= gemm.MIN_ROWS * x.shape[-1] and not _onednn_bf16()
            and cpu.native(cpu.GEMM, x.dtype)):
        out = gemm.gemm_bf16(x, weight, bias)  # (kernels/dispatch.py: where it beats F.linear)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_bf16() -> bool:
    return onednn_packs(torch.bfloat16)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T through oneDNN's CPU GEMM; `weight` packed by `pack_for_cpu`, or a plain contiguous
    [out, in] tensor (the tiled attention multiplies by K and V this way)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach()), requires_grad=False)


def pack_for_cpu(model: nn.Module, gemv: bool = False) -> None:
    """Repack every linear weight for oneDNN (see the module docstring); a no-op off CPU, for dtypes
    oneDNN's CPU GEMM does not take, or when torch was built without it. With `gemv`, each linear also
    keeps its plain weight for steps of a few rows (where the native GEMV runs)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    gemv = gemv and on_cpu and cpu.skinny_linear_runs()  # off CPU: no kernel build, no probe
    lookup = getattr(model, "embed_tokens", None)
    linears = [m for m in model.modules()
               if isinstance(m, _LINEARS) and m.weight.device.type == "cpu" and m.weight.dtype in _FLOAT_DTYPES]
    plain = _in_huge_pages([m.weight.detach() for m in linears]) if gemv else []
    kept = 0  # bytes of plain weights kept beside packed ones
    for i, m in enumerate(linears):
        packing = onednn_packs(m.weight.dtype)
        if gemv:
            m.gemv_weight = plain[i]  # a plain tensor (not a parameter)
            kept += plain[i].numel() * plain[i].element_size() if packing else 0
        if packing:
            m.weight = _packed(m.weight)
        elif gemv:  # one copy: the layer reads the GEMV's
            m.weight = nn.Parameter(plain[i], requires_grad=False)
    for m in model.modules():
        if (isinstance(m, VocabParallelEmbedding) and m.weight.device.type == "cpu"
                and onednn_packs(m.weight.dtype)):
            if m is getattr(model, "lm_head", None):
                m.head_weight = _packed(m.weight)
                if m is not lookup:
                    m.weight = None  # an untied head never looks rows up: drop the plain copy
            # A tied head keeps both: the lookup needs plain rows, the head the packed matrix.
    if any(m.weight is not None and not m.weight.is_mkldnn and m.weight.dtype == torch.bfloat16 for m in linears):
        log.warning("bf16 on this CPU: oneDNN's bf16 GEMM needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, so the "
                    "bf16 weights stay plain and multiply through the native bf16 GEMM (kernels/gemm.py) where it is "
                    "built and faster, else F.linear; float32 may be the faster dtype here")
    if kept:
        log.info("decode GEMV: keeping plain linear weights beside oneDNN's packed ones (+%.0f MB; "
                 "cpu_decode_gemv: false keeps one copy)", kept / 1e6)


def _in_huge_pages(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `weights` side by side in one buffer of transparent huge pages (host_malloc), each on a
    cache line: the GEMV streams them at a step's every layer (why: host_malloc.huge_page_buffer)."""
    line = 64
    sizes = [-(-w.numel() * w.element_size() // line) * line for w in weights]
    buf = huge_page_buffer(sum(sizes))
    out, at = [], 0
    for w, size in zip(weights, sizes):
        nbytes = w.numel() * w.element_size()
        out.append(buf[at:at + nbytes].view(w.dtype).view(w.shape).copy_(w))
        at += size
    return out


def _shard(full: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    size = full.shape[dim]
    if size % parts:
        raise ValueError(f"cannot split dimension {dim} of size {size} into {parts} tensor-parallel shards")
    step = size // parts
    return full.narrow(dim, rank * step, step)


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T with W split by output rows; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        if out_features % ps.tp_size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {ps.tp_size}")
        self.ps = ps
        self.weight = nn.Parameter(torch.empty(out_features // ps.tp_size, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features // ps.tp_size, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.gemv_weight: torch.Tensor | None = None  # plain copy for steps of a few rows (pack_for_cpu)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(_shard(weight, 0, self.ps.tp_rank, self.ps.tp_size))
        if self.bias is not None:
            self.bias.copy_(_shard(bias, 0, self.ps.tp_rank, self.ps.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemv_weight)


class ReplicatedLinear(ColumnParallelLinear):
    """y = x @ W.T with the whole W on every rank (MLA's down-projections to its shared latents)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ps: ParallelState, dtype: torch.dtype):
        nn.Module.__init__(self)  # not ColumnParallelLinear's: nothing is split
        self.ps = ps
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.gemv_weight: torch.Tensor | None = None  # plain copy for steps of a few rows (pack_for_cpu)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(weight)
        if self.bias is not None:
            self.bias.copy_(bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate+up)."""

    def __init__(self, in_features: int, out_sizes: list[int], ps: ParallelState, dtype: torch.dtype):
        super().__init__(in_features, sum(out_sizes), False, ps, dtype)
        self.out_sizes = out_sizes

    def load(self, weights: list[torch.Tensor]) -> None:  # type: ignore[override]
        shards = [_shard(w, 0, self.ps.tp_rank, self.ps.tp_size) for w in weights]
        self.weight.copy_(torch.cat(shards, dim=0))


class QKVParallelLinear(nn.Module):
    """Fused q/k/v projection. Query heads split evenly; KV heads split, or replicated when
    num_kv_heads < tp_size (each group of tp_size/num_kv_heads ranks shares one KV head)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        tp = ps.tp_size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tp}: one must divide the other")
        self.ps = ps
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_head_start = (ps.tp_rank * num_kv_heads) // tp if num_kv_heads < tp else ps.tp_rank * self.num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(out, hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        self.gemv_weight: torch.Tensor | None = None  # plain copy for steps of a few rows (pack_for_cpu)

    def _slices(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        q = q.narrow(0, self.ps.tp_rank * self.num_heads * d, self.num_heads * d)
        k = k.narrow(0, self.kv_head_start * d, self.num_kv_heads * d)
        v = v.narrow(0, self.kv_head_start * d, self.num_kv_heads * d)
        return torch.cat([q, k, v], dim=0)

    def load(self, q, k, v, q_bias=None, k_bias=None, v_bias=None) -> None:
        self.weight.copy_(self._slices(q, k, v))
        if self.bias is not None:
            self.bias.copy_(self._slices(q_bias, k_bias, v_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, (local heads + 2 * local kv heads) * head_dim]: q, then k, then v."""
        return linear(x, self.weight, self.bias, self.gemv_weight)


class RowParallelLinear(nn.Module):
    """y = x @ W.T with W split by input columns; partial sums are all-reduced across TP, unless `reduce`
    is False: then each rank returns its partial sum and the caller reduces (a MoE block sums its experts'
    partial outputs first, and all-reduces once)."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, dtype: torch.dtype,
                 reduce: bool = True, bias: bool = False):
        super().__init__()
        self.reduce = reduce
        if in_features % ps.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {ps.tp_size}")
        self.ps = ps
        self.weight = nn.Parameter(torch.empty(out_features, in_features // ps.tp_size, dtype=dtype),
                                   requires_grad=False)
        # The whole bias on every rank, added once: inside the product on one rank, after the all-reduce on more.
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.gemv_weight: torch.Tensor | None = None  # plain copy for steps of a few rows (pack_for_cpu)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(_shard(weight, 1, self.ps.tp_rank, self.ps.tp_size))
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = self.ps.tp_size == 1
        partial = linear(x, self.weight, self.bias if whole else None, gemv_weight=self.gemv_weight)
        if whole or not self.reduce:
            return partial
        out = self.ps.tp_all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)


_LINEARS = (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks; out-of-shard ids contribute zeros before the all-reduce.
    The same shard doubles as a vocab-parallel LM head (tied embeddings)."""

    def __init__(self, vocab_size: int, hidden: int, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.ps = ps
        self.shard_size = math.ceil(vocab_size / ps.tp_size)
        self.vocab_size = vocab_size
        self.start = ps.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden, dtype=dtype), requires_grad=False)
        self.head_weight: torch.Tensor | None = None  # the LM head's packed copy (pack_for_cpu)

    def load(self, weight: torch.Tensor) -> None:
        rows = weight[self.start:self.start + self.shard_size]
        self.weight[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.ps.tp_all_reduce(out)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] -> full-vocabulary logits [n, vocab] on every TP rank."""
        weight = self.head_weight if self.head_weight is not None else self.weight
        full = self.ps.tp_all_gather_last_dim(linear(h, weight))
        return full[..., : self.vocab_size]


@functools.cache
def _fused_norm():
    """triton_norm.rms_norm (the residual add and the norm in one kernel), or None without Triton."""
    try:
        from pdserve.kernels import triton_norm
    except ImportError:
        return None
    return triton_norm.rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = cpu.native(cpu.RMS_NORM, x.dtype)  # (kernels/dispatch.py: where it beats PyTorch)
        out = cpu.rms_norm(x, self.weight, self.eps) if native else None  # one call, the same rounding
        if out is None and x.is_cuda and _fused_norm() is not None:  # one Triton kernel (triton_norm.py)
            out = _fused_norm()(x, self.weight, self.eps)
        return out[1] if out is not None else self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch form: normalise in fp32, as the reference implementation does, then cast back
        before the weight."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same rounding
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight

    def add_and_norm(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + y: the residual add fused with the norm that follows it."""
        if cpu.native(cpu.RMS_NORM, x.dtype):
            native = cpu.rms_norm(y, self.weight, self.eps, residual=x)
            if native is not None:
                return native
        if x.is_cuda and _fused_norm() is not None:
            fused = _fused_norm()(y, self.weight, self.eps, residual=x)
            if fused is not None:
                return fused
        h = x + y
        return h, self(h)


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, out)


ROPE_HALVES_MIN_TOKENS = 64  # RotaryEmbedding.rotate's form for this many tokens and more


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        # cos: [max_positions, head_dim]
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)
        # rotate_half(x) = [-x2, x1]: its minus sign is folded into the first half of sin.
        sin = freqs.sin()
        self.register_buffer("signed_sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for `rotate`, [n, 1, head_dim] each; looked up once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [n, heads, head_dim] -> x * cos + rotate_half(x) * sin, in fp32, cast back.

        The minus sign of rotate_half lives in the table's sin, so the halves only swap. Two forms of
        the same sum: for a few tokens (decode), flip the halves and add two products (fewest ops);
        for many (prefill), the swapped products are written half by half into an fp32 buffer, which
        avoids converting a flipped view; below ROPE_HALVES_MIN_TOKENS the flip form is the cheaper.
        Both round every product and the sum alike, so a token gets the same bits whichever form a
        batch takes (no fused multiply-add)."""
        cos, signed_sin = table
        n, heads, d = x.shape
        if n < ROPE_HALVES_MIN_TOKENS:
            swapped = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)
            return (x.float() * cos + swapped.float() * signed_sin).to(x.dtype)
        xf = x.float().view(n, heads, 2, d // 2)
        cos, signed_sin = cos.view(n, 1, 2, d // 2), signed_sin.view(n, 1, 2, d // 2)
        out, rotated = torch.mul(xf, cos), torch.empty_like(xf)
        torch.mul(xf[:, :, 1], signed_sin[:, :, 0], out=rotated[:, :, 0])
        torch.mul(xf[:, :, 0], signed_sin[:, :, 1], out=rotated[:, :, 1])
        return out.add_(rotated).view(n, heads, d).to(x.dtype)
