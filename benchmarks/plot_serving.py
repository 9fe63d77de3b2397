"""Plots for the serving benchmark (matplotlib, written as PNG).

    python benchmarks/plot_serving.py rates sweep_pdserve.json sweep_vllm.json --out rates.png
        TTFT, TPOT (mean solid, p99 dashed) and SLO attainment against the Poisson rate, one line
        per system from every sweep file (pdserve.bench.sweep/1), with the SLOs drawn in.

    python benchmarks/plot_serving.py timeline runs/agg-r0.1.json runs/disagg-r0.1.json \
        --labels "aggregated" "disaggregated" --requests 0 12 --out timeline.png
        One panel per run (pdserve.bench.run/1): each request is a row, a line from send to its
        last token with a dot at every token arrival (the decode steps as the client saw them) and
        a red dot at the first token. Faint red lines mark when any request's first token arrived,
        i.e. where a prefill just ran; with prefill interference the other rows' dots stop there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from pdserve.bench.metrics import RequestRecord  # noqa: E402


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _rate(r: dict) -> float:
    return float(r["request_rate"])


def merged_systems(paths: list[str]) -> tuple[dict[str, dict], dict]:
    """{system name: entry} over all sweep files, and the SLO they share."""
    systems: dict[str, dict] = {}
    slo = None
    for path in paths:
        doc = _load(path)
        if doc.get("schema") != "pdserve.bench.sweep/1":
            raise ValueError(f"{path} is not a sweep file (pdserve.bench.sweep/1); make one with bench_serving.py")
        if slo is not None and doc["slo"] != slo:
            raise ValueError(f"{path} was scored under SLO {doc['slo']}, the others under {slo}; "
                             "rescore with the same --goodput so the curves compare")
        slo = doc["slo"]
        for name, entry in doc["systems"].items():
            if name in systems:
                raise ValueError(f"system {name!r} appears in two sweep files; give the runs distinct names")
            systems[name] = entry
    return systems, slo or {}


def plot_rates(paths: list[str], out: str) -> None:
    systems, slo = merged_systems(paths)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("ttft", "TTFT (s)", 1e-3, slo.get("ttft_ms")), ("tpot", "TPOT (ms)", 1.0, slo.get("tpot_ms")))
    for i, (name, entry) in enumerate(systems.items()):
        runs = [r for r in entry["runs"] if np.isfinite(_rate(r))]
        rates = [_rate(r) for r in runs]
        color = f"C{i}"
        label = f"{name} (goodput {entry['goodput_rate']} req/s)"
        for ax, (key, _, scale, _) in zip(axes, panels):
            ax.plot(rates, [r[f"mean_{key}_ms"] * scale for r in runs], "o-", color=color, label=label)
            ax.plot(rates, [r[f"p99_{key}_ms"] * scale for r in runs], "x--", color=color, alpha=0.6)
        axes[2].plot(rates, [100 * (r["slo_attainment"] or 0) for r in runs], "o-", color=color, label=label)
    for ax, (key, ylabel, scale, limit) in zip(axes, panels):
        if limit is not None:
            ax.axhline(limit * scale, color="k", ls=":", lw=1, label=f"SLO {key.upper()}")
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel, title=f"{key.upper()}: mean (solid), p99 (dashed)")
        ax.set_yscale("log")
    axes[2].axhline(100 * 0.9, color="k", ls=":", lw=1)
    axes[2].set(xlabel="request rate (req/s)", ylabel="requests meeting both SLOs (%)", ylim=(0, 105),
                title="SLO attainment")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def plot_timeline(paths: list[str], labels: list[str] | None, first: int, count: int, out: str,
                  xlim: tuple[float, float] | None = None) -> None:
    if labels and len(labels) != len(paths):
        raise ValueError(f"{len(paths)} run files but {len(labels)} --labels; give one label per file")
    fig, axes = plt.subplots(len(paths), 1, figsize=(12, 1.2 + 0.35 * count * len(paths)), squeeze=False)
    for ax, path, label in zip(axes[:, 0], paths, labels or paths):
        doc = _load(path)
        if doc.get("schema") != "pdserve.bench.run/1":
            raise ValueError(f"{path} is not a pdserve run file; a timeline needs per-request send times "
                             "(pdserve bench --result-json, or bench_serving.py --run-dir)")
        records = [RequestRecord.from_dict(r) for r in doc["requests"]][first:first + count]
        shown = [r for r in records if r.success]
        if not shown:
            raise ValueError(f"{path}: no successful request among #{first}..#{first + count - 1}")
        t0 = min(r.send_time for r in shown)
        for r in shown:
            ax.axvline(r.send_time + r.ttft - t0, color="tab:red", alpha=0.15, lw=4)
        for row, r in enumerate(shown):
            times = r.token_times() - t0
            ax.plot([r.send_time - t0, times[-1]], [row, row], color="0.6", lw=1)
            ax.plot(times[1:], np.full(len(times) - 1, row), "o", color="tab:blue", ms=2.5)
            ax.plot(times[:1], [row], "o", color="tab:red", ms=5)
            ax.plot([r.send_time - t0], [row], "|", color="k", ms=8)
        ax.set_yticks(range(len(shown)), [f"#{r.index}" for r in shown], fontsize=7)
        ax.invert_yaxis()
        if xlim is not None:
            ax.set_xlim(*xlim)
        p99 = doc.get("p99_itl_ms", float("nan"))
        ax.set(xlabel="time since the first shown request was sent (s)",
               title=f"{label} at {doc['request_rate']} req/s: | sent, red = first token, blue = decode tokens "
                     f"(p99 ITL {p99:.0f} ms)")
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rates", help="TTFT / TPOT / attainment against the request rate")
    r.add_argument("sweeps", nargs="+")
    r.add_argument("--out", default="serving_rates.png")
    t = sub.add_parser("timeline", help="token arrivals per request, one panel per run")
    t.add_argument("runs", nargs="+")
    t.add_argument("--labels", nargs="+", default=None)
    t.add_argument("--requests", nargs=2, type=int, default=[0, 12], metavar=("FIRST", "COUNT"))
    t.add_argument("--xlim", nargs=2, type=float, default=None, metavar=("T0", "T1"),
                   help="zoom to this time window (s since the first shown request was sent)")
    t.add_argument("--out", default="serving_timeline.png")
    args = p.parse_args(argv)
    try:
        if args.what == "rates":
            plot_rates(args.sweeps, args.out)
        else:
            plot_timeline(args.runs, args.labels, args.requests[0], args.requests[1], args.out, args.xlim)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"plot_serving: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
