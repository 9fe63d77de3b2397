"""A MoE model's routed experts under tensor parallelism: sharded against replicated (EngineConfig.moe_experts).

    python benchmarks/bench_moe_tp.py --tiny-qwen3-moe DIR | --tiny-deepseek-v3 DIR [--dtype float32]
        [--tp 2] [--decode-tokens 32] [--rounds 2]

The models are bench_engine.py's (random weights, written to DIR). Rows: one rank (all the cores), then TP ranks
with the experts sharded (each expert's intermediate dimension cut over the ranks), then with them replicated
(each rank holds them whole and computes its share of the choices). Columns: prefill tokens/s of one 512-token
prompt, decode tokens/s of one sequence and of 16 (128-token prompts), and the routed experts' weight bytes each
rank holds. The rows run in turn, `--rounds` times, each figure the best of its rounds (bench_engine's REPEATS
within a round).
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from bench_engine import PROMPT_DECODE, REPEATS, _drive, random_prompt, read_bandwidth_gbs, tiny_deepseek_v3, \
    tiny_qwen3_moe


def expert_bytes(model) -> int:
    """Rank 0's routed expert weights (packed or plain copies alike: their element count)."""
    from pdserve.models.moe import SparseMoeBlock

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SparseMoeBlock)
               for p in m.experts.parameters())


def bench(model: str, dtype: str, decode_tokens: int, tp: int, experts: str) -> dict:
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_tokens=4096, enable_prefix_caching=False,
                                    kv_cache_memory_gb=1.0, tensor_parallel_size=tp, moe_experts=experts))
    try:
        vocab = engine.model_cfg.vocab_size
        _drive(engine, [random_prompt(64, vocab, 0)], 4)  # warm-up
        row = {"prefill_512": 512 / min(_drive(engine, [random_prompt(512, vocab, 512)], 1)[0]
                                        for _ in range(REPEATS))}
        for name, prompts in (("decode_b1", [random_prompt(PROMPT_DECODE, vocab, 1)]),
                              ("decode_b16", [random_prompt(PROMPT_DECODE, vocab, 100 + i) for i in range(16)])):
            runs = [_drive(engine, prompts, decode_tokens + 1) for _ in range(REPEATS)]
            row[name] = max(n / dt for _, dt, n in runs)
        row["expert_mb"] = expert_bytes(engine.runner.model) / 2**20
    finally:
        engine.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--tiny-qwen3-moe", metavar="DIR", help="bench_engine.py's Qwen3-MoE, written to DIR")
    which.add_argument("--tiny-deepseek-v3", metavar="DIR", help="bench_engine.py's DeepSeek-V3, written to DIR")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = str(tiny_qwen3_moe(args.tiny_qwen3_moe) if args.tiny_qwen3_moe else tiny_deepseek_v3(args.tiny_deepseek_v3))
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"memory-read bandwidth {read_bandwidth_gbs():.1f} GB/s; {os.getloadavg()[0]:.1f} load average at start")
    systems = {"TP1": (1, "sharded"), f"TP{args.tp} sharded": (args.tp, "sharded"),
               f"TP{args.tp} replicated": (args.tp, "replicated")}
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, (tp, experts) in systems.items():
            row = bench(model, args.dtype, args.decode_tokens, tp, experts)
            best[name] = {k: max(v, best.get(name, {}).get(k, 0.0)) for k, v in row.items()}
    print(f"\n{os.path.basename(model.rstrip('/'))}, {args.dtype}, best of {args.rounds} rounds; "
          f"{os.getloadavg()[0]:.1f} load average at the end\n")
    print("| system | prefill 512 tok/s | decode b1 tok/s | decode 16 req tok/s | routed experts per rank MB |")
    print("|---|---|---|---|---|")
    for name, r in best.items():
        print(f"| {name} | {r['prefill_512']:.0f} | {r['decode_b1']:.1f} | {r['decode_b16']:.1f} | "
              f"{r['expert_mb']:.1f} |")


if __name__ == "__main__":
    main()
