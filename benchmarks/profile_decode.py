"""Where a decode step's time goes, eager against the static step (CUDA graphs on a GPU): step time at
batch 1 and 16, and per step what the host does.

    python benchmarks/profile_decode.py [--device cuda|cpu] [--dtype bfloat16] [--model DIR] [--tiny]
                                        [--modes eager static] [--batches 1 16] [--table]

Without --model it writes random weights of SmolLM2-135M's shape (--tiny: a 2-layer model, for a quick
check of the script itself). "static" is engine/static_decode.py's step: graph replays on CUDA
(`cuda_graphs: true`), the same step run eagerly on CPU (`static_decode_on_cpu: true`).

What each column counts, per decode step, over PROFILED steps:
- host reads: calls that read a tensor's values into Python (item, tolist, bool/int/float/index of a
  tensor, numpy, and cpu/to of a device tensor), counted by a TorchFunctionMode. On CUDA each one waits
  for the device: a host synchronisation. The static step makes one (its tokens, read once).
- list tensors: tensors built from Python data (torch.tensor / as_tensor); on CUDA each is a synchronous
  copy from pageable host memory.
- ops: the ATen ops the host dispatches to a backend (a TorchDispatchMode); on CUDA about one kernel launch
  each, on CPU one kernel call each. A graph replay dispatches none of its kernels.
- CUDA only, from torch.profiler: launches (cudaLaunchKernel and friends, cudaGraphLaunch counted apart),
  sync calls (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy),
  GPU busy ms per step (the kernels' own time; CUPTI may not attribute a replayed graph's kernels).
On CUDA a step whose GPU time is far below its wall time is bound by the host, not by the device.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.tiny import make_tiny_model

PROMPT, WARM, TIMED, PROFILED = 128, 20, 20, 5
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


class HostCalls(TorchFunctionMode):
    """Counts host reads and tensors built from Python data (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.reads = self.lists = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads += 1
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.reads += name == "cpu" or "cpu" in [str(a) for a in args[1:]] + [str(kwargs.get("device"))]
        elif name in ("tensor", "as_tensor"):
            self.lists += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def engine(args, mode: str) -> LLMEngine:
    static = mode == "static"
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_tokens=4096,
                                  enable_prefix_caching=False, kv_cache_memory_gb=2.0, max_model_len=1024,
                                  cuda_graphs=static, static_decode_on_cpu=static))


def measure(args, mode: str, batch: int) -> dict:
    e = engine(args, mode)
    on_cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    try:
        params = SamplingParams(max_tokens=WARM + TIMED + 3 * PROFILED + 5, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            e.add_request(list(range(100 + i, 100 + i + PROMPT)), params)
        for _ in range(WARM):
            e.step()
        sync()
        t = time.perf_counter()
        for _ in range(TIMED):
            e.step()
        sync()
        row = {"mode": mode, "batch": batch, "ms": 1e3 * (time.perf_counter() - t) / TIMED}
        static = e.runner.static_decode
        before = sum(static.steps.values()) if static is not None else 0
        with HostCalls() as calls:
            for _ in range(PROFILED):
                e.step()
        with Ops() as ops:
            for _ in range(PROFILED):
                e.step()
        row |= {"reads": calls.reads / PROFILED, "lists": calls.lists / PROFILED, "ops": ops.count / PROFILED}
        if on_cuda:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED):
                    e.step()
                sync()
            table = prof.key_averages()
            counts = Counter({k.key: k.count for k in table})
            device_us = sum(getattr(k, "self_device_time_total", getattr(k, "self_cuda_time_total", 0)) for k in table
                            if getattr(k, "device_type", None) == torch.autograd.DeviceType.CUDA)
            row |= {"launches": sum(counts[k] for k in LAUNCHES) / PROFILED,
                    "graphs": counts["cudaGraphLaunch"] / PROFILED,
                    "syncs": sum(counts[k] for k in SYNCS) / PROFILED, "gpu_ms": device_us / 1e3 / PROFILED}
            if args.table:
                print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
        static_steps = (sum(static.steps.values()) - before) if static is not None else 0
        row["static"] = f"{static_steps}/{3 * PROFILED if on_cuda else 2 * PROFILED}"
        return row
    finally:
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random model (checks the script, not the path)")
    ap.add_argument("--modes", nargs="+", default=["eager", "static"], choices=["eager", "static"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--table", action="store_true", help="CUDA: print torch.profiler's table for each row")
    args = ap.parse_args()
    if args.model is None:
        shape = (dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=512)
                 if args.tiny else dict(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True))
        args.model = str(make_tiny_model(tempfile.mkdtemp() + "/model", max_position_embeddings=8192, **shape))
    cuda = args.device == "cuda"
    head = "| mode | batch | step ms | host reads | list tensors | ops |" + (
        " launches | graph launches | sync calls | GPU busy ms |" if cuda else "") + " static steps |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for batch in args.batches:
        for mode in args.modes:
            r = measure(args, mode, batch)
            cells = [r["mode"], r["batch"], f"{r['ms']:.2f}"] + [f"{r[k]:.0f}" for k in ("reads", "lists", "ops")]
            if cuda:
                cells += [f"{r['launches']:.0f}", f"{r['graphs']:.0f}", f"{r['syncs']:.0f}", f"{r['gpu_ms']:.2f}"]
            print("| " + " | ".join(map(str, cells + [r["static"]])) + " |", flush=True)


if __name__ == "__main__":
    main()
