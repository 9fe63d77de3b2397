"""A decode step of B sequences: the one-call native step against the module path, in one engine.

    python benchmarks/bench_decode_rows.py [--rows 1 2 3 4 8 16] [--rounds 6] [--dtype float32]

One engine (the embedded SmolLM2 unless --model), B requests of 32-token prompts decoding together.
For each B it alternates the two paths round by round (`model.stage_decoder` on, then off: the same
requests, the same KV, the same threads), 8 steps a round, and prints the median step time of each
path over its rounds, their range and the ratio. Nothing here is a test; the figures go to
docs/benchmarks.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

STEPS_PER_ROUND = 8


def step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    enable_prefix_caching=False))
    model = engine.runner.model
    native = model.stage_decoder
    if native is None:
        raise SystemExit("no native decode step here (tensor parallel, no C compiler or no AVX-512)")
    rng = np.random.default_rng(7)
    vocab = engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)  # > the steps a row count takes
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, {args.dtype}, "
          f"{args.rounds} rounds of {STEPS_PER_ROUND} steps per path")
    print("| rows | native step ms | module path ms | native / modules |")
    print("|---|---|---|---|")
    for rows in args.rows:
        ids = [engine.add_request(rng.integers(3, vocab, 32).tolist(), params) for _ in range(rows)]
        step_ms(engine, 5)  # the prefill and a few decode steps
        seen: dict[str, list[float]] = {"native": [], "modules": []}
        for _ in range(args.rounds):
            for path in seen:
                model.stage_decoder = native if path == "native" else None
                seen[path].append(step_ms(engine, STEPS_PER_ROUND))
        model.stage_decoder = native
        a, b = (statistics.median(seen[p]) for p in ("native", "modules"))
        print(f"| {rows} | {a:.1f} ({min(seen['native']):.1f}-{max(seen['native']):.1f}) "
              f"| {b:.1f} ({min(seen['modules']):.1f}-{max(seen['modules']):.1f}) | {a / b:.2f}x |", flush=True)
        for request_id in ids:
            engine.abort(request_id)
            engine.take_abort_output(request_id)
        while engine.has_unfinished():
            engine.step()
    engine.shutdown()


if __name__ == "__main__":
    main()
