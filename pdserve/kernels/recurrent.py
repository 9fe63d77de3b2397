"""The hybrid models' recurrent mixers in one native call per layer and step (`csrc/recurrent.c`): Gated
DeltaNet (gated_deltanet.py) and Mamba2 (mamba2.py), from their input projections' outputs to the gated
norm that feeds the output projection, the conv and SSM states read and written in place in their pool slots.

The library is built from `csrc/recurrent.c` alone with cpu.build (its own cache entry), and loaded
as cpu.load loads the main one: `PDSERVE_CPU_KERNELS=0` or no working C compiler leaves every wrapper here
returning None, and the mixer keeps its PyTorch path (the reason is logged once).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Protocol

import torch

from pdserve.env import CPU_KERNELS, settings
from pdserve.kernels import cpu

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "recurrent.c"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # REC_F32, REC_BF16 in csrc/recurrent.c


class StateSlice(Protocol):
    """One sequence's rows in a step, as the kernels read them (the models' recurrent_state.StateSlice)."""

    q_start: int  # first row of the sequence in the step's flattened tokens
    q_len: int
    fresh: bool  # no tokens before this chunk: the state starts at zero
    slot: int  # its slot in the state pools


class _ConvArgs(ctypes.Structure):
    """Mirror of `conv_args` in csrc/recurrent.c; field order and types must match."""

    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("state", ctypes.c_void_p),
                ("slot_stride", ctypes.c_int64), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("channels", ctypes.c_int64), ("taps", ctypes.c_int64)]


_SEQS = [("seqs", ctypes.c_void_p), ("nseq", ctypes.c_int64), ("rows", ctypes.c_int64), ("out", ctypes.c_void_p)]


class _DeltaNetArgs(ctypes.Structure):
    """Mirror of `deltanet_args` in csrc/recurrent.c."""

    _fields_ = [("conv", _ConvArgs), ("z", ctypes.c_void_p), ("z_stride", ctypes.c_int64), ("b", ctypes.c_void_p),
                ("a", ctypes.c_void_p), ("b_stride", ctypes.c_int64), ("a_stride", ctypes.c_int64),
                ("neg_a", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("norm_eps", ctypes.c_float), ("ssm", ctypes.c_void_p), ("ssm_slot_stride", ctypes.c_int64),
                ("num_slots", ctypes.c_int64), ("k_heads", ctypes.c_int64), ("v_heads", ctypes.c_int64),
                ("k_dim", ctypes.c_int64), ("v_dim", ctypes.c_int64)] + _SEQS


class _Mamba2Args(ctypes.Structure):
    """Mirror of `mamba2_args` in csrc/recurrent.c."""

    _fields_ = [("conv", _ConvArgs), ("z", ctypes.c_void_p), ("z_stride", ctypes.c_int64), ("dt", ctypes.c_void_p),
                ("dt_stride", ctypes.c_int64), ("neg_a", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("dt_min", ctypes.c_float), ("norm_weight", ctypes.c_void_p),
                ("norm_eps", ctypes.c_float), ("ssm", ctypes.c_void_p), ("ssm_slot_stride", ctypes.c_int64),
                ("num_slots", ctypes.c_int64), ("heads", ctypes.c_int64), ("groups", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("state_size", ctypes.c_int64)] + _SEQS


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The library, built on first call; None (reason logged once) where it cannot be."""
    global _lib, _tried
    if _lib is not None:
        return _lib
    with _lock:
        if _tried:
            return _lib
        enabled = settings().cpu_kernels  # (first, as in cpu.load)
        _tried = True
        if not enabled:
            log.info("%s=0: the recurrent layers run in PyTorch", CPU_KERNELS)
            return None
        try:
            lib = ctypes.CDLL(str(cpu.build(sources=SOURCES)))
        except (cpu.KernelBuildError, OSError) as exc:
            log.warning("native recurrent kernels unavailable, the recurrent layers run in PyTorch: %s", exc)
            return None
        lib.deltanet_forward.argtypes = [ctypes.POINTER(_DeltaNetArgs), ctypes.c_int, ctypes.c_int]
        lib.deltanet_forward.restype = ctypes.c_int
        lib.mamba2_forward.argtypes = [ctypes.POINTER(_Mamba2Args), ctypes.c_int, ctypes.c_int]
        lib.mamba2_forward.restype = ctypes.c_int
        _lib = lib
        return _lib


_last_seqs: tuple[list[StateSlice] | None, torch.Tensor | None] = (None, None)


def _seq_table(seqs: list[StateSlice]) -> torch.Tensor:
    """[nseq, 4] int64 (q_start, q_len, slot, fresh), built once per step: every recurrent layer of a step
    gets the same list."""
    global _last_seqs
    if _last_seqs[0] is seqs:
        return _last_seqs[1]
    table = torch.tensor([[s.q_start, s.q_len, s.slot, int(s.fresh)] for s in seqs], dtype=torch.int64)
    _last_seqs = (seqs, table)
    return table


def _conv(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> _ConvArgs:
    """x: [rows, channels] (unit stride along channels); conv: the layer's pool [num_slots, channels, taps - 1]."""
    return _ConvArgs(x.data_ptr(), x.stride(0), conv.data_ptr(), conv.stride(0), weight.data_ptr(),
                     None if bias is None else bias.data_ptr(), weight.shape[0], weight.shape[-1])


def _applies(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return dtype in _DTYPES and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def _run(fn, args, dtype: torch.dtype, what: str, num_slots: int) -> bool:
    status = fn(ctypes.byref(args), _DTYPES[dtype], torch.get_num_threads())
    if status == -2:
        raise IndexError(f"{what}: a sequence's rows or state slot lie outside the step's rows or the pool of "
                         f"{num_slots} slots")
    if status == -3:
        raise MemoryError(f"{what}: out of memory for the step's scratch")
    return status == 0


def deltanet_forward(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor,
                     ssm: torch.Tensor, seqs: list[StateSlice], conv_weight: torch.Tensor, neg_a: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
                     k_heads: int) -> torch.Tensor | None:
    """Gated DeltaNet from its projections to its gated norm, for every sequence of a step.

    qkv: [n, q | k | v channels]; z: [n, v_heads * v_dim]; b, a: [n, v_heads] (all the model's dtype);
    conv: the layer's conv pool [num_slots, channels, taps - 1] (the model's dtype); ssm: the layer's pool
    [num_slots, v_heads, k_dim, v_dim] fp32; conv_weight [channels, 1, taps] and norm_weight [v_dim] in the
    model's dtype; neg_a = -exp(A_log), dt_bias: [v_heads] fp32. Returns [n, v_heads * v_dim] in the model's
    dtype, or None where the kernel does not apply (then nothing was touched)."""
    dtype = qkv.dtype
    if (not _applies(dtype, qkv, z, b, a)
            or not all(t.dtype == dtype for t in (z, b, a, conv, conv_weight, norm_weight)) or ssm.dtype != torch.float32 or not conv[0].is_contiguous() or not ssm[0].is_contiguous()
            or not conv_weight.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    n = qkv.shape[0]
    v_heads, k_dim, v_dim = ssm.shape[1:]
    table = _seq_table(seqs)
    out = torch.empty(n, v_heads * v_dim, dtype=dtype)
    args = _DeltaNetArgs(_conv(qkv, conv, conv_weight, None), z.data_ptr(), z.stride(0), b.data_ptr(), a.data_ptr(),
                         b.stride(0), a.stride(0), neg_a.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(),
                         norm_eps, ssm.data_ptr(), ssm.stride(0), ssm.shape[0], k_heads, v_heads, k_dim, v_dim,
                         table.data_ptr(), table.shape[0], n, out.data_ptr())
    return out if _run(lib.deltanet_forward, args, dtype, "Gated DeltaNet", ssm.shape[0]) else None


def mamba2_forward(z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                   seqs: list[StateSlice], conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                   neg_a: torch.Tensor, dt_bias: torch.Tensor, d: torch.Tensor, dt_min: float,
                   norm_weight: torch.Tensor, norm_eps: float, groups: int) -> torch.Tensor | None:
    """Mamba2 from its input projection's [z | xBC | dt] to its gated norm, for every sequence of a step.

    z: [n, heads * head_dim]; xbc: [n, conv channels]; dt: [n, heads] raw (views of the projection's rows,
    the model's dtype); conv: the layer's pool [num_slots, channels, taps - 1] (the model's dtype); ssm: the
    layer's pool [num_slots, heads, head_dim, state] fp32; conv_weight [channels, 1, taps], conv_bias and
    norm_weight in the model's dtype; neg_a = -exp(A_log), dt_bias, d: [heads] fp32. Returns
    [n, heads * head_dim] in the model's dtype, or None where the kernel does not apply."""
    dtype = xbc.dtype
    tensors = (z, dt, conv, conv_weight, norm_weight) + (() if conv_bias is None else (conv_bias,))
    if (not _applies(dtype, z, xbc, dt) or not all(t.dtype == dtype for t in tensors) or ssm.dtype != torch.float32
            or not conv[0].is_contiguous() or not ssm[0].is_contiguous() or not conv_weight.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    n = xbc.shape[0]
    heads, head_dim, state = ssm.shape[1:]
    table = _seq_table(seqs)
    out = torch.empty(n, heads * head_dim, dtype=dtype)
    args = _Mamba2Args(_conv(xbc, conv, conv_weight, conv_bias), z.data_ptr(), z.stride(0), dt.data_ptr(),
                       dt.stride(0), neg_a.data_ptr(), dt_bias.data_ptr(), d.data_ptr(), dt_min,
                       norm_weight.data_ptr(), norm_eps, ssm.data_ptr(), ssm.stride(0), ssm.shape[0], heads, groups,
                       head_dim, state, table.data_ptr(), table.shape[0], n, out.data_ptr())
    return out if _run(lib.mamba2_forward, args, dtype, "Mamba2", ssm.shape[0]) else None
