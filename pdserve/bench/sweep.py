"""A sweep of Poisson rates over several systems, and DistServe's goodput from it.

    pdserve bench sweep --endpoint agg=http://127.0.0.1:8001 \
        --endpoint disagg=http://127.0.0.1:8000 --model M --request-rates 0.02 0.05 0.1 0.15 \
        --num-prompts 40 --input-len 1024 --output-len 64 --goodput ttft:10000 tpot:150 \
        --out sweep.json --run-dir runs/

(benchmarks/bench_serving.py takes the same flags.)

Every system sees the same prompts and arrival times at a given rate; each rate gets its own
prompts, so no run hits a prefix cached by an earlier one (restart the servers, or change --seed,
before sweeping the same servers again). The sweep goes rate by rate, each rate's systems in turn and
in alternate order (A B C at the first rate, C B A at the next, ...), so that on a machine whose speed
drifts during a sweep (a shared VM can drift by 30% within the hour) the systems compared at one rate
ran close in time. Results of another load generator join the same file with
--from-results NAME=FILE... (vLLM `bench serve` result files written with --save-detailed:
per-request ttfts, itls, output_lens and errors), rescored under this sweep's SLOs.

DistServe goodput: the highest swept rate whose SLO attainment (requests meeting every SLO / all
requests, failed ones included), and that of every lower swept rate, is at least --attainment (0.9).
A system that misses it even at the lowest rate has goodput 0. `pdserve bench grid` scores the same
runs under a grid of SLO pairs (grid.py).

Sweep JSON (schema "pdserve.bench.sweep/1"):

    {schema, date, slo: {ttft_ms, tpot_ms}, attainment_target, config: {input_len, output_len, ...},
     systems: {NAME: {source: URL | [files], goodput_rate, attainment_monotone,
                      runs: [{request_rate, slo_attainment, completed, failed, mean_ttft_ms, ...,
                              run_file}]}}}

runs[i] is the flat summary of one run (metrics.summarize keys) without the per-request records;
run_file, when set, holds the full run (pdserve.bench.run/1) for timeline plots.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pdserve.bench import server_steps
from pdserve.bench.arrivals import parse_rate
from pdserve.bench.metrics import SLO, RequestRecord, summarize
from pdserve.bench.report import load_json, rate_json, write_json
from pdserve.bench.runner import BenchmarkError
from pdserve.bench.single_run import add_workload_arguments, endpoint_of, load_tokenizer, run_once, workload_of

SCHEMA = "pdserve.bench.sweep/1"


def distserve_goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """The highest rate among (rate, attainment) points such that it and every lower rate reach
    `target`; 0 when the lowest misses. (A rate after a miss does not count: a noisy sweep cannot claim
    a rate it failed below.)"""
    best = 0.0
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best


def is_monotone(points: Sequence[tuple[float, float]]) -> bool:
    """Attainment never rises with the rate (else the sweep is noisy: more prompts help)."""
    att = [a for _, a in sorted(points)]
    return all(a >= b for a, b in zip(att, att[1:]))


def system_entry(source: Any, runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: float(r["request_rate"]))
    points = [(float(r["request_rate"]), r["slo_attainment"]) for r in runs if r.get("slo_attainment") is not None]
    goodput = rate_json(distserve_goodput(points, target)) if points else None
    return {"source": source, "goodput_rate": goodput,
            "attainment_monotone": is_monotone(points), "runs": runs}


def records_from_vllm(doc: dict[str, Any]) -> list[RequestRecord]:
    """Per-request records from a vLLM `bench serve --save-detailed` result (latency = ttft + Σ itl)."""
    missing = [k for k in ("ttfts", "itls", "output_lens") if k not in doc]
    if missing:
        raise ValueError(f"vLLM result lacks {', '.join(missing)}; rerun `vllm bench serve` with --save-detailed")
    n = len(doc["ttfts"])
    errors = doc.get("errors") or [""] * n
    in_lens = doc.get("input_lens") or [0] * n
    records = []
    for i in range(n):
        ok = not errors[i] and doc["output_lens"][i] > 0
        itl = list(doc["itls"][i]) if ok else []
        records.append(RequestRecord(i, int(in_lens[i]), int(doc["output_lens"][i]), success=ok, error=errors[i] or "",
                                     ttft=doc["ttfts"][i] if ok else 0.0, itl=itl,
                                     e2e=(doc["ttfts"][i] + sum(itl)) if ok else 0.0,
                                     output_tokens=int(doc["output_lens"][i])))
    return records


def records_of_file(path: str | Path) -> list[RequestRecord]:
    """The per-request records of a pdserve run file or of a detailed vLLM result."""
    return _records(load_json(path))


def _records(doc: dict[str, Any]) -> list[RequestRecord]:
    if doc.get("schema") == "pdserve.bench.run/1":
        return [RequestRecord.from_dict(r) for r in doc["requests"]]
    return records_from_vllm(doc)


def summary_of_file(path: str | Path, slo: SLO | None) -> dict[str, Any]:
    """A run summary from a pdserve run file or a detailed vLLM result, re-scored under `slo`."""
    doc = load_json(path)
    records = _records(doc)
    rate = doc.get("request_rate")
    if rate is None:
        raise ValueError(f"{path} does not record its request_rate")
    summary = {"request_rate": rate, **summarize(records, float(doc["duration"]), slo), "run_file": str(path)}
    if doc.get("engine_steps"):  # a pdserve run file of a pdserve server
        summary["engine_steps"] = doc["engine_steps"]
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL", help="a live system to load")
    p.add_argument("--engine-metrics", action="append", default=[], metavar="NAME=URL[,URL...]",
                   help="the pdserve instances behind endpoint NAME whose engine steps each run records (default: "
                        "the endpoint itself; behind pdserve's orchestrator, name its instances)")
    p.add_argument("--from-results", action="append", nargs="+", default=[], metavar="NAME=FILE",
                   help="NAME=FILE [FILE ...]: runs of another load generator (one file per rate)")
    p.add_argument("--request-rates", nargs="+", type=parse_rate, default=[0.02, 0.05, 0.1, 0.15])
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment a rate must reach to count")
    p.add_argument("--cooldown", type=float, default=2.0, help="seconds of idle between runs")
    p.add_argument("--skip-after-miss", action="store_true",
                   help="stop a system's sweep after the first rate that misses --attainment")
    p.add_argument("--out", required=True, help="sweep JSON to write (rewritten after every run)")
    p.add_argument("--run-dir", default=None, help="also keep each full run as RUN_DIR/NAME-rRATE.json")
    add_workload_arguments(p)
    return p


def _split(item: str, flag: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"{flag} {item!r} must be NAME=VALUE, e.g. {flag} disagg=http://127.0.0.1:8000")
    return name, value


def main_sweep(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _sweep(args)
    except (ValueError, FileNotFoundError, BenchmarkError) as e:
        print(f"pdserve bench sweep: error: {e}", file=sys.stderr)
        return 2


def _sweep(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    if slo is None:
        raise ValueError("a sweep needs SLOs for goodput: add e.g. --goodput ttft:10000 tpot:150")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    endpoints = [_split(e, "--endpoint") for e in args.endpoint]
    imports = [(*_split(group[0], "--from-results"), *group[1:]) for group in args.from_results]
    if not endpoints and not imports:
        raise ValueError("nothing to sweep: give --endpoint NAME=URL and/or --from-results NAME=FILE ...")
    names = [n for n, *_ in endpoints] + [n for n, *_ in imports]
    if len(set(names)) != len(names):
        raise ValueError(f"system names must be unique, got {names}")
    metrics = {}
    live = dict(endpoints)
    for name, urls in (_split(e, "--engine-metrics") for e in args.engine_metrics):
        if name not in live:
            raise ValueError(f"--engine-metrics {name}=...: no --endpoint is named {name!r}")
        metrics[name] = urls.split(",")
    rates = sorted(args.request_rates)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "slo": slo.to_dict(), "attainment_target": args.attainment,
        "config": {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
                   "prompt_kind": args.prompt_kind, "seed": args.seed, "burstiness": args.burstiness,
                   "max_concurrency": args.max_concurrency, "max_duration_s": args.max_duration,
                   "request_rates": [rate_json(r) for r in rates]},
        "systems": {},
    }
    for name, first, *rest in imports:
        runs = [summary_of_file(f, slo) for f in (first, *rest)]
        doc["systems"][name] = system_entry([first, *rest], runs, args.attainment)
    if endpoints:
        tokenizer = load_tokenizer(args.tokenizer)
        # Fresh prompts per rate (seed + k): a prompt a server already saw would be a prefix-cache
        # hit. Every system gets the same prompts at the same rate.
        workloads = [workload_of(args, tokenizer, seed=args.seed + k) for k in range(len(rates))]
        runs_of: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in endpoints}
        dropped: set[str] = set()  # --skip-after-miss: systems past their first miss
        for i, (rate, requests) in enumerate(zip(rates, workloads)):
            # Rate by rate, the systems in turn, in alternate order (A B C, C B A, ...): on a machine whose
            # speed drifts during the sweep, systems compared at one rate were measured close in time.
            for name, url in endpoints if i % 2 == 0 else endpoints[::-1]:
                if name in dropped:
                    continue
                print(f"== {name} at {rate:g} req/s ({args.num_prompts} requests)", flush=True)
                result = run_once(args, endpoint_of(args, url, metrics.get(name)), requests, rate, slo, tokenizer)
                summary = {k: v for k, v in result.items() if k != "requests"}
                if args.run_dir:
                    run_file = Path(args.run_dir) / f"{name}-r{rate:g}.json"
                    write_json(run_file, result)
                    summary["run_file"] = str(run_file)
                runs_of[name].append(summary)
                doc["systems"][name] = system_entry(url, runs_of[name], args.attainment)  # first rate: in order given
                write_json(args.out, doc)
                print(f"   attainment {100 * result['slo_attainment']:.0f}%  mean TTFT {result['mean_ttft_ms']:.0f} ms"
                      f"  mean TPOT {result['mean_tpot_ms']:.1f} ms  p99 ITL {result['p99_itl_ms']:.0f} ms", flush=True)
                if result.get("engine_steps"):
                    print(f"   {server_steps.describe(result['engine_steps'])}", flush=True)
                if args.skip_after_miss and result["slo_attainment"] < args.attainment:
                    dropped.add(name)
                time.sleep(args.cooldown)
    write_json(args.out, doc)
    print(format_sweep(doc))
    return 0


def format_sweep(doc: dict[str, Any]) -> str:
    """One row per (system, rate), then each system's goodput."""
    head = f"{'system':<14}{'rate':>7}{'attain%':>9}{'TTFT ms':>10}{'TPOT ms':>9}{'p99 ITL':>9}{'done':>6}"
    lines = [head, "-" * len(head)]
    for name, sys_ in doc["systems"].items():
        for r in sys_["runs"]:
            att = r.get("slo_attainment")
            lines.append(f"{name:<14}{float(r['request_rate']):>7.3g}{'-' if att is None else f'{100 * att:.0f}':>9}"
                         f"{r['mean_ttft_ms']:>10.0f}{r['mean_tpot_ms']:>9.1f}{r['p99_itl_ms']:>9.0f}"
                         f"{r['completed']:>6}")
    lines.append("")
    target = doc["attainment_target"]
    for name, sys_ in doc["systems"].items():
        note = "" if sys_["attainment_monotone"] else "  (attainment not monotone in rate: noisy sweep)"
        lines.append(f"goodput {name}: {sys_['goodput_rate']} req/s (highest rate with >= {100 * target:.0f}% "
                     f"of requests meeting the SLOs){note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_sweep())
