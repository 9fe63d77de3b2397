"""Each native CPU kernel against the PyTorch path it replaces, on one model's shapes: the timings the
kernel dispatch (pdserve/kernels/dispatch.py, against models/torch_paths.py's paths) makes at a model's
start, as a table.

    python benchmarks/bench_cpu_paths.py [--dtypes float32 bfloat16] [--threads N] [--fp8]
                                         [--shape HEADS KV_HEADS HEAD_DIM HIDDEN INTERMEDIATE]

The default shape is SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hidden 576, intermediate
1536). Rows: flash prefill at FLASH_TOKENS tokens against the path attention takes without it (the tiled
oneDNN path, or SDPA), paged decode attention (one sequence of 1024 tokens and 16 of 512) against the
gather and SDPA, the decode GEMV on the four linears of a layer at 1, 4 and 16 rows against the GEMM
(oneDNN on packed weights where it takes the dtype, else F.linear), RMSNorm and the RoPE / cache write
against their PyTorch forms at 1, 16 and 512 rows, and where oneDNN takes no bf16 the native bf16 GEMM
against F.linear; with --fp8 the cache write and paged decode on an fp8_e4m3 pool too. To see a CPU without AVX-512 from one
with it: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PDSERVE_KERNEL_MARCH=x86-64-v3.
"""

from __future__ import annotations

import argparse
import os
import platform
from types import SimpleNamespace

import torch

from pdserve.env import settings
from pdserve.kernels import cpu, dispatch
from pdserve.kernels.kv_quant import FP8
from pdserve.models.layers import onednn_packs
from pdserve.models.torch_paths import REFERENCES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--shape", nargs=5, type=int, default=[9, 3, 64, 576, 1536],
                    metavar=("HEADS", "KV_HEADS", "HEAD_DIM", "HIDDEN", "INTERMEDIATE"))
    ap.add_argument("--fp8", action="store_true", help="also the kernels that read or write the pool, on an "
                    "fp8_e4m3 pool")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="PyTorch's and the kernels' threads (default: every core)")
    args = ap.parse_args()
    heads, kv_heads, d, hidden, inter = args.shape
    torch.set_num_threads(args.threads)
    if cpu.load() is None:
        raise SystemExit("no native kernels (no C compiler, or PDSERVE_CPU_KERNELS=0)")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; ATen "
          f"{torch.backends.cpu.get_cpu_capability()}; native kernels in the {cpu.kernel_isa()} form "
          f"(-march={settings().kernel_march})")
    print("| kernel | dtype | shape | native ms | PyTorch ms | PyTorch / native |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = DTYPES[name]
        linears = []
        for n, k in ((heads * d + 2 * kv_heads * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)):
            w = torch.randn(n, k, generator=g).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w) if onednn_packs(dtype) else w
            linears.append(SimpleNamespace(gemv_weight=w, weight=packed, bias=None))
        decode = ",".join(f"{b}x{ctx}" for b, ctx in dispatch.PAGED_DECODE_CASES)
        rows = [("flash prefill", f"{heads}x{kv_heads}x{d}, {dispatch.FLASH_TOKENS} tokens",
                 dispatch.time_flash_prefill(REFERENCES.causal_attention, heads, kv_heads, d, dtype)),
                ("paged decode", f"{heads}x{kv_heads}x{d}, seqs x tokens {decode}",
                 dispatch.time_paged_decode(REFERENCES.paged_decode, heads, kv_heads, d, dtype)),
                ("decode GEMV", f"4 linears x rows {dispatch.GEMV_ROWS}",
                 dispatch.time_gemv(REFERENCES.linear, linears, dtype)),
                ("RMSNorm", f"hidden {hidden}, rows {dispatch.STEP_ROWS}, alone and after an add",
                 dispatch.time_rms_norm(REFERENCES.rms_norm, hidden, dtype))]
        if dtype == torch.bfloat16 and not onednn_packs(dtype):  # (where oneDNN takes bf16 the GEMM is its)
            rows.append(("bf16 GEMM", f"4 linears x {dispatch.GEMM_ROWS} rows",
                         dispatch.time_gemm(linears, dtype)))
        for kv_name, kv_dtype in [(name, None), *([("fp8_e4m3", FP8)] if args.fp8 else [])]:
            rows.append(("RoPE / cache write", f"{heads}x{kv_heads}x{d}, rows {dispatch.STEP_ROWS}, {kv_name} pool",
                         dispatch.time_rope_cache(REFERENCES.rope_cache, heads, kv_heads, d, dtype, kv_dtype)))
        if args.fp8:
            rows.append(("paged decode", f"{heads}x{kv_heads}x{d}, seqs x tokens {decode}, fp8_e4m3 pool",
                         dispatch.time_paged_decode(REFERENCES.paged_decode, heads, kv_heads, d, dtype,
                                                    kv_dtype=FP8)))
        for kernel, shape, times in rows:
            if times is None:
                print(f"| {kernel} | {name} | {shape} | (not on this build) | | |")
            else:
                print(f"| {kernel} | {name} | {shape} | {times[0]:.2f} | {times[1]:.2f} | {times[1] / times[0]:.2f}x |")


if __name__ == "__main__":
    main()
