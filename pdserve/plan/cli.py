"""`pdserve plan`: the deployment that serves the most requests per second within an SLO, on this machine.

    pdserve plan --slo ttft:2500,tpot:100 --input-len 1024 --output-len 64 [--rate 0.5]
                 [--model M] [--dtype float32] [--kv-cache-dtype auto|fp8_e4m3|...] [--backend shm|nixl]
                 [--out plan-cluster.yaml]

1. Profile (once per model and machine, cached; `--reprofile` measures again): forward-step times by
   prompt length, decode batch and thread count, KV transfer time by bytes and backend, and what
   serving adds on real servers (profile.py, serving_probe.py). A few minutes, with a progress bar.
2. Model every candidate (candidates.py): aggregated instances of 1, 2, 4, ... threads with each
   prefill chunk budget; disaggregated splits of the cores between context and generation instances,
   context_first or generation_first with pipelined transfer. The scheduler's own policy runs in
   simulated time on the profile's step costs (simulate.py) under Poisson arrivals.
3. Print the ranked table of predicted goodput (DistServe's: the highest rate at which >= 90% of
   requests meet both SLOs) and TTFT / TPOT at a common rate; for the best disaggregated candidate,
   the KV transfer plan per rank pair (transfer.py).
4. Write the pick's cluster.yaml; `pdserve launch plan-cluster.yaml` (or `pdserve launch --slo ...`,
   which plans and launches in one step) starts it.

`--model` a config.json without weights (the file, or a directory holding only it) prints each TP x PP
layout's memory per rank instead (plan/memory.py): without weights nothing can be timed, so nothing is ranked.

`--rates R1 R2 ...` scores at exactly those rates, as `pdserve bench sweep` does, and `--json` keeps
every prediction (with `--grid-ttft/--grid-tpot`, a goodput grid shaped like `pdserve bench grid`'s)
for checking against a measured sweep (benchmarks/plan_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.plan.memory import config_only, memory_report
from pdserve.plan.run import cluster_of, cluster_text, format_table, plan_document, predicted_grid, run_plan, \
    transfer_section


def add_plan_arguments(p: argparse.ArgumentParser, *, slo_required: bool, defaults: bool = True) -> None:
    """`defaults` False (pdserve launch): a flag not given is absent from the namespace, so the caller can tell
    what was asked for (plan_defaults() has the rest)."""

    def arg(*names: str, **kw) -> None:
        action = p.add_argument(*names, **kw)
        if not defaults and action.dest != "slo":
            action.default = argparse.SUPPRESS

    arg("--slo", required=slo_required, metavar="ttft:MS,tpot:MS",
        help="the budgets a request must meet, e.g. ttft:2500,tpot:100")
    arg("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    arg("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    arg("--rate", type=float, default=None, help="request rate to report TTFT / TPOT at (default: the pick's goodput)")
    arg("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    arg("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    arg("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3"],
        help="the instances' kv_cache_dtype (default auto: --dtype); the profile is measured with it")
    arg("--backend", default=None, choices=["shm", "nixl"],
        help="KV transfer backend (default: shm on CPU; nixl on CUDA, whose pools shm cannot move)")
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"],
        help="what instances compute on: auto takes CUDA when a GPU is visible (a unit is then a GPU)")
    arg("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    arg("--reprofile", action="store_true", help="measure the profile again even if one is cached")
    arg("--port", type=int, default=8000, help="the cluster's public port (written into cluster.yaml)")


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_plan_arguments(p, slo_required=False)
    return p


def plan_defaults() -> dict:
    """Every planning flag at its default."""
    return {k: v for k, v in vars(_plan_parser().parse_args([])).items() if k != "slo"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(p, slo_required=False)  # required to rank; a config.json without weights plans memory only
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="a config.json without weights: each rank's KV pool (the instances' kv_cache_memory_gb)")
    p.add_argument("--max-ranks", type=int, default=16,
                   help="a config.json without weights: the largest TP x PP layout to size (default 16)")
    p.add_argument("--out", default="plan-cluster.yaml", help="where the pick's cluster.yaml goes")
    p.add_argument("--top", type=int, default=12, help="rows of the ranked table")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="score goodput at exactly these rates (as a sweep does) instead of searching")
    p.add_argument("--num-requests", type=int, default=200, help="simulated requests per rate")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulated Poisson arrivals; `pdserve bench --seed S` draws the same ones")
    p.add_argument("--sim-seeds", type=int, default=1,
                   help="with --grid-*: arrival draws per rate (seeds --seed, --seed + 1, ...), pooled: the expected "
                        "attainment of runs of --num-requests each")
    p.add_argument("--ctx-layout", default=None, help="transfer plan: the context instance's layout, e.g. tp2")
    p.add_argument("--gen-layout", default=None, help="transfer plan: the generation instance's layout, e.g. pp2")
    p.add_argument("--bounce", action="store_true", help="transfer plan: with the bounce buffer on")
    p.add_argument("--kv-layout", default="HND", choices=["HND", "NHD"],
                   help="transfer plan: the KV pools' layout (the workers' kv_layout)")
    p.add_argument("--json", default=None, help="write every prediction here")
    p.add_argument("--grid-ttft", type=float, nargs="+", default=None, help="with --rates and --json: TTFT SLOs (ms)")
    p.add_argument("--grid-tpot", type=float, nargs="+", default=None, help="with --rates and --json: TPOT SLOs (ms)")
    return p


def main_plan(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_only(args.model)
        if config is not None:  # no weights: memory per rank, no timings (plan/memory.py)
            if args.kv_cache_memory_gb <= 0 or args.max_ranks < 1:
                raise ValueError("--kv-cache-memory-gb must be > 0 and --max-ranks >= 1")
            print(memory_report(args, config))
            return 0
        if not args.slo:
            raise ValueError("--slo ttft:MS,tpot:MS is required to rank deployments (a config.json without weights "
                             "as --model sizes memory per rank without it)")
        for flag, out in (("--out", args.out), ("--json", args.json)):  # before minutes of profiling, not after
            if out and not Path(out).resolve().parent.is_dir():
                raise ValueError(f"{flag} {out}: the directory {Path(out).resolve().parent} does not exist")
        preds, slo, profile, at, path = run_plan(args)
        print(format_table(preds, slo, at, args.top))
        pick = preds[0]
        doc = cluster_of(pick.candidate, args, profile)
        Path(args.out).write_text(cluster_text(pick.candidate, doc, slo, args, pick.goodput))
        print()
        if pick.goodput <= 0:
            o = pick.outcome
            print(f"warning: no deployment keeps >= {100 * args.attainment:.0f}% of requests within {slo} at any "
                  f"rate; the closest, {pick.candidate.name}, has TTFT p90 {1000 * o.percentile('ttft', 90):.0f} ms "
                  f"and TPOT p90 {1000 * o.percentile('tpot', 90):.1f} ms at {at:.3g} req/s. Loosen the SLO, "
                  "shorten the requests, or add cores.")
        print(f"pick: {pick.candidate.name} ({pick.candidate.layout}), predicted goodput {pick.goodput:.3g} req/s\n"
              f"wrote {args.out}; start it with: pdserve launch {args.out}")
        section = transfer_section(args, profile, preds)
        if section:
            print("\n" + section)
        if args.json:
            out = plan_document(args, slo, profile, path, preds, at)
            if args.rates and args.grid_ttft and args.grid_tpot:
                out["grid"] = predicted_grid(args, profile, preds)
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"wrote {args.json}")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main_plan())
