"""`pdserve bench`: load an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, E2E and goodput.

    pdserve bench --base-url http://127.0.0.1:8000 --model NAME --num-prompts 50 \
        --request-rate 0.1 --input-len 1024 --output-len 64 --goodput ttft:10000 tpot:150 \
        --result-json out.json

    pdserve bench sweep --endpoint NAME=URL ... --request-rates 0.02 0.05 0.1 --out sweep.json ...
    pdserve bench grid sweep.json     goodput at every (TTFT, TPOT) SLO pair, and the SLO scale

Prompts are built with the served model's tokenizer (--tokenizer, default: the embedded SmolLM2).
"""

from __future__ import annotations

import argparse
import math
import sys

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.metrics import SLO
from pdserve.bench.report import format_table, write_json
from pdserve.bench.runner import BenchmarkError
from pdserve.bench.single_run import add_workload_arguments, endpoint_of, load_tokenizer, run_once, workload_of
from pdserve.bench.sweep import main_sweep


def build_parser(prog: str = "pdserve bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--engine-metrics", nargs="+", default=None, metavar="URL",
                   help="pdserve instances whose engine steps the run records (default: --base-url); behind "
                        "pdserve's orchestrator, its instances' roots, e.g. http://127.0.0.1:8001 "
                        "http://127.0.0.1:8002")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals at this many req/s; inf (default) sends all at once")
    add_workload_arguments(p)
    p.add_argument("--result-json", default=None, help="write the full result (summary + per-request timings) here")
    return p


def main_bench(argv: list[str] | None = None) -> int:
    """`pdserve bench ...` (one run), or `pdserve bench sweep ...` (see sweep.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        return main_sweep(argv[1:])
    if argv[:1] == ["grid"]:
        from pdserve.bench.grid import main_grid

        return main_grid(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        slo = SLO.parse(args.goodput)
        ep = endpoint_of(args, args.base_url, args.engine_metrics)
        tokenizer = load_tokenizer(args.tokenizer)
        requests = workload_of(args, tokenizer)
        result = run_once(args, ep, requests, args.request_rate, slo, tokenizer)
    except (ValueError, FileNotFoundError, BenchmarkError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.result_json:
        write_json(args.result_json, result)
        print(f"wrote {args.result_json}")
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main_bench())
