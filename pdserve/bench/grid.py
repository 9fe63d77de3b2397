"""Goodput at every SLO pair, and DistServe's SLO scale, from one sweep's per-request records.

    pdserve bench grid sweep.json [--ttft 1500 2500 5000 10000] [--tpot 40 50 75 100 150]
                                  [--reference ttft:10000 tpot:150] [--out grid.json] [--plot grid.png]

A sweep (`pdserve bench sweep ... --run-dir DIR`, or --from-results files) keeps every request's TTFT
and TPOT, so any SLO can be scored afterwards without running anything again:

- goodput grid: for each (TTFT SLO, TPOT SLO) pair, each system's DistServe goodput (the highest swept
  rate whose attainment, and that of every lower rate, is >= --attainment; a rate after a miss does not
  count, so a noisy sweep cannot claim a rate it failed below).
- SLO scale (DistServe's second view): at each rate, the smallest s such that >= --attainment of the
  requests meet s x the reference SLOs. A request needs s = max(TTFT / TTFT_ref, TPOT / TPOT_ref); the
  answer is the ceil(attainment x n)-th smallest need (a failed request needs infinity). Lower is better.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from pdserve.bench.metrics import SLO, RequestRecord
from pdserve.bench.report import load_json, rate_json, write_json
from pdserve.bench.sweep import distserve_goodput, records_of_file

SCHEMA = "pdserve.bench.grid/1"
DEFAULT_TTFT_MS = (1500.0, 2500.0, 5000.0, 10000.0)
DEFAULT_TPOT_MS = (40.0, 50.0, 75.0, 100.0, 150.0)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    return sum(slo.is_met(r) for r in records) / len(records) if records else 0.0




def slo_scale(records: Sequence[RequestRecord], reference: SLO, target: float) -> float:
    """The smallest s with >= target of `records` meeting s x `reference` (math.inf when none can)."""
    if not records:
        return math.inf
    needs = sorted(_need(r, reference) for r in records)
    return needs[max(math.ceil(target * len(needs) - 1e-9), 1) - 1]


def _need(r: RequestRecord, reference: SLO) -> float:
    if not r.success:
        return math.inf
    parts = [(reference.ttft_ms, r.ttft * 1000.0), (reference.tpot_ms, (r.tpot or 0.0) * 1000.0),
             (reference.e2el_ms, r.e2e * 1000.0)]
    return max((value / ref for ref, value in parts if ref is not None), default=0.0)


def system_runs(sweep: dict[str, Any], base: Path) -> dict[str, list[tuple[float, list[RequestRecord]]]]:
    """Each system's (rate, per-request records) from a sweep document (run files resolved from `base`)."""
    out = {}
    for name, system in sweep["systems"].items():
        runs = []
        for run in system["runs"]:
            path = run.get("run_file")
            if path is None:
                raise ValueError(f"system {name!r} kept no per-request records: rerun `pdserve bench sweep` with "
                                 "--run-dir DIR")
            path = Path(path) if Path(path).is_absolute() or Path(path).exists() else base / path
            rate = float(run["request_rate"])
            runs.append((rate, records_of_file(path)))
        out[name] = runs
    return out


def build_grid(runs: dict[str, list[tuple[float, list[RequestRecord]]]], ttfts: Sequence[float],
               tpots: Sequence[float], reference: SLO, target: float) -> dict[str, Any]:
    systems = list(runs)
    cells = []
    for ttft in ttfts:
        for tpot in tpots:
            slo = SLO(ttft_ms=ttft, tpot_ms=tpot)
            cells.append({"ttft_ms": ttft, "tpot_ms": tpot,
                          "goodput": {s: rate_json(distserve_goodput([(rate, attainment(recs, slo))
                                                                      for rate, recs in runs[s]], target))
                                      for s in systems}})
    scale = {s: [{"request_rate": rate_json(rate), "slo_scale": _json_scale(slo_scale(recs, reference, target))}
                 for rate, recs in sorted(runs[s], key=lambda run: run[0])] for s in systems}
    return {"schema": SCHEMA, "attainment_target": target, "reference_slo": reference.to_dict(),
            "systems": systems, "cells": cells, "slo_scale": scale}


def _json_scale(s: float) -> float | str:
    return "inf" if math.isinf(s) else round(s, 3)


def format_grid(grid: dict[str, Any]) -> str:
    systems = grid["systems"]
    lines = [f"goodput (req/s; every lower swept rate also >= {100 * grid['attainment_target']:.0f}% within both SLOs)",
             "| TTFT ms | TPOT ms | " + " | ".join(systems) + " | best |",
             "|---|---|" + "---|" * (len(systems) + 1)]
    for cell in grid["cells"]:
        good = cell["goodput"]
        values = {s: math.inf if good[s] == "inf" else float(good[s]) for s in systems}
        top = max(values.values())
        best = ", ".join(s for s in systems if values[s] == top) if top > 0 else "-"
        lines.append(f"| {cell['ttft_ms']:g} | {cell['tpot_ms']:g} | " + " | ".join(str(good[s]) for s in systems)
                     + f" | {best} |")
    ref = grid["reference_slo"]
    by_rate = {s: {r["request_rate"]: r["slo_scale"] for r in grid["slo_scale"][s]} for s in systems}
    rates = sorted({rate for s in systems for rate in by_rate[s]}, key=lambda r: math.inf if r == "inf" else r)
    lines += ["", f"SLO scale (smallest multiple of {', '.join(f'{k} {v:g}' for k, v in ref.items())} that "
                  f"{100 * grid['attainment_target']:.0f}% of requests meet; lower is better)",
              "| system | " + " | ".join(f"{r} req/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for s in systems:
        lines.append(f"| {s} | " + " | ".join(str(by_rate[s].get(r, "-")) for r in rates) + " |")
    return "\n".join(lines)


def plot_grid(grid: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in grid["systems"]:
        points = [(r["request_rate"], r["slo_scale"]) for r in grid["slo_scale"][s]
                  if r["slo_scale"] != "inf" and r["request_rate"] != "inf"]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=s)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO scale (lower is better)")
    ax.set_title("SLO scale at each rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="a sweep JSON from `pdserve bench sweep` (with --run-dir)")
    p.add_argument("--ttft", nargs="+", type=float, default=list(DEFAULT_TTFT_MS), help="TTFT SLOs, ms")
    p.add_argument("--tpot", nargs="+", type=float, default=list(DEFAULT_TPOT_MS), help="TPOT SLOs, ms")
    p.add_argument("--reference", nargs="+", default=["ttft:10000", "tpot:150"],
                   help="the SLO the scale multiplies (KEY:MS, as --goodput)")
    p.add_argument("--attainment", type=float, default=None, help="default: the sweep's attainment target")
    p.add_argument("--out", default=None, help="write the grid JSON here")
    p.add_argument("--plot", default=None, help="write the SLO-scale plot (PNG) here")
    return p


def main_grid(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep = load_json(args.sweep)
        if sweep.get("schema") != "pdserve.bench.sweep/1":
            raise ValueError(f"{args.sweep} is not a `pdserve bench sweep` result (schema pdserve.bench.sweep/1)")
        target = args.attainment if args.attainment is not None else float(sweep["attainment_target"])
        if not 0 < target <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {target}")
        if any(not v > 0 for v in [*args.ttft, *args.tpot]):
            raise ValueError("every --ttft and --tpot SLO must be a positive number of milliseconds")
        reference = SLO.parse(args.reference)
        if reference is None:
            raise ValueError("--reference needs at least one KEY:MS, e.g. --reference ttft:10000 tpot:150")
        grid = build_grid(system_runs(sweep, Path(args.sweep).parent), sorted(args.ttft), sorted(args.tpot),
                          reference, target)
        if args.plot:
            plot_grid(grid, args.plot)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"pdserve bench grid: error: {e}", file=sys.stderr)
        return 2
    print(format_grid(grid))
    if args.out:
        write_json(args.out, grid)
    return 0


if __name__ == "__main__":
    sys.exit(main_grid())
