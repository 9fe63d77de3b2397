"""One recurrent layer's step, the native kernel (csrc/recurrent.c) beside the layer's PyTorch path.

    python benchmarks/bench_recurrent.py [--dtypes float32 bfloat16] [--repeats 40]

The layers are bench_engine.py's tiny hybrid models' (hidden 512): a Gated DeltaNet of 4 key and 8 value
heads of 64 (Qwen3.5) and a Mamba2 mixer of 16 heads of 64 over 2 groups of a 64-dim state (Nemotron-H),
random weights. Each row times the layer's whole forward, as the engine calls it (input projections,
conv, recurrence, gated norm, output projection), for a decode step of 1 and of 16 sequences and a fresh
512-token prompt. The two paths run in turns and each figure is the best of `--repeats` (of a fifth as many
for the prompt), so a slow spell of a shared machine falls on both alike.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import torch

from pdserve.kernels import recurrent
from pdserve.models.shapes import LinearAttentionShape, Mamba2Shape
from pdserve.models.gated_deltanet import GatedDeltaNet, deltanet_state
from pdserve.models.mamba2 import Mamba2Mixer, mamba2_state
from pdserve.models.recurrent_state import RecurrentState, StateSlice
from pdserve.parallel.state import ParallelState

HIDDEN, SLOTS = 512, 32


def layer(family: str, dtype: torch.dtype) -> tuple[torch.nn.Module, RecurrentState]:
    if family == "Gated DeltaNet":
        shape = LinearAttentionShape(num_k_heads=4, num_v_heads=8, k_head_dim=64, v_head_dim=64, conv_kernel=4)
        mixer, geometry = GatedDeltaNet(shape, HIDDEN, 1e-6, ParallelState(), dtype), deltanet_state(
            shape, 1, dtype.itemsize)
    else:
        shape = Mamba2Shape(num_heads=16, head_dim=64, n_groups=2, state_size=64, conv_kernel=4, conv_bias=True,
                            time_step_min=0.001)
        mixer, geometry = Mamba2Mixer(shape, HIDDEN, 1e-5, ParallelState(), dtype), mamba2_state(
            shape, 1, dtype.itemsize)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0, math.log(16), generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) + (1 if "norm" in name else 0))
    return mixer, RecurrentState(geometry, 1, SLOTS, dtype, torch.device("cpu"))


def steps() -> list[tuple[str, int, list[StateSlice]]]:
    return [("decode, 1 sequence", 1, [StateSlice(0, 1, False, 3)]),
            ("decode, 16 sequences", 16, [StateSlice(i, 1, False, i) for i in range(16)]),
            ("prefill, 512 tokens", 512, [StateSlice(0, 512, True, 20)])]


def best_pair(mixer, state, rows: int, seqs: list[StateSlice], repeats: int, dtype: torch.dtype) -> tuple[float, float]:
    """Best seconds of (PyTorch path, native), timed in turns."""
    load = recurrent.load
    x = torch.randn(rows, HIDDEN).to(dtype)
    best = [math.inf, math.inf]
    try:
        for _ in range(repeats):
            for native in (False, True):
                recurrent.load = load if native else (lambda: None)
                t = time.perf_counter()
                mixer(x, state, 0, seqs)
                best[native] = min(best[native], time.perf_counter() - t)
    finally:
        recurrent.load = load
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    if recurrent.load() is None:
        raise SystemExit("the native recurrent kernel cannot be built here (no C compiler or PDSERVE_CPU_KERNELS=0)")
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats} (prefill: of {max(1, args.repeats // 5)})")
    print("\n| layer, dtype | step | PyTorch ms | native ms | PyTorch / native |\n|---|---|---|---|---|")
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for family in ("Gated DeltaNet", "Mamba2"):
            mixer, state = layer(family, dtype)
            for label, rows, seqs in steps():
                repeats = args.repeats if rows < 100 else max(1, args.repeats // 5)
                ours_torch, ours_native = best_pair(mixer, state, rows, seqs, repeats, dtype)
                print(f"| {family}, {str(dtype).removeprefix('torch.')} | {label} | {ours_torch * 1e3:.3f} | "
                      f"{ours_native * 1e3:.3f} | {ours_torch / ours_native:.2f}x |")


if __name__ == "__main__":
    main()
