"""Engine throughput and latency on this machine: pdserve beside transformers on the same weights.

    python benchmarks/bench_engine.py [--dtypes float32 bfloat16] [--decode-tokens 64]

Prints one table per weight dtype: prefill tokens/s at 512 and 2048 prompt tokens, time to first
token at 1024, decode tokens/s at batch 1 and with 16 concurrent requests, and the ratio
pdserve / transformers. It also measures memory-read bandwidth in the same run and prints the batch-1
decode roofline (weight bytes / bandwidth). vLLM is added as a row when `vllm` is importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

PROMPT_DECODE = 128


def read_bandwidth_gbs() -> float:
    """Memory-read bandwidth with the threads torch uses: sum a buffer far larger than the caches."""
    x = torch.ones(256 * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


# -- pdserve ------------------------------------------------------------------------------------------

def _drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Returns (time to the first token of the last request, decode seconds, decode tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    first_done = None
    started: set[str] = set()
    decode_tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        if first_done is not None:
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            continue
        started.update(o.request_id for o in outs)
        if len(started) == len(prompts):
            first_done = time.perf_counter()
    end = time.perf_counter()
    return first_done - t0, end - first_done, decode_tokens


def bench_pdserve(dtype: str, decode_tokens: int, model: str | None) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_tokens=4096, enable_prefix_caching=False,
                                    kv_cache_memory_gb=2.0))
    vocab = engine.model_cfg.vocab_size
    row = {}
    _drive(engine, [random_prompt(64, vocab, 0)], 4)  # warm-up
    for n in (512, 2048):
        ttft, _, _ = _drive(engine, [random_prompt(n, vocab, n)], 1)
        row[f"prefill_{n}"] = n / ttft
    row["ttft_1024"], _, _ = _drive(engine, [random_prompt(1024, vocab, 7)], 1)
    _, dt, n = _drive(engine, [random_prompt(PROMPT_DECODE, vocab, 1)], decode_tokens + 1)
    row["decode_b1"] = n / dt
    _, dt, n = _drive(engine, [random_prompt(PROMPT_DECODE, vocab, 100 + i) for i in range(16)], decode_tokens + 1)
    row["decode_b16"] = n / dt
    row["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    row["model_dir"] = engine.model_dir
    engine.shutdown()
    return row


# -- references: anything with a timed `run(prompts, new_tokens) -> seconds` ------------------------------

def measure_generate(run, vocab: int, decode_tokens: int) -> dict:
    """The table's row for a whole-request generate call: prefill from 1-token runs, decode from the
    difference between a (decode_tokens + 1)-token run and a 1-token run of the same prompts."""
    run([random_prompt(64, vocab, 0)], 4)  # warm-up
    row = {f"prefill_{n}": n / run([random_prompt(n, vocab, n)], 1) for n in (512, 2048)}
    row["ttft_1024"] = run([random_prompt(1024, vocab, 7)], 1)
    one = [random_prompt(PROMPT_DECODE, vocab, 1)]
    row["decode_b1"] = decode_tokens / (run(one, decode_tokens + 1) - run(one, 1))
    many = [random_prompt(PROMPT_DECODE, vocab, 100 + i) for i in range(16)]
    row["decode_b16"] = 16 * decode_tokens / (run(many, decode_tokens + 1) - run(many, 1))
    return row


# -- transformers -------------------------------------------------------------------------------------

def bench_transformers(model_dir: Path, dtype: str, decode_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype))
    vocab = model.config.vocab_size

    def gen(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    return measure_generate(gen, vocab, decode_tokens)  # the model is freed on return


# -- vLLM (optional peer row) -------------------------------------------------------------------------

def bench_vllm(model_dir: Path, dtype: str, decode_tokens: int) -> dict | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import LLM as VLLM, SamplingParams as VParams, TokensPrompt

    llm = VLLM(model=str(model_dir), dtype=dtype, enable_prefix_caching=False, max_model_len=4096)
    vocab = llm.get_tokenizer().vocab_size

    def run(prompts: list[list[int]], new: int) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     VParams(max_tokens=new, min_tokens=new, temperature=0.0), use_tqdm=False)
        return time.perf_counter() - t

    return measure_generate(run, vocab, decode_tokens)


COLUMNS = [("prefill_512", "prefill 512 tok/s", "{:.0f}"), ("prefill_2048", "prefill 2048 tok/s", "{:.0f}"),
           ("ttft_1024", "TTFT 1024 s", "{:.3f}"), ("decode_b1", "decode b1 tok/s", "{:.1f}"),
           ("decode_b16", "decode 16 req tok/s", "{:.1f}")]


def print_table(dtype: str, rows: dict[str, dict], bandwidth: float) -> None:
    print(f"\n### weights {dtype}\n")
    print("| system | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    ours, ref = rows["pdserve"], rows["transformers"]
    ratio = [ref[k] / ours[k] if k.startswith("ttft") else ours[k] / ref[k] for k, _, _ in COLUMNS]
    print("| pdserve / transformers | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    if "vllm" in rows:
        v = rows["vllm"]
        ratio = [v[k] / ours[k] if k.startswith("ttft") else ours[k] / v[k] for k, _, _ in COLUMNS]
        print("| pdserve / vllm | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    roof_ms = ours["weight_bytes"] / (bandwidth * 1e9) * 1e3
    print(f"\nbatch-1 decode roofline: {ours['weight_bytes'] / 1e6:.0f} MB of weights / {bandwidth:.1f} GB/s = "
          f"{roof_ms:.1f} ms/token ({1e3 / roof_ms:.1f} tok/s); pdserve reaches "
          f"{ours['decode_b1'] * roof_ms / 1e3 * 100:.0f}% of it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = read_bandwidth_gbs()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; memory-read bandwidth {bandwidth:.1f} GB/s")
    for dtype in args.dtypes:
        rows = {"pdserve": bench_pdserve(dtype, args.decode_tokens, args.model)}
        rows["transformers"] = bench_transformers(rows["pdserve"]["model_dir"], dtype, args.decode_tokens)
        v = bench_vllm(rows["pdserve"]["model_dir"], dtype, args.decode_tokens)
        if v is not None:
            rows["vllm"] = v
        print_table(dtype, rows, bandwidth)


if __name__ == "__main__":
    main()
