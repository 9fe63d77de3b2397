"""Native CPU kernels, compiled from `csrc/` on first use and loaded with ctypes.

- paged decode attention (`csrc/paged_decode.c`): one query token per sequence, K and V read
  straight from the pool through the block table. The PyTorch path gathers the blocks into a dense
  copy and runs SDPA over it; the kernel reads the KV once instead of three times.
- flash prefill attention (`csrc/flash_prefill.c`): causal attention of a prefill chunk in one pass
  over the keys with an online softmax, nothing of size queries x keys in memory; bf16 products on
  CPUs with AVX512-BF16; fp32 tiles sized for AVX2 where the build has AVX2 + FMA but no AVX-512.
- RoPE and cache write (`csrc/rope_cache.c`): q and k rotated, K and V stored into their slots,
  bit-identical to the PyTorch ops it replaces (some fifteen a layer).
- RMSNorm (`csrc/rms_norm.c`): one call instead of five to eight PyTorch ops, which at a decode step
  cost more in dispatch than in arithmetic.
- a GEMV for decode steps of a few sequences (`csrc/skinny_linear.c`): a few rows times a plain
  weight matrix; oneDNN's GEMM streams the weights slower there (`SKINNY_ROWS`).
- a batch-1 decode step through a stage's layers (`csrc/decode_layers.c`), chaining the kernels above
  in C; its ctypes side is `kernels/stage_decoder.py`.
- the tensor-parallel all-reduce of one host's ranks through a shared segment
  (`csrc/shm_all_reduce.c`); its ctypes side is `parallel/shm_all_reduce.py`.

An FP8 KV pool (kv_quant.py) is read and written by the kernels that touch the pool: its view carries the
layer's scales and its dequantisation tables (csrc/pool.h, csrc/fp8.h), and the values they read are the
PyTorch path's. Every `csrc/*.c` goes into one library (with `csrc/gemm_bf16.c`, kernels/gemm.py's bf16 GEMM).

Build: the machine's C compiler (`$CC`, else `cc`) with `-O3 -march=native -fopenmp`, into
`$PDSERVE_KERNEL_CACHE` (default `$PDSERVE_CACHE_DIR/kernels`, ~/.cache/pdserve/kernels; pdserve/env.py)
under a name that hashes the source, the flags, the compiler's version and this CPU's feature flags, so a
cache shared between machines never loads a binary built for another CPU. A build is written to a temporary
file and renamed into place, so ranks that build at once all end up loading one complete library. The
library links the process's libgomp (the one PyTorch loaded), so its threads are PyTorch's OpenMP threads.

Where no compiler works, or with `PDSERVE_CPU_KERNELS=0`, every wrapper here returns None and the
caller keeps its PyTorch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.env import CPU_KERNELS, settings
from pdserve.kernels.kv_quant import FP8, KVScales, dequant_tables

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))  # with the headers beside them (*.h)
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]  # libm, which pulls in libmvec for the vectorised expf
LINK_FLAGS = ["-shared", "-fopenmp"]
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, FP8: 3}  # KV_* in csrc/pool.h
_FLOAT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # activations: the first two of the same enum


class _PoolView(ctypes.Structure):
    """Mirror of `pool_view` in csrc/pool.h (one layer of a KV pool); field order and types must match."""

    _fields_ = [("base", ctypes.c_void_p)] + [(name, ctypes.c_int64) for name in (
        "layer_offset", "block_stride", "kv_stride", "head_stride", "token_stride",
        "num_blocks", "kv_heads", "tokens_per_block", "head_dim")] + [
        ("dequant", ctypes.c_void_p), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


def _pool_view(pool: torch.Tensor, layout: str, layer: int, tables: torch.Tensor | None = None,
               scales: KVScales | None = None) -> _PoolView:
    """Layer `layer` of a pool in attention.PagedKVCache's layout, HND [blocks, layers, 2, heads, tokens, d]
    or NHD [blocks, layers, 2, tokens, heads, d]; an FP8 pool's with its `scales` and this layer's
    dequantisation `tables` (kv_quant.dequant_tables(scales)[layer])."""
    s = pool.stride()
    head_stride, token_stride, kv_heads, tokens = ((s[3], s[4], pool.shape[3], pool.shape[4]) if layout == "HND"
                                                   else (s[4], s[3], pool.shape[4], pool.shape[3]))
    fp8 = (tables.data_ptr(), scales.k[layer], scales.v[layer]) if tables is not None else (None, 1.0, 1.0)
    return _PoolView(pool.data_ptr(), layer * s[1], s[0], s[2], head_stride, token_stride, pool.shape[0], kv_heads,
                     tokens, pool.shape[-1], *fp8)


# id(pool) -> (the pool, weakly; (layout, layer, id(scales)) -> view; what the views point into or key by)
_views: dict[int, tuple[weakref.ref, dict[tuple[str, int, int], _PoolView], list]] = {}


def _layer_view(pool: torch.Tensor, layout: str, layer: int, scales: KVScales | None = None) -> _PoolView:
    """`_pool_view`, built once per pool, layout, layer (and scales): a decode step asks for every layer's
    view on every step, and building one costs about a microsecond. An FP8 pool needs its `scales`."""
    key = id(pool)
    entry = _views.get(key)
    if entry is None or entry[0]() is not pool:
        entry = _views[key] = (weakref.ref(pool, lambda _, key=key: _views.pop(key, None)), {}, [])
    view = entry[1].get((layout, layer, id(scales)))
    if view is None:
        tables = None
        if pool.dtype == FP8:
            if scales is None or len(scales.k) != pool.shape[1]:
                raise ValueError(f"an FP8 pool of {pool.shape[1]} layers needs its KV scales, one K and one V scale "
                                 f"a layer (got {None if scales is None else len(scales.k)})")
            tables = dequant_tables(scales)[layer]
            entry[2].extend((tables, scales))  # alive as long as the view that points into or is keyed by them
        view = entry[1][(layout, layer, id(scales))] = _pool_view(pool, layout, layer, tables, scales)
    return view


class _DecodeArgs(ctypes.Structure):
    """Mirror of `decode_args` in csrc/kernels.h; field order and types must match."""

    _fields_ = [
        ("cache", _PoolView),
        ("block_table", ctypes.c_void_p),
        ("max_blocks", ctypes.c_int64),
        ("context_lens", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p),
        ("q_seq_stride", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("io_dtype", ctypes.c_int64),
        ("window", ctypes.c_int64),
    ]


class _FlashArgs(ctypes.Structure):
    """Mirror of `flash_args` in csrc/flash_prefill.c; field order and types must match."""

    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n", "ctx", "heads", "kv_heads", "head_dim", "q_seq_stride",
                                            "k_head_stride", "k_token_stride", "v_head_stride",
                                            "v_token_stride", "window")] + [
        ("scale", ctypes.c_float), ("dequant", ctypes.c_void_p)]


_FLASH_BF16_PAIRS = 2  # FLASH_BF16_PAIRS in csrc/flash_prefill.c


class _RopeCacheArgs(ctypes.Structure):
    """Mirror of `rope_cache_args` in csrc/kernels.h; field order and types must match."""

    _fields_ = [
        ("cache", _PoolView),
        ("qkv", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("signed_sin", ctypes.c_void_p),
        ("slot_blocks", ctypes.c_void_p),
        ("slot_offsets", ctypes.c_void_p),
        ("qk_out", ctypes.c_void_p),
    ]


class KernelBuildError(RuntimeError):
    """The C compiler failed or is missing; the message carries its output."""


def _cpu_signature() -> str:
    """This CPU's feature flags (what -march=native compiles for), or the machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.machine()


def build(sources: list[Path] = SOURCES, cache_dir: Path | None = None, flags: list[str] | None = None) -> Path:
    """Compile `sources` into one library in the kernel cache (once per sources, flags, compiler and CPU).
    Tests pass other `flags` to build a kernel's form for CPUs without some instructions; the default is
    FLAGS with `$PDSERVE_KERNEL_MARCH` for -march (pdserve/env.py: e.g. `x86-64-v3`, AVX2 + FMA and no
    AVX-512, builds the form an AVX2-only machine gets, which is how that machine's paths are tested here)."""
    env = settings()
    if flags is None:
        flags = [f"-march={env.kernel_march}" if f == "-march=native" else f for f in FLAGS]
    compiler = env.compiler
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"no working C compiler {compiler!r} ({exc}); set CC or install gcc") from exc
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    texts = [f"{f.name}\0{f.read_text()}" for f in [*sources, *headers]]
    parts = [*texts, *flags, *LINK_FLAGS, *LIBS, version, _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    cache_dir = cache_dir or env.kernel_cache
    target = cache_dir / f"pdserve_kernels-{key[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".objs-") as objs_dir:
        objs = [str(Path(objs_dir) / f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
        compile_flags = [f for f in flags if f != "-shared"]
        # Linked apart and without -ffast-math: linked with it, gcc adds crtfastmath.o, whose constructor
        # turns on flush-to-zero and denormals-are-zero for the whole process that loads the library.
        cmds = [[compiler, *compile_flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)]
        link = [compiler, *LINK_FLAGS, "-o", str(tmp), *objs, *LIBS]
        try:
            with ThreadPoolExecutor(max(1, min(len(cmds), os.cpu_count() or 1))) as pool:  # a source per core
                compiled = list(pool.map(_run, cmds))
            for cmd, done in [*zip(cmds, compiled), (link, None)]:
                done = done or _run(link)  # the link once every object compiled
                if done.returncode != 0:
                    raise KernelBuildError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_name: str | None = None
_tried = False

# Kernels with a PyTorch alternative, whose path the dispatch (dispatch.py) decides per machine; the callers ask
# `native(kernel, dtype)` (True until decided: the kernel wherever it runs).
FLASH_PREFILL = "flash_prefill"
GEMV = "gemv"
PAGED_DECODE = "paged_decode"
RMS_NORM = "rms_norm"
GEMM = "gemm"  # bf16 only, where oneDNN takes no bf16 (gemm.py)
ROPE_CACHE = "rope_cache"
_native: dict[tuple[str, torch.dtype], bool] = {}


def native(kernel: str, dtype: torch.dtype) -> bool:
    """Whether `kernel` is to run for `dtype` (not decided yet: True)."""
    return _native.get((kernel, dtype), True)


def set_native(kernel: str, dtype: torch.dtype, use: bool) -> None:
    _native[(kernel, dtype)] = use


def chosen_paths() -> dict[tuple[str, torch.dtype], bool]:
    """The paths decided so far (dispatch.py), (kernel, dtype) -> native."""
    return dict(_native)


def reset_paths() -> None:
    """Forgets the decided paths (tests)."""
    _native.clear()


def library_name() -> str | None:
    """The loaded library's file name (it hashes sources, flags, compiler and CPU flags); None without one."""
    load()
    return _lib_name


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None (reason logged once) where it cannot be."""
    global _lib, _lib_name, _tried
    if _lib is not None:  # the common case, without the lock: once set, _lib never changes
        return _lib
    with _lock:
        if _tried:
            return _lib
        env = settings()  # (first: a value it refuses is refused again at the next call, not taken as "off")
        _tried = True
        if not env.cpu_kernels:
            log.info("%s=0: native CPU kernels disabled, the model runs in PyTorch only", CPU_KERNELS)
            return None
        try:
            path = build()
            lib = ctypes.CDLL(str(path))
        except (KernelBuildError, OSError) as exc:
            log.warning("native CPU kernels unavailable, the model runs in PyTorch only: %s", exc)
            return None
        log.info("native CPU kernels built for -march=%s", env.kernel_march)
        lib.paged_decode_attention.argtypes = [ctypes.POINTER(_DecodeArgs), ctypes.c_int, ctypes.c_int]
        lib.paged_decode_attention.restype = ctypes.c_int
        lib.rope_cache_write.argtypes = [ctypes.POINTER(_RopeCacheArgs), ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.rope_cache_write.restype = ctypes.c_int
        lib.rms_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                                                         ctypes.c_int]
        lib.rms_norm.restype = ctypes.c_int
        lib.flash_prefill.argtypes = [ctypes.POINTER(_FlashArgs), ctypes.c_int, ctypes.c_int]
        lib.flash_prefill.restype = ctypes.c_int
        lib.skinny_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
        lib.skinny_linear.restype = ctypes.c_int
        lib.flash_prefill_bf16_pairs.argtypes = []
        lib.flash_prefill_bf16_pairs.restype = ctypes.c_int
        lib.kernel_isa.argtypes = []
        lib.kernel_isa.restype = ctypes.c_char_p
        _lib, _lib_name = lib, path.name
        return _lib


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, layout: str, layer: int, block_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           scales: KVScales | None = None) -> torch.Tensor | None:
    """Attention of one query per sequence against its paged K/V (its last `window` keys only, when a
    sliding window is given). An FP8 pool is read with its `scales` (kv_quant: the values its PyTorch
    path dequantizes to, in q's dtype).

    q: [b, heads, d] (heads and d contiguous, any stride between sequences); pool: the rank's KV pool
    (attention.PagedKVCache's layout); block_table: [b, max_blocks] int64, padded; context_lens: [b]
    int64. Returns [b, heads, d] in q's dtype, or None where the kernel does not apply (not on CPU, no
    library, an unsupported dtype or shape), in which case the caller takes the PyTorch path.
    """
    if (pool.device.type != "cpu" or pool.dtype not in _KV_DTYPES or pool.stride(-1) != 1
            or (pool.dtype == FP8 and q.dtype not in _FLOAT_DTYPES)):  # (the tables are fp32's and bf16's values)
        return None
    lib = load()
    if lib is None:
        return None
    if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
        raise TypeError("block_table and context_lens must be int64")
    b, heads, d = q.shape
    if d != pool.shape[-1]:
        raise ValueError(f"query head_dim {d} does not match the pool's {pool.shape[-1]}")
    # fp32 or bf16 with heads and d contiguous as they lie (a view into the step's q/k rows), else fp32
    q_in = q if q.dtype in _FLOAT_DTYPES and q.stride(2) == 1 and q.stride(1) == d else q.float().contiguous()
    table = block_table.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty(b, heads, d, dtype=q_in.dtype)
    args = _DecodeArgs(_layer_view(pool, layout, layer, scales), table.data_ptr(), table.shape[1], lens.data_ptr(), b,
                       heads, scale, q_in.data_ptr(), q_in.stride(0), out.data_ptr(), _FLOAT_DTYPES[q_in.dtype], window)
    status = lib.paged_decode_attention(ctypes.byref(args), _KV_DTYPES[pool.dtype], torch.get_num_threads())
    if status == -2:
        raise IndexError(f"paged decode attention: a context length or block id is outside the block table "
                         f"[{table.shape[0]}, {table.shape[1]}] or the pool of {pool.shape[0]} blocks")
    if status != 0:
        return None
    return out if out.dtype == q.dtype else out.to(q.dtype)


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  window: int = 0, dequant: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of a prefill chunk, in one pass over the keys (online softmax).

    q: [n, heads, d] fp32 or bf16 for the last n positions (any stride over positions: a view of the
    rotated q and k side by side needs no copy); k, v: [kv_heads, ctx, d] in q's dtype (any strides over
    heads and positions) for positions 0..ctx-1, so query i sits at position ctx - n + i. Returns
    [n, heads, d] in q's dtype, written into `out` when given (contiguous). With a sliding `window`,
    the query at position P sees keys P - window + 1 .. P only. With `dequant`, k and v are an FP8 cache's
    bytes and dequant [2, 256] fp32 what each byte of K and of V stands for in q's dtype
    (kv_quant.dequant_tables).
    Scores and softmax are fp32; for bf16 on a CPU with AVX512-BF16 the two products take bf16
    inputs (the probabilities rounded to bf16), else they are fp32. None where the kernel does not
    apply (no library, not on CPU, another dtype, head_dim not a multiple of 16).
    """
    n, heads, d = q.shape
    kv_heads, ctx, _ = k.shape
    kv_dtype = q.dtype if dequant is None else FP8
    if (q.device.type != "cpu" or q.dtype not in _FLOAT_DTYPES or k.dtype != kv_dtype or v.dtype != kv_dtype
            or d % 16 or heads % kv_heads or ctx < n or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    if dequant is not None and (dequant.shape != (2, 256) or dequant.dtype != torch.float32
                                or not dequant.is_contiguous()):
        raise ValueError(f"flash prefill attention: dequant must be a contiguous [2, 256] float32 table, got "
                         f"{tuple(dequant.shape)} {dequant.dtype}")
    lib = load()
    if lib is None:
        return None
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"flash prefill attention: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    args = _FlashArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, ctx, heads, kv_heads, d,
                      q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), window, scale,
                      None if dequant is None else dequant.data_ptr())
    pairs = q.dtype == torch.bfloat16 and lib.flash_prefill_bf16_pairs() == 1
    mode = _FLASH_BF16_PAIRS if pairs else _FLOAT_DTYPES[q.dtype]
    status = lib.flash_prefill(ctypes.byref(args), mode, torch.get_num_threads())
    if status == -3:
        raise MemoryError("flash prefill attention: out of memory for its packed K/V and per-thread scratch")
    return out if status == 0 else None


# Decode-step row counts that take skinny_linear rather than oneDNN's packed GEMM: those where it
# beats (or matches) oneDNN on a SmolLM2 step's 120 linears. fp32 takes the tiles
# up to 8 rows and the lane loop from 12; at 9-11 rows the lane loop trails oneDNN, so those stay there.
SKINNY_ROWS = {torch.float32: frozenset([*range(1, 9), *range(12, 17)]), torch.bfloat16: frozenset(range(1, 17))}


def kernel_isa() -> str | None:
    """The instruction-set form the library was built in (csrc/isa.c): 'avx512-bf16', 'avx512', 'avx2-fma'
    or 'plain' (no vector intrinsics: the portable C loops, e.g. on ARM); None without the library."""
    lib = load()
    return None if lib is None else lib.kernel_isa().decode()


def skinny_linear_runs() -> bool:
    """Whether the GEMV runs on this machine: the library loads and was built with AVX-512 or AVX2 + FMA
    (one trial call on a 1 x 16 row)."""
    return skinny_linear(torch.ones(1, 16), torch.ones(4, 16)) is not None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., in] @ weight [out, in] (plain, contiguous) + bias [out], for x of one or a few rows (a
    decode step); fp32 or bf16, all one dtype. The sums are fp32 and rounded once, after the bias. A
    row's result does not depend on the other rows. Returns [..., out], or None where the kernel does
    not apply (no library or neither AVX-512 nor AVX2 + FMA, another dtype or device, a packed or strided
    weight)."""
    k = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype not in _FLOAT_DTYPES or weight.is_mkldnn or weight.dtype != x.dtype
            or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != weight.shape[:1]
                                      or not bias.is_contiguous()))):
        return None
    lib = load()
    if lib is None:
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # (a decode step's rows are already 2-D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    status = lib.skinny_linear(rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                               out.data_ptr(), m, n, k, rows.stride(0), n, _FLOAT_DTYPES[x.dtype],
                               torch.get_num_threads())
    if status != 0:
        return None
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """x [..., hidden] normalised by its root mean square and scaled by weight [hidden], rounded as
    layers.RMSNorm's PyTorch form rounds. With `residual` (x's shape), the row normalised is
    h = x + residual (rounded to the dtype, as PyTorch's add). Returns (h or None, normalised), or None
    where the kernel does not apply (no library, another dtype or device, a non-contiguous input)."""
    if (x.device.type != "cpu" or x.dtype not in _FLOAT_DTYPES or weight.dtype != x.dtype or not x.is_contiguous()
            or not weight.is_contiguous() or weight.shape != x.shape[-1:]):
        return None  # (a weight of the wrong size then fails in PyTorch, with PyTorch's message)
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape
                                 or not residual.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    h = None if residual is None else torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), None if h is None else h.data_ptr(),
                 weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps, _FLOAT_DTYPES[x.dtype],
                 torch.get_num_threads())
    return h, out


def rope_cache_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor, pool: torch.Tensor,
                     layout: str, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                     scales: KVScales | None = None) -> torch.Tensor | None:
    """RoPE on q and k of qkv [n, heads + 2 * kv_heads, d] (contiguous, fp32 or bf16), K and V written
    to pool (attention.PagedKVCache's layout) at (slot_blocks[i], slot_offsets[i]) for layer `layer`
    (an FP8 pool: by its `scales`, as kv_quant.quantize).
    cos, signed_sin: [n, d] fp32 rows of the rotary table. Returns the rotated q and k,
    [n, heads + kv_heads, d] in qkv's dtype; None where the kernel does not apply."""
    if (qkv.device.type != "cpu" or qkv.dtype not in _FLOAT_DTYPES or pool.dtype not in _KV_DTYPES
            or not qkv.is_contiguous() or pool.stride(-1) != 1):
        return None
    lib = load()
    if lib is None:
        return None
    n, width, d = qkv.shape
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.numel() == signed_sin.numel() == n * d):
        cos, signed_sin = cos.reshape(n, d).contiguous(), signed_sin.reshape(n, d).contiguous()  # else as they are
    blocks, offsets = slot_blocks.contiguous(), slot_offsets.contiguous()
    if blocks.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise TypeError("slot_blocks and slot_offsets must be int64")
    view = _layer_view(pool, layout, layer, scales)
    if width != heads + 2 * view.kv_heads or d != view.head_dim:
        raise ValueError(f"qkv rows of {width} heads x {d} do not match {heads} query heads and the pool's "
                         f"{view.kv_heads} KV heads x {view.head_dim}")
    qk = torch.empty(n, heads + view.kv_heads, d, dtype=qkv.dtype)
    args = _RopeCacheArgs(view, qkv.data_ptr(), n, heads, cos.data_ptr(), signed_sin.data_ptr(), blocks.data_ptr(),
                          offsets.data_ptr(), qk.data_ptr())
    status = lib.rope_cache_write(ctypes.byref(args), _FLOAT_DTYPES[qkv.dtype], _KV_DTYPES[pool.dtype],
                                  torch.get_num_threads())
    if status == -2:
        raise IndexError(f"rope/cache write: a slot is outside the pool of {view.num_blocks} blocks of "
                         f"{view.tokens_per_block} tokens")
    return qk if status == 0 else None
