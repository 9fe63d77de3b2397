"""Where a decode step's time goes: the engine's step time at batch 1 and 16, and a torch.profiler
table of five batch-1 steps (kernel launches and host<->device copies per step).

    python benchmarks/profile_decode.py [--device cuda|cpu] [--dtype bfloat16] [--model DIR]

Without --model it writes random weights of SmolLM2-135M's shape (the embedded model does not travel
to a GPU host). On CUDA a step whose GPU time is far below its wall time is bound by the host's
launches, not by the device.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.tiny import make_tiny_model

PROMPT, WARM, TIMED, PROFILED = 128, 20, 20, 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model or str(make_tiny_model(
        tempfile.mkdtemp() + "/smollm2-shape", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192))
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, device=args.device, max_num_tokens=4096,
                                    enable_prefix_caching=False, kv_cache_memory_gb=2.0))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    params = SamplingParams(max_tokens=WARM + TIMED + PROFILED + 5, temperature=0.0, ignore_eos=True)
    for batch in (1, 16):
        for i in range(batch):
            engine.add_request(list(range(100 + i, 100 + i + PROMPT)), params)
        for _ in range(WARM):
            engine.step()
        sync()
        t = time.perf_counter()
        for _ in range(TIMED):
            engine.step()
        print(f"batch {batch}: decode step {1e3 * (time.perf_counter() - t) / TIMED:.2f} ms", flush=True)
        if batch == 1:
            with profile(activities=activities) as prof:
                for _ in range(PROFILED):
                    engine.step()
            table = prof.key_averages()
            print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
            launches = sum(k.count for k in table if k.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                "cuLaunchKernelEx", "cudaLaunchKernelExC"))
            copies = sum(k.count for k in table if "Synchronize" in k.key or "cudaMemcpy" in k.key)
            print(f"per step: {launches / PROFILED:.0f} kernel launches, {copies / PROFILED:.0f} sync/memcpy calls")
        while engine.has_unfinished():
            engine.step()
    engine.shutdown()


if __name__ == "__main__":
    main()
