"""Engine throughput and latency on this machine: pdserve beside transformers on the same weights.

    python benchmarks/bench_engine.py [--dtypes float32 bfloat16] [--decode-tokens 64] [--device cpu|cuda]
        [--kv-cache-dtypes auto fp8_e4m3]

The header names the CPU's ISA (AVX2, AVX-512, AVX-512 BF16, AMX, NEON) and the path each CPU kernel takes
(native build, decode GEMV, flash prefill's bf16 products, oneDNN packing per dtype). Then it prints one
table per weight dtype, after the line of what the kernel dispatch chose at the engine's start
(kernels/dispatch.py: each native kernel or its PyTorch path, whichever is faster here): prefill
tokens/s at 512 and 2048 prompt tokens, time to first token at 1024, decode tokens/s at batch 1 and
with 16 concurrent requests, and the ratio pdserve / transformers. It also measures memory-read
bandwidth in the same run and prints the batch-1 decode roofline (weight bytes / bandwidth).

vLLM is an optional peer row. It usually lives in its own venv (its torch pins clash with ours), so
the row runs this same file in a child process under that interpreter (`--vllm-python`, default
$VLLM_PYTHON, else this interpreter when it can import vllm) and reads back one JSON line. The child
uses measure_generate and random_prompt from this file, so it sends the very same prompts.

--device cuda runs pdserve and transformers on the first CUDA device (no vLLM row) and reads the
device's own memory bandwidth for the roofline; --eager-row adds pdserve with `cuda_graphs: false`. The
embedded model does not travel to a GPU host, so there give --model a directory (`--tiny-smollm2` writes
random weights of SmolLM2-135M's shape).

--kv-cache-dtypes adds a pdserve row per KV cache dtype beyond the first (default: auto, the weights' dtype)
and its ratio to the first (an fp8_e4m3 cache: the native kernels read its bytes through their tables).

--tiny-qwen3-moe DIR benches a Qwen3-MoE of random weights (8 layers of hidden 512, 32 experts of 256,
top 4): the MoE block's grouped expert products (models/moe.py) against transformers' own.
--tiny-qwen3-5 DIR and --tiny-nemotron-h DIR bench hybrid models of random weights (8 layers of hidden 512:
Qwen3.5 with 6 Gated DeltaNet layers of 8 value heads of 64, Nemotron-H with 4 Mamba2 layers of 16 heads
of 64 and a 64-dim state), the recurrent layers in their native kernel (csrc/recurrent.c; PyTorch where it
cannot be built) against transformers'.
--tiny-deepseek-v3 DIR benches a DeepSeek-V3 of random weights (8 layers of hidden 512, 16 heads of latent
attention over a 160-wide latent (kv_lora 128 + rope 32), q_lora 256; layer 0 dense, the others 32 experts of
256 in 8 groups, top 4 within 4 groups, one shared expert): latent attention (models/mla.py, decode absorbed)
and the grouped-routed MoE against transformers'.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Every row runs with PyTorch's huge-page allocation, as pdserve's own processes do (pdserve/__init__.py):
# set before torch is imported here, inherited by the vLLM child.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

# pdserve is imported inside bench_pdserve/_drive: the --vllm-child process runs in vLLM's venv,
# which does not have pdserve installed.

PROMPT_DECODE = 128
# Every figure is the best of this many runs, for every system: the machine's speed moves +-10% between
# runs, and the first run of a new shape pays page faults for its buffers.
REPEATS = 3


def cpu_paths() -> str:
    """The ISA this run has and the path each CPU kernel takes on it, for the header: a figure from an
    AVX-512 machine says nothing of an AVX2 one. The ISA is the CPU's own; ATen's capability and oneDNN's
    bf16 honour ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, the native kernels PDSERVE_KERNEL_MARCH."""
    from pdserve.env import settings
    from pdserve.kernels import cpu
    from pdserve.models.layers import onednn_packs

    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features"))), "").split()
    except OSError:
        flags = []
    isa = ("AMX" if "amx_tile" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512"
           if "avx512f" in flags else "AVX2" if "avx2" in flags else "NEON" if "asimd" in flags else platform.machine())
    lib = cpu.load()
    march = settings().kernel_march
    native = ("off (no compiler or PDSERVE_CPU_KERNELS=0)" if lib is None
              else f"built for -march={march} ({cpu.kernel_isa()} form)")
    pairs = lib is not None and lib.flash_prefill_bf16_pairs() == 1
    gemv = cpu.skinny_linear_runs()
    return (f"isa: {isa} (ATen {torch.backends.cpu.get_cpu_capability()}); native kernels {native}; "
            f"decode GEMV {'on' if gemv else 'off (no AVX-512 or AVX2 + FMA in the build)'}; "
            f"flash prefill bf16 products {'bf16 (AVX512-BF16)' if pairs else 'fp32'}; "
            f"oneDNN GEMM: fp32 {'packed' if onednn_packs(torch.float32) else 'plain'}, "
            f"bf16 {'packed' if onednn_packs(torch.bfloat16) else 'plain (F.linear)'}")


def kernel_choices(dtype: str) -> str:
    """The path the kernel dispatch chose for each kernel at the engine's start (logged there too)."""
    from pdserve.kernels import cpu

    chosen = {kernel: use for (kernel, dt), use in cpu.chosen_paths().items() if str(dt) == f"torch.{dtype}"}
    paths = ", ".join(f"{kernel} {'native' if use else 'torch'}" for kernel, use in sorted(chosen.items()))
    return f"kernel dispatch ({dtype}): {paths or 'nothing decided (no native kernels)'}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def read_bandwidth_gbs(device: str = "cpu") -> float:
    """Memory-read bandwidth with the threads torch uses (or the GPU's): sum a buffer far larger than
    the caches."""
    x = torch.ones((256 if device == "cpu" else 4096) * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


# -- pdserve ------------------------------------------------------------------------------------------

def _drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Returns (time to the first token of the last request, decode seconds, decode tokens)."""
    from pdserve.engine.sampling_params import SamplingParams

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


def decode_bytes(model) -> int:
    """Weight bytes one decode step reads: every parameter, except that a token reads one row of the
    embedding table, that on CPU the LM head reads its own packed copy (layers.pack_for_cpu), and that a
    MoE block reads only the top_k experts a token picks (of batch 1: top_k / num_experts of them)."""
    from pdserve.models.moe import SparseMoeBlock

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
        total -= experts - experts * block.top_k // len(block.experts)
    embed = model.embed_tokens
    if embed is not None and (getattr(model, "lm_head", None) is not embed or embed.head_weight is not None):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def bench_pdserve(dtype: str, decode_tokens: int, model: str | None, device: str = "cpu",
                  kv_cache_dtype: str = "auto", cuda_graphs: bool = True) -> dict:
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_tokens=4096, enable_prefix_caching=False,
                                    kv_cache_memory_gb=2.0, device=device, kv_cache_dtype=kv_cache_dtype,
                                    cuda_graphs=cuda_graphs))
    vocab = engine.model_cfg.vocab_size
    row = {}
    _drive(engine, [random_prompt(64, vocab, 0)], 4)  # warm-up
    for n in (512, 2048):
        row[f"prefill_{n}"] = n / min(_drive(engine, [random_prompt(n, vocab, n)], 1)[0] for _ in range(REPEATS))
    row["ttft_1024"] = min(_drive(engine, [random_prompt(1024, vocab, 7)], 1)[0] for _ in range(REPEATS))
    for name, prompts in (("decode_b1", [random_prompt(PROMPT_DECODE, vocab, 1)]),
                          ("decode_b16", [random_prompt(PROMPT_DECODE, vocab, 100 + i) for i in range(16)])):
        runs = [_drive(engine, prompts, decode_tokens + 1) for _ in range(REPEATS)]
        row[name] = max(n / dt for _, dt, n in runs)
    row["weight_bytes"] = decode_bytes(engine.runner.model)
    row["model_dir"] = engine.model_dir
    engine.shutdown()
    return row


# -- references: anything with a timed `run(prompts, new_tokens) -> seconds` ------------------------------

def measure_generate(run, vocab: int, decode_tokens: int) -> dict:
    """The table's row for a whole-request generate call: prefill from 1-token runs, decode from the
    difference between a (decode_tokens + 1)-token run and a 1-token run of the same prompts."""
    run([random_prompt(64, vocab, 0)], 4)  # warm-up

    def best(prompts, new_tokens):
        return min(run(prompts, new_tokens) for _ in range(REPEATS))

    row = {f"prefill_{n}": n / best([random_prompt(n, vocab, n)], 1) for n in (512, 2048)}
    row["ttft_1024"] = best([random_prompt(1024, vocab, 7)], 1)
    one = [random_prompt(PROMPT_DECODE, vocab, 1)]
    row["decode_b1"] = decode_tokens / (best(one, decode_tokens + 1) - best(one, 1))
    many = [random_prompt(PROMPT_DECODE, vocab, 100 + i) for i in range(16)]
    row["decode_b16"] = 16 * decode_tokens / (best(many, decode_tokens + 1) - best(many, 1))
    return row


# -- transformers -------------------------------------------------------------------------------------

def bench_transformers(model_dir: Path, dtype: str, decode_tokens: int, device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).to(device)
    vocab = model.config.vocab_size

    def gen(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device=device)
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t

    return measure_generate(gen, vocab, decode_tokens)  # the model is freed on return


# -- vLLM (optional peer row, measured in a child process) ---------------------------------------------

ROW_MARK = "VLLM_ROW "  # prefixes the child's result line; vLLM logs to stdout too


def vllm_child(model_dir: str, dtype: str, decode_tokens: int) -> None:
    """Runs inside vLLM's interpreter: measure the row and print it as one marked JSON line."""
    from vllm import LLM, SamplingParams as VParams, TokensPrompt

    # The same vocab as the other rows (the model's config, not the tokenizer's count), so
    # random_prompt draws the same ids. No prefix caching: every measured prompt must be computed.
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False, max_model_len=4096)

    def run(prompts: list[list[int]], new: int) -> float:
        params = VParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    row = measure_generate(run, vocab, decode_tokens)
    print(ROW_MARK + json.dumps(row), flush=True)


def resolve_vllm_python(flag: str | None) -> str | None:
    """--vllm-python, else $VLLM_PYTHON, else this interpreter if it has vllm, else None (no row)."""
    if flag or os.environ.get("VLLM_PYTHON"):
        return flag or os.environ["VLLM_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def bench_vllm(python: str, model_dir: Path, dtype: str, decode_tokens: int) -> dict | None:
    """The vLLM row from a child under `python`; None (with the reason printed) if it fails, so the
    other rows of the table still print."""
    cmd = [python, os.path.abspath(__file__), "--vllm-child", str(model_dir), "--dtypes", dtype,
           "--decode-tokens", str(decode_tokens)]
    # A KV pool the size of pdserve's (2 GB), not vLLM-CPU's default share of the machine's memory.
    # And the same cores as pdserve: vLLM-CPU's default binding ("auto") computes on all cores but one
    # and keeps that one for its scheduler, which on a 2-core machine halves its compute. Set
    # VLLM_CPU_OMP_THREADS_BIND to override.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    except OSError as e:  # e.g. a --vllm-python path that does not exist
        print(f"note: vLLM row skipped, cannot run {python}: {e}", file=sys.stderr)
        return None
    rows = [line[len(ROW_MARK):] for line in proc.stdout.splitlines() if line.startswith(ROW_MARK)]
    if proc.returncode != 0 or not rows:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        print(f"note: vLLM row skipped, `{' '.join(cmd)}` exited {proc.returncode}:\n{tail}", file=sys.stderr)
        return None
    row = json.loads(rows[-1])
    # Say which cores the row computed on, as vLLM-CPU reports it.
    binding = [line.split("]", 1)[-1].strip() for line in proc.stdout.splitlines() + proc.stderr.splitlines()
               if "core ids=" in line or "reserved_cpus=" in line]
    row["binding"] = (f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}: "
                      + ", ".join(binding))
    return row


COLUMNS = [("prefill_512", "prefill 512 tok/s", "{:.0f}"), ("prefill_2048", "prefill 2048 tok/s", "{:.0f}"),
           ("ttft_1024", "TTFT 1024 s", "{:.3f}"), ("decode_b1", "decode b1 tok/s", "{:.1f}"),
           ("decode_b16", "decode 16 req tok/s", "{:.1f}")]


def best_of(rounds: list[dict]) -> dict:
    """One row from several rounds of the same system: each figure's best (highest throughput, lowest
    time to first token)."""
    row = dict(rounds[0])
    for key, _, _ in COLUMNS:
        values = [r[key] for r in rounds]
        row[key] = min(values) if key.startswith("ttft") else max(values)
    return row


def print_table(dtype: str, rows: dict[str, dict], bandwidth: float) -> None:
    print(f"\n### weights {dtype}\n")
    print("| system | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    ours, ref = rows["pdserve"], rows["transformers"]
    ratio = [ref[k] / ours[k] if k.startswith("ttft") else ours[k] / ref[k] for k, _, _ in COLUMNS]
    print("| pdserve / transformers | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    if "pdserve eager" in rows:  # CUDA graphs' gain (--eager-row)
        e = rows["pdserve eager"]
        ratio = [e[k] / ours[k] if k.startswith("ttft") else ours[k] / e[k] for k, _, _ in COLUMNS]
        print("| pdserve / pdserve eager | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    for name in (n for n in rows if n.startswith("pdserve kv ")):
        kv = rows[name]
        ratio = [ours[k] / kv[k] if k.startswith("ttft") else kv[k] / ours[k] for k, _, _ in COLUMNS]
        print(f"| {name} / pdserve | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    if "vllm" in rows:
        v = rows["vllm"]
        ratio = [v[k] / ours[k] if k.startswith("ttft") else ours[k] / v[k] for k, _, _ in COLUMNS]
        print("| pdserve / vllm | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    roof_ms = ours["weight_bytes"] / (bandwidth * 1e9) * 1e3
    print(f"\nbatch-1 decode roofline: {ours['weight_bytes'] / 1e6:.0f} MB of weights / {bandwidth:.1f} GB/s = "
          f"{roof_ms:.1f} ms/token ({1e3 / roof_ms:.1f} tok/s); pdserve reaches "
          f"{ours['decode_b1'] * roof_ms / 1e3 * 100:.0f}% of it")


def tiny_qwen3_moe(out_dir: str) -> Path:
    """--tiny-qwen3-moe's model (the module docstring); bench_moe_tp.py benches it too."""
    from pdserve.testing.tiny import make_tiny_model

    return make_tiny_model(out_dir, arch="qwen3_moe", num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                           intermediate_size=1024, vocab_size=8192, max_position_embeddings=4096,
                           moe_shape={"num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 256})


def tiny_deepseek_v3(out_dir: str) -> Path:
    """--tiny-deepseek-v3's model (the module docstring); bench_moe_tp.py benches it too."""
    from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(
        out_dir, num_layers=8, hidden_size=512, num_heads=16, intermediate_size=1024, vocab_size=8192,
        max_position_embeddings=4096,
        shape={"q_lora_rank": 256, "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64,
               "v_head_dim": 64, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 8, "topk_group": 4,
               "moe_intermediate_size": 256})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--vllm-python", default=None,
                    help="interpreter with vllm installed for the vLLM row (default: $VLLM_PYTHON)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, in turn, and keep each figure's best (the machine's "
                         "slow spells then fall on all systems alike)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where pdserve and transformers run (cuda: no vLLM row)")
    ap.add_argument("--tiny-smollm2", metavar="DIR", default=None,
                    help="write random weights of SmolLM2-135M's shape to DIR and bench those (for a GPU host, "
                         "where the embedded model is not installed)")
    ap.add_argument("--tiny-qwen3-moe", metavar="DIR", default=None,
                    help="write a small Qwen3-MoE of random weights to DIR and bench that (see above)")
    ap.add_argument("--tiny-qwen3-5", metavar="DIR", default=None,
                    help="write a small Qwen3.5 (hybrid) of random weights to DIR and bench that (see above)")
    ap.add_argument("--tiny-nemotron-h", metavar="DIR", default=None,
                    help="write a small Nemotron-H (hybrid) of random weights to DIR and bench that (see above)")
    ap.add_argument("--tiny-deepseek-v3", metavar="DIR", default=None,
                    help="write a small DeepSeek-V3 (MLA + MoE) of random weights to DIR and bench that (see above)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                    choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3"],
                    help="KV cache dtypes of the pdserve rows: the first is the 'pdserve' row, each other one a "
                         "'pdserve kv DTYPE' row beside it")
    ap.add_argument("--eager-row", action="store_true",
                    help="cuda: also a 'pdserve eager' row, with cuda_graphs: false (every decode step eager)")
    ap.add_argument("--vllm-child", metavar="MODEL_DIR", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        vllm_child(args.vllm_child, args.dtypes[0], args.decode_tokens)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device")
    if args.tiny_smollm2:
        from pdserve.testing.tiny import make_tiny_model

        args.model = str(make_tiny_model(args.tiny_smollm2, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                         rope_theta=100000.0, max_position_embeddings=8192))
    if args.tiny_qwen3_moe:
        args.model = str(tiny_qwen3_moe(args.tiny_qwen3_moe))
    if args.tiny_qwen3_5:
        from pdserve.testing.tiny import make_tiny_model

        args.model = str(make_tiny_model(args.tiny_qwen3_5, arch="qwen3_5", num_layers=8, num_heads=8, num_kv_heads=2,
                                         head_dim=64, intermediate_size=1536, vocab_size=8192,
                                         max_position_embeddings=4096,
                                         linear_shape={"linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                                       "linear_key_head_dim": 64, "linear_value_head_dim": 64}))
    if args.tiny_nemotron_h:
        from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h

        args.model = str(make_tiny_nemotron_h(args.tiny_nemotron_h, pattern="M-M-M*M-", hidden_size=512, num_heads=8,
                                              num_kv_heads=2, head_dim=64, intermediate_size=1536, vocab_size=8192,
                                              max_position_embeddings=4096,
                                              mamba={"mamba_num_heads": 16, "mamba_head_dim": 64, "n_groups": 2,
                                                     "ssm_state_size": 64}))
    if args.tiny_deepseek_v3:
        args.model = str(tiny_deepseek_v3(args.tiny_deepseek_v3))
    vllm_python = None if args.device == "cuda" else resolve_vllm_python(args.vllm_python)
    if vllm_python is None:
        print("note: no vLLM row (pass --vllm-python or set VLLM_PYTHON to an interpreter with vllm)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = read_bandwidth_gbs(args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{where}; {args.device} memory-read bandwidth {bandwidth:.1f} GB/s"
          + (f"; best of {args.rounds} rounds" if args.rounds > 1 else ""))
    if args.device == "cpu":
        print(cpu_paths())
    for dtype in args.dtypes:
        runs: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            ours = bench_pdserve(dtype, args.decode_tokens, args.model, args.device, args.kv_cache_dtypes[0])
            runs.setdefault("pdserve", []).append(ours)
            for kv in args.kv_cache_dtypes[1:]:
                runs.setdefault(f"pdserve kv {kv}", []).append(
                    bench_pdserve(dtype, args.decode_tokens, args.model, args.device, kv))
            if args.eager_row and args.device == "cuda":
                runs.setdefault("pdserve eager", []).append(
                    bench_pdserve(dtype, args.decode_tokens, args.model, args.device, args.kv_cache_dtypes[0], False))
            runs.setdefault("transformers", []).append(
                bench_transformers(ours["model_dir"], dtype, args.decode_tokens, args.device))
            v = bench_vllm(vllm_python, ours["model_dir"], dtype, args.decode_tokens) if vllm_python else None
            if v is not None:
                runs.setdefault("vllm", []).append(v)
            bandwidth = max(bandwidth, read_bandwidth_gbs(args.device))  # the roofline against the best bandwidth seen
        rows = {name: best_of(rounds) for name, rounds in runs.items()}
        if args.device == "cpu":
            print(kernel_choices(dtype))
        print_table(dtype, rows, bandwidth)
        if "vllm" in rows:
            print(f"vLLM threads: {rows['vllm']['binding']}")


if __name__ == "__main__":
    main()
