"""`pdserve plan` against measurement: its predicted goodput grid beside the one a real sweep measures.

    python benchmarks/plan_check.py --systems agg1x2-c512 agg2x1-c512 disagg1x1-1x1-cf disagg1x1-1x1-gf \
        --input-len 256 --output-len 32 --rates 0.5 1 1.5 2 2.5 3 3.5 --num-prompts 30 \
        --ttft 300 500 1000 2500 --tpot 25 30 40 60 100 --out-dir benchmarks/results/plan-check

1. Plans twice (the cached profile; `pdserve plan --rates ...`): every candidate's predicted goodput at
   every (TTFT, TPOT) cell, scored at exactly the swept rates, once on the very arrival times the sweep
   will send (its --seed: the model's error on this experiment) and once pooled over --sim-seeds other
   draws (what a run of this length gives on average; a 30-request run is one draw, and one burst of
   arrivals in it decides its tail).
2. For each named candidate, one at a time: writes its cluster.yaml (the plan's own), starts it with
   `pdserve launch`, sweeps it with `pdserve bench sweep` (same workload and rates), stops it.
3. Scores the runs with `pdserve bench grid` and compares, cell by cell, among the measured systems:
   - pick: the system the plan ranks first in that cell; right when its measured goodput is the best
     measured or within 10% of it;
   - error: |predicted - measured| / measured goodput of the pick (0 when both are 0).
Prints the grids and, for each prediction, the two shares (the issue's bar: pick right in >= 80% of the cells, predicted
goodput within 25% of the measured one).
4. With --repeats N, every system is swept N times (every other round in reverse order) and the rounds are set side
   by side: in how many cells the pick's measured goodput of the rounds lies within 25% of each other (what this
   machine repeats; no prediction can be held to a tighter bar than that), and in how many the prediction lies within
   25% of the span the rounds measured.
5. With --measured GRID, step 2 is skipped: the plan is checked against a grid another sweep already measured (a
   `pdserve bench grid --out` file, e.g. from benchmarks/slo_grid_vs_vllm.sh), whose systems --systems names as
   CANDIDATE=NAME. That sweep must have run this workload, these rates and --seed for the replay to be its arrivals.
Nothing here is timed by a test; this is a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def predicted(args, out: Path, replay: bool) -> dict:
    """replay: simulate the very arrivals the sweep sends (its seed, one draw): how well the model predicts this
    experiment. Otherwise --sim-seeds other draws pooled: the expected attainment of a run of this length."""
    path = out / ("plan-replay.json" if replay else "plan.json")
    seeds = ["--seed", str(args.seed), "--sim-seeds", "1"] if replay else ["--sim-seeds", str(args.sim_seeds)]
    run([sys.executable, "-m", "pdserve.cli", "plan", "--slo", f"ttft:{max(args.ttft)},tpot:{args.plan_tpot}",
         "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--backend", args.backend,
         "--dtype", args.dtype,
         "--rates", *map(str, args.rates), "--grid-ttft", *map(str, args.ttft), "--grid-tpot", *map(str, args.tpot),
         "--num-requests", str(args.num_prompts), *seeds,
         "--out", str(out / "plan-cluster.yaml"), "--json", str(path), "--top", "20"])
    return json.loads(path.read_text())


def grid_path(out: Path, round_: int) -> Path:
    return out / ("grid.json" if round_ == 0 else f"grid-r{round_}.json")


def measure(args, out: Path, plan: dict) -> list[dict]:
    """Every system swept --repeats times: round k goes through them in turn, every other round in reverse order
    (so no system always runs first or last). The grid of each round."""
    clusters = {c["name"]: c["cluster"] for c in plan["candidates"]}
    missing = [s for s in args.systems if s not in clusters]
    if missing:
        raise SystemExit(f"not candidates of this plan: {missing}; candidates: {sorted(clusters)}")
    grids = []
    for k in range(args.repeats):
        order = args.systems if k % 2 == 0 else args.systems[::-1]
        grids.append(measure_round(args, out, clusters, order, k))
    return grids


def measure_round(args, out: Path, clusters: dict, order: list[str], round_: int) -> dict:
    tag = "" if round_ == 0 else f"-r{round_}"
    sweep = out / f"sweep{tag}.json"
    sweep.unlink(missing_ok=True)
    for name in order:
        doc = dict(clusters[name], port=args.port, log_dir=str(out / f"logs-{name}"))
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", str(path)], cwd=ROOT,
                                stdout=open(out / f"launch-{name}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{args.port}"
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{name}: pdserve launch exited; see {out}/launch-{name}.log")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: not ready after 300 s")
                time.sleep(1)
            part = out / f"sweep-{name}{tag}.json"
            # The orchestrator runs no engine: each run records its instances' steps (ports as launch assigns them).
            members = len(doc["context"]) + len(doc["generation"])
            engines = ",".join(f"http://127.0.0.1:{args.port + 1 + i}" for i in range(members))
            run([sys.executable, "-m", "pdserve.cli", "bench", "sweep", "--endpoint", f"{name}={url}",
                 "--engine-metrics", f"{name}={engines}",
                 "--model", args.model_name, "--request-rates", *map(str, args.rates),
                 "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--goodput", f"ttft:{max(args.ttft)}", f"tpot:{max(args.tpot)}",
                 "--seed", str(args.seed), "--out", str(part), "--run-dir", str(out / f"runs{tag}")])
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        merged = json.loads(sweep.read_text()) if sweep.exists() else None
        one = json.loads(part.read_text())
        if merged is None:
            merged = one
        else:
            merged["systems"].update(one["systems"])
        sweep.write_text(json.dumps(merged, indent=1))
    grid = grid_path(out, round_)
    run([sys.executable, "-m", "pdserve.cli", "bench", "grid", str(sweep), "--ttft", *map(str, args.ttft),
         "--tpot", *map(str, args.tpot), "--out", str(grid)])
    return json.loads(grid.read_text())


def measured_grid(path: Path, aliases: dict[str, str]) -> dict:
    """A grid another sweep measured, its systems renamed to the plan's candidates (aliases: candidate -> name)."""
    grid = json.loads(path.read_text())
    names = set(grid["cells"][0]["goodput"])
    missing = sorted(n for n in aliases.values() if n not in names)
    if missing:
        raise SystemExit(f"{path} has no system {missing}; it has {sorted(names)}")
    for cell in grid["cells"]:
        cell["goodput"] = {cand: cell["goodput"][name] for cand, name in aliases.items()}
    return grid


def predictions(plan: dict, systems: list[str]) -> dict[tuple, tuple[str, dict[str, float]]]:
    """Per (TTFT, TPOT) cell: the plan's pick among `systems` and its predicted goodput of each."""
    order = [c["name"] for c in plan["candidates"]]  # the plan's ranking at its own SLO breaks ties
    out = {}
    for c in plan["grid"]["cells"]:
        pred = {s: float(c["goodput"][s]) for s in systems}
        out[(c["ttft_ms"], c["tpot_ms"])] = (max(systems, key=lambda s: (pred[s], -order.index(s))), pred)
    return out


def repeatability(plan: dict, grids: list[dict], systems: list[str]) -> str:
    """The same deployments measured again: how far apart two sweeps of one system land, cell by cell (the floor
    under any prediction's error on this machine), and whether the prediction falls within 25% of the span the
    rounds measured."""
    preds = predictions(plan, systems)
    n = len(grids)
    lines = ["| TTFT ms | TPOT ms | pick | " + " | ".join(f"round {k}" for k in range(n))
             + " | rounds within 25% | predicted | within 25% of the span |", "|---|---|---|" + "---|" * (n + 3)]
    agree = within = 0
    for cell in grids[0]["cells"]:
        key = (cell["ttft_ms"], cell["tpot_ms"])
        pick, pred = preds[key]
        meas = [float(next(c for c in g["cells"] if (c["ttft_ms"], c["tpot_ms"]) == key)["goodput"][pick])
                for g in grids]
        lo, hi = min(meas), max(meas)
        close = hi == lo or (lo > 0 and hi <= 1.25 * lo)
        near = 0.75 * lo <= pred[pick] <= 1.25 * hi if hi > 0 else pred[pick] == 0
        agree += close
        within += near
        lines.append(f"| {key[0]:g} | {key[1]:g} | {pick} | " + " | ".join(f"{m:g}" for m in meas)
                     + f" | {'yes' if close else 'no'} | {pred[pick]:g} | {'yes' if near else 'no'} |")
    cells = len(grids[0]["cells"])
    lines += ["", f"the pick's goodput, {n} rounds within 25% of each other: {agree} of {cells} cells "
                  f"({100 * agree / cells:.0f}%)",
              f"predicted goodput within 25% of the span the rounds measured: {within} of {cells} cells "
              f"({100 * within / cells:.0f}%)"]
    return "\n".join(lines)


def compare(plan: dict, measured: dict, systems: list[str]) -> str:
    preds = predictions(plan, systems)
    lines = ["| TTFT ms | TPOT ms | " + " | ".join(f"{s} meas / pred" for s in systems) + " | pick | right | error |",
             "|---|---|" + "---|" * (len(systems) + 3)]
    right = within = cells = 0
    for cell in measured["cells"]:
        key = (cell["ttft_ms"], cell["tpot_ms"])
        meas = {s: float(cell["goodput"][s]) for s in systems}
        pick, pred = preds[key]
        best = max(meas.values())
        ok = meas[pick] >= 0.9 * best
        if meas[pick] == pred[pick]:
            err = 0.0
        else:
            err = abs(pred[pick] - meas[pick]) / meas[pick] if meas[pick] else float("inf")
        cells += 1
        right += ok
        within += err <= 0.25
        lines.append(f"| {key[0]:g} | {key[1]:g} | " + " | ".join(f"{meas[s]:g} / {pred[s]:g}" for s in systems)
                     + f" | {pick} | {'yes' if ok else 'no'} | {'-' if err == float('inf') else f'{100 * err:.0f}%'} |")
    lines += ["", f"pick right (best measured or within 10% of it): {right} of {cells} cells "
                  f"({100 * right / cells:.0f}%)",
              f"predicted goodput of the pick within 25% of measured: {within} of {cells} cells "
              f"({100 * within / cells:.0f}%)"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", required=True,
                   help="candidate names of the plan to deploy and measure (with --measured: CANDIDATE=NAME, NAME "
                        "the system's name in that grid)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 1.5, 2, 2.5, 3, 3.5])
    p.add_argument("--num-prompts", type=int, default=30, help="measured requests per rate")
    p.add_argument("--repeats", type=int, default=1,
                   help="sweep every system this many times (rounds in alternating order): the spread between rounds "
                        "is the machine's own, which no prediction can beat")
    p.add_argument("--sim-seeds", type=int, default=16,
                   help="simulated runs of --num-prompts requests per rate, pooled into the second prediction (the "
                        "first replays the sweep's own arrivals)")
    p.add_argument("--ttft", type=float, nargs="+", default=[300, 500, 1000, 2500])
    p.add_argument("--tpot", type=float, nargs="+", default=[25, 30, 40, 60, 100])
    p.add_argument("--backend", default="shm")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--measured", type=Path,
                   help="a grid already measured (`pdserve bench grid --out`): check the plan against it, "
                        "sweep nothing")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--out-dir", default="benchmarks/results/plan-check")
    p.add_argument("--plan-tpot", type=float,
                   help="the TPOT of the SLO the plan ranks by, and the budget of its `-t` candidates (default: the "
                        "largest --tpot)")
    p.add_argument("--compare-only", action="store_true", help="reuse OUT_DIR's plan*.json and grid.json")
    p.add_argument("--repredict", action="store_true",
                   help="plan again (the current model and profile) and compare with OUT_DIR's grid.json")
    args = p.parse_args()
    aliases = dict(s.split("=", 1) if "=" in s else (s, s) for s in args.systems)
    if args.measured is None and any(c != n for c, n in aliases.items()):
        p.error("CANDIDATE=NAME in --systems needs --measured")
    args.systems = list(aliases)
    args.plan_tpot = args.plan_tpot or max(args.tpot)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.compare_only:
        plans = {replay: json.loads((out / ("plan-replay.json" if replay else "plan.json")).read_text())
                 for replay in (True, False)}
    else:
        plans = {replay: predicted(args, out, replay) for replay in (True, False)}
    if args.measured is not None:
        grids = [measured_grid(args.measured, aliases)]
    elif args.compare_only or args.repredict:
        grids = [json.loads(grid_path(out, k).read_text()) for k in range(100) if grid_path(out, k).exists()]
    else:
        grids = measure(args, out, plans[False])
    for k, grid in enumerate(grids):
        for replay, title in ((True, f"the sweep's own arrivals (seed {args.seed})"),
                              (False, f"{args.sim_seeds} other arrival draws pooled (the expected run)")):
            print(f"\nround {k}, predicted from {title}:\n" + compare(plans[replay], grid, args.systems))
    if len(grids) > 1:
        print("\nthe rounds side by side, the pooled prediction's pick:\n"
              + repeatability(plans[False], grids, args.systems))


if __name__ == "__main__":
    main()
