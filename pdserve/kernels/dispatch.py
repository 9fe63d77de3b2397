"""Which CPU path each native kernel takes on this machine: the kernel or the PyTorch path it replaces,
decided by timing both on the model's own shapes.

A kernel's build form follows the compiler's -march (AVX-512, AVX2 + FMA, plain C), but whether it beats
PyTorch depends on the machine: its core, its memory, the ISA that ATen and oneDNN take on it. So at
model load each kernel that has a PyTorch alternative is timed against it, and the faster is kept. The
PyTorch paths are the models' (`References`, handed in by models/torch_paths.py, whose `choose_paths` the
model runner calls); nothing here imports a model:

- flash prefill (`cpu.flash_prefill`) against the path attention.paged_attention takes without
  it (at FLASH_TOKENS tokens the tiled oneDNN path, or SDPA where torch has no oneDNN): causal attention
  of FLASH_TOKENS tokens with the model's query heads, KV heads and head_dim.
- paged decode attention (`cpu.paged_decode_attention`) against the gather and SDPA that
  attention.paged_attention runs without it, at PAGED_DECODE_CASES (sequences, context tokens) with the
  model's heads; where PyTorch wins, the one-call C decode step (which runs the kernel) is not used either.
- the decode GEMV (`cpu.skinny_linear`) against the GEMM a linear takes without it (oneDNN on the
  packed weight, or F.linear), on the first layer's linears at GEMV_ROWS rows each. Where the GEMM wins,
  the plain weight copies the GEMV needed are dropped and the one-call C decode step (which runs the
  GEMV) is not used.
- RMSNorm (`cpu.rms_norm`) against layers.RMSNorm's PyTorch form, alone and after a residual add,
  and the RoPE / cache write (`cpu.rope_cache_write`) against RotaryEmbedding.rotate and
  PagedKVCache.write, each at STEP_ROWS rows with the model's hidden size or heads (and the pool's dtype).
  The one-call C decode step, where it runs, calls both kernels whatever was chosen: it is a whole
  step's path, raced by its attention and GEMV.
- where oneDNN takes no bf16 (`layers.onednn_packs`), the bf16 GEMM of kernels/gemm.py against F.linear, on
  the first layer's linears at GEMM_ROWS rows (layers.linear takes it for every linear of more rows than the
  GEMV's).

Each pair is timed in turns, best of five each (one, where a side is LEAD times slower), so a slow spell of
a shared machine falls on both, and PyTorch is chosen only where it wins twice, each time by more than TIE;
a choice made while other processes fight for the cores may still be the wrong one (delete the file below,
or force the path). On the 2-core development machine, shared with other benchmarks, one race gave the fp32
GEMV 22.9 ms against oneDNN's 2.8 and the next 2.6 against 2.8 (benchmarks/bench_cpu_paths.py), and single
races chose PyTorch for the bf16 GEMV at 128.8 against 128.0 ms (a GEMV of ~1 ms on a quiet machine). A
choice is kept in the kernel cache beside the library (`choices.json`), keyed by the CPU's model name and
flags, the library (its name hashes its sources, flags and compiler), the dtype, the shapes and the thread
count, so later starts on the same machine read it back instead of timing; the choice and its times are
logged. `PDSERVE_KERNEL_PATH` forces a path: `native` or `torch` for every kernel, or per kernel, e.g.
`flash_prefill=torch,gemv=native`; `auto` (the default) times.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.env import KERNEL_PATH, settings
from pdserve.kernels import cpu, gemm
from pdserve.kernels.kv_quant import KVScales, is_quantized

log = logging.getLogger(__name__)

KERNELS = (cpu.FLASH_PREFILL, cpu.PAGED_DECODE, cpu.GEMV, cpu.RMS_NORM, cpu.ROPE_CACHE, cpu.GEMM)
FLASH_TOKENS = 1024  # a prompt length where attention is a good share of a prefill
PAGED_DECODE_CASES = ((1, 1024), (16, 512))  # (sequences, context tokens) of a decode step
GEMV_ROWS = (1, 4, 16)  # decode steps of one, a few and the most sequences the GEMV takes
STEP_ROWS = (1, 16, 512)  # rows of RMSNorm and the RoPE / cache write: decode steps of 1 and 16, a prefill
GEMM_ROWS = 128  # a prefill chunk's rows, for the bf16 GEMM
CHOICES_FILE = "choices.json"
TIE = 0.05  # a race PyTorch wins by less than this share of native's time is a tie
LEAD = 3.0  # a race where one side takes this many times the other's time is decided after one turn


@dataclass(frozen=True)
class References:
    """The PyTorch path each kernel is raced against, handed in by the models. Where a path needs objects
    of its own (a cache view, step metadata, a norm module), it takes the race's inputs, builds them there,
    outside the timing, and returns the call that is timed.

    causal_attention(q [tokens, heads, d], k, v [kv_heads, tokens, d], scale) -> () -> attention
    paged_decode(pool [blocks, 1, 2, kv_heads, T, d] (HND), [(q [b, heads, d], block_table [b, nb],
                 context_lens [b])], scale) -> () -> every case's decode attention
    rope_cache(pool, heads, [(qkv [n, heads + 2 * kv_heads, d], (cos, signed_sin), slot_blocks [n],
               slot_offsets [n])]) -> () -> every case's RoPE and K/V write into layer 0 of the pool
    rms_norm(weight [hidden], eps) -> x [rows, hidden] -> norm(x)
    linear(x, weight, bias) -> x @ weight.T + bias: the GEMM a linear takes outside a decode step
    """

    causal_attention: Callable
    paged_decode: Callable
    rope_cache: Callable
    rms_norm: Callable
    linear: Callable


def forced_paths(spec: str | None = None) -> dict[str, bool]:
    """`PDSERVE_KERNEL_PATH` (or `spec`) read: kernel -> True (native) / False (torch) for the forced ones."""
    spec = (settings().kernel_path if spec is None else spec).strip()
    if spec in ("", "auto"):
        return {}
    paths = {"native": True, "torch": False}
    if spec in paths:
        return dict.fromkeys(KERNELS, paths[spec])
    forced = {}
    for part in spec.split(","):
        kernel, _, path = part.partition("=")
        kernel, path = kernel.strip(), path.strip()
        if kernel not in KERNELS or path not in (*paths, "auto"):
            raise ValueError(f"{KERNEL_PATH}={spec!r}: expected auto, native, torch or a comma-separated list of "
                             f"KERNEL=native|torch|auto with KERNEL one of {', '.join(KERNELS)}")
        if path != "auto":
            forced[kernel] = paths[path]
    return forced


def _race(native: Callable[[], object], reference: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
    """(native ms, reference ms): the best of `repeats` runs of each, the two taking turns, so that a slow
    spell of a shared machine falls on both rather than on whichever ran during it. A race one side leads
    by more than LEAD after the first turn ends there (a slow side would cost its time five times over
    at every first start)."""
    native(), reference()  # the first calls pay for page faults and packing
    best = [float("inf"), float("inf")]
    for turn in range(repeats):
        for i, fn in enumerate((native, reference)):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
        if turn == 0 and max(best) > LEAD * min(best):
            break
    return best[0] * 1e3, best[1] * 1e3


def time_flash_prefill(reference: Callable, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> tuple[float, float] | None:
    """(native ms, PyTorch ms) for causal attention of FLASH_TOKENS tokens (`reference`:
    References.causal_attention); None where the kernel does not take the shape."""
    g, tokens = torch.Generator().manual_seed(0), FLASH_TOKENS
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(kv_heads, tokens, head_dim, generator=g).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    if cpu.flash_prefill(q, k, v, scale) is None:
        return None
    return _race(lambda: cpu.flash_prefill(q, k, v, scale), reference(q, k, v, scale))


def time_paged_decode(reference: Callable, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      tokens_per_block: int = 16, kv_dtype: torch.dtype | None = None) -> tuple[float, float] | None:
    """(native ms, PyTorch ms) for decode attention at PAGED_DECODE_CASES (`reference`:
    References.paged_decode), each sequence's blocks scattered over one pool (of `kv_dtype`, default `dtype`;
    an FP8 one with scales 1), summed; None where the kernel does not take the shape."""
    g = torch.Generator().manual_seed(0)
    T = tokens_per_block
    total = sum(b * (ctx // T) for b, ctx in PAGED_DECODE_CASES)
    pool = torch.randn(total, 1, 2, kv_heads, T, head_dim, generator=g).to(kv_dtype or dtype)  # one layer, HND
    scales = KVScales.ones(1) if is_quantized(pool.dtype) else None
    scale, blocks, at = head_dim ** -0.5, torch.randperm(total, generator=g), 0
    cases = []
    for b, ctx in PAGED_DECODE_CASES:
        table = blocks[at:at + b * (ctx // T)].view(b, ctx // T)
        at += table.numel()
        cases.append((torch.randn(b, heads, head_dim, generator=g).to(dtype), table, torch.full((b,), ctx)))
    if cpu.paged_decode_attention(cases[0][0], pool, "HND", 0, *cases[0][1:], scale, scales=scales) is None:
        return None

    def native() -> None:
        for q, table, lens in cases:
            cpu.paged_decode_attention(q, pool, "HND", 0, table, lens, scale, scales=scales)
    return _race(native, reference(pool, cases, scale))


def time_gemv(reference: Callable, layers: list, dtype: torch.dtype) -> tuple[float, float] | None:
    """(native ms, GEMM ms) for `layers`' linears (each with a plain `gemv_weight`) at GEMV_ROWS rows, summed
    (`reference`: References.linear); None where the kernel does not run."""
    g = torch.Generator().manual_seed(0)
    cases = [(m, torch.randn(rows, m.gemv_weight.shape[1], generator=g).to(dtype)) for m in layers
             for rows in GEMV_ROWS]
    if not cases or cpu.skinny_linear(cases[0][1], cases[0][0].gemv_weight) is None:
        return None

    def run(native: bool) -> None:
        for m, x in cases:
            if native:
                cpu.skinny_linear(x, m.gemv_weight, m.bias)
            else:
                reference(x, m.weight, m.bias)  # not in a decode step: the GEMM, as without the GEMV
    return _race(lambda: run(True), lambda: run(False))


def time_rms_norm(reference: Callable, hidden: int, dtype: torch.dtype) -> tuple[float, float] | None:
    """(native ms, PyTorch ms) for RMSNorm of STEP_ROWS rows of `hidden`, alone and after a residual add
    (`reference`: References.rms_norm), summed; None where the kernel does not run."""
    g, eps = torch.Generator().manual_seed(0), 1e-6
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    cases = [tuple(torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2)) for rows in STEP_ROWS]
    if cpu.rms_norm(cases[0][0], weight, eps) is None:
        return None
    norm = reference(weight, eps)

    def run(native: bool) -> None:
        for x, y in cases:
            if native:
                cpu.rms_norm(x, weight, eps)
                cpu.rms_norm(y, weight, eps, residual=x)
            else:
                norm(x)
                norm(x + y)
    return _race(lambda: run(True), lambda: run(False))


def rope_table(head_dim: int, positions: torch.Tensor, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin, [n, 1, head_dim] each, of plain rotate-half RoPE at `positions`: the table the
    models' RotaryEmbedding makes (without a scaling), for the race's inputs."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(positions.float(), inv)
    sin = freqs.sin()
    return torch.cat([freqs, freqs], dim=-1).cos().unsqueeze(1), torch.cat([-sin, sin], dim=-1).unsqueeze(1)


def time_rope_cache(reference: Callable, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype | None = None) -> tuple[float, float] | None:
    """(native ms, PyTorch ms) for RoPE on q and k and K and V into scattered slots of a pool (of
    `kv_dtype`, default `dtype`; FP8 with scales 1) at STEP_ROWS tokens, summed: cpu.rope_cache_write against
    `reference` (References.rope_cache); None where the kernel does not take the shape."""
    g, T = torch.Generator().manual_seed(0), 16
    blocks = -(-sum(STEP_ROWS) // T)
    pool = torch.zeros(blocks, 1, 2, kv_heads, T, head_dim, dtype=kv_dtype or dtype)  # one layer, HND
    scales = KVScales.ones(1) if is_quantized(pool.dtype) else None
    slots, at, cases = torch.randperm(blocks * T, generator=g), 0, []
    for rows in STEP_ROWS:
        qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
        where = slots[at:at + rows]
        at += rows
        cases.append((qkv, rope_table(head_dim, torch.arange(rows) + 100), where // T, where % T))
    qkv, table, slot_blocks, slot_offsets = cases[0]
    if cpu.rope_cache_write(qkv, heads, *table, pool, "HND", 0, slot_blocks, slot_offsets, scales) is None:
        return None

    def native() -> None:
        for qkv, table, slot_blocks, slot_offsets in cases:
            cpu.rope_cache_write(qkv, heads, *table, pool, "HND", 0, slot_blocks, slot_offsets, scales)
    return _race(native, reference(pool, heads, cases))


def time_gemm(layers: list, dtype: torch.dtype) -> tuple[float, float] | None:
    """(native ms, F.linear ms) for `layers`' linears (plain weights) at GEMM_ROWS rows, summed: the bf16
    GEMM of kernels/gemm.py against F.linear; None where it does not run (another dtype, no AVX2 + FMA)."""
    g = torch.Generator().manual_seed(0)
    cases = [(m, torch.randn(GEMM_ROWS, m.weight.shape[1], generator=g).to(dtype)) for m in layers]
    if not cases or gemm.gemm_bf16(cases[0][1], cases[0][0].weight) is None:
        return None

    def run(native: bool) -> None:
        for m, x in cases:
            (gemm.gemm_bf16 if native else F.linear)(x, m.weight, m.bias)
    return _race(lambda: run(True), lambda: run(False))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(("model name", "CPU part"))),
                        "")
    except OSError:
        return ""


def _load_choices(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store_choice(path: Path, key: str, entry: dict) -> None:
    """Adds one entry to the choices file: written to a temporary file and renamed (as the library is), so a
    reader sees one whole file, and read, changed and written under a lock on a file beside it, so the
    ranks of a tensor-parallel instance, which time at once, each add their entries rather than the last
    writer's file replacing the others'."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
            choices = _load_choices(path)
            choices[key] = entry
            tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("kernel dispatch: cannot keep the choice in %s (%s); it is timed again at the next start",
                    path, exc)
        tmp.unlink(missing_ok=True)


def _torch_wins(times: tuple[float, float]) -> bool:
    """PyTorch's time under native's by more than TIE (closer is a tie: the native path, the tuned one)."""
    return times[1] < (1 - TIE) * times[0]


def _decide(kernel: str, dtype: torch.dtype, shape: str, timer: Callable[[], tuple[float, float] | None],
            forced: dict[str, bool], cache: Path) -> bool | None:
    """Native (True) or torch (False) for one kernel; None where the kernel does not run here."""
    name = str(dtype).removeprefix("torch.")
    if kernel in forced:
        cpu.set_native(kernel, dtype, forced[kernel])
        log.info("kernel dispatch: %s %s %s: %s (forced by %s)", kernel, name, shape,
                 "native" if forced[kernel] else "torch", KERNEL_PATH)
        return forced[kernel]
    library = cpu.library_name()
    key = "|".join([_cpu_name(), cpu._cpu_signature().strip(), library or "", kernel, name, shape,
                    str(torch.get_num_threads()), torch.backends.cpu.get_cpu_capability()])
    entry = _load_choices(cache).get(key)
    how = "cached"
    if entry is None:
        times = timer()
        if times is None:
            return None
        if _torch_wins(times):  # PyTorch only where it wins a second race too (a busy spell can fake one)
            times = timer() or times
        entry = {"native": not _torch_wins(times), "native_ms": round(times[0], 3), "torch_ms": round(times[1], 3)}
        _store_choice(cache, key, entry)
        how = "timed"
    cpu.set_native(kernel, dtype, entry["native"])
    log.info("kernel dispatch: %s %s %s: %s (%s: native %.2f ms, torch %.2f ms)", kernel, name, shape,
             "native" if entry["native"] else "torch", how, entry["native_ms"], entry["torch_ms"])
    return entry["native"]


def choose_paths(references: References, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 hidden: int | None = None, gemm_linears: list = (), gemv_linears: list = (),
                 cache: Path | None = None, kv_dtype: torch.dtype | None = None) -> dict[str, bool]:
    """Decides each kernel's path for a model (see the module docstring) and returns kernel -> native.
    `references`: the PyTorch paths, from the models; `heads`, `kv_heads`: this rank's query and KV heads
    (heads 0: a model that runs no paged attention kernel); `hidden`: its RMSNorm's width (None: no RMSNorm);
    `gemm_linears`: its linears, one per weight shape, where oneDNN takes no bf16 (those with a plain weight
    race the bf16 GEMM); `gemv_linears`: its linears with a plain `gemv_weight`, one per shape; `kv_dtype`:
    the KV pool's, where it is not `dtype` (an FP8 pool's paged decode is raced on FP8). Call after the
    linears are packed (layers.pack_for_cpu); where the GEMV loses, the caller drops its plain weight copies."""
    if cpu.load() is None or dtype not in (torch.float32, torch.bfloat16):
        return {}
    forced = forced_paths()
    cache = cache or settings().kernel_cache / CHOICES_FILE
    chosen = {}
    heads_shape = f"{heads}x{kv_heads}x{head_dim}"
    kv_dtype = kv_dtype if kv_dtype not in (None, dtype) else None
    on_pool = f"/{str(kv_dtype).removeprefix('torch.')}" if kv_dtype else ""  # (a pool of another dtype)
    decode_shape = ",".join(f"b{b}x{ctx}" for b, ctx in PAGED_DECODE_CASES) + on_pool
    rows = ",".join(map(str, STEP_ROWS))
    attention = [(cpu.FLASH_PREFILL, f"{heads_shape}@{FLASH_TOKENS}",
                  lambda *a: time_flash_prefill(references.causal_attention, *a)),
                 (cpu.PAGED_DECODE, f"{heads_shape}@{decode_shape}",
                  lambda *a: time_paged_decode(references.paged_decode, *a, kv_dtype=kv_dtype)),
                 (cpu.ROPE_CACHE, f"{heads_shape}@{rows}{on_pool}",
                  lambda *a: time_rope_cache(references.rope_cache, *a, kv_dtype=kv_dtype))]
    for kernel, shape, timer in attention if heads >= 1 else []:
        use = _decide(kernel, dtype, shape, lambda timer=timer: timer(heads, kv_heads, head_dim, dtype), forced, cache)
        if use is not None:
            chosen[kernel] = use
    if hidden is not None:
        use = _decide(cpu.RMS_NORM, dtype, f"{hidden}@{rows}",
                      lambda: time_rms_norm(references.rms_norm, hidden, dtype), forced, cache)
        if use is not None:
            chosen[cpu.RMS_NORM] = use
    plain = [m for m in gemm_linears if not m.weight.is_mkldnn]
    if dtype == torch.bfloat16 and plain:  # (elsewhere oneDNN takes bf16)
        shape = ",".join(f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in plain) + f"@{GEMM_ROWS}"
        use = _decide(cpu.GEMM, dtype, shape, lambda: time_gemm(plain, dtype), forced, cache)
        if use is not None:
            chosen[cpu.GEMM] = use
    if gemv_linears:
        shape = ",".join(f"{m.gemv_weight.shape[0]}x{m.gemv_weight.shape[1]}" for m in gemv_linears)
        use = _decide(cpu.GEMV, dtype, shape, lambda: time_gemv(references.linear, gemv_linears, dtype), forced,
                      cache)
        if use is not None:
            chosen[cpu.GEMV] = use
    return chosen
