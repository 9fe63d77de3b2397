"""Planning as a library: profile (cached), model every candidate, rank them, and what a pick turns into
(its cluster.yaml, the printed table, the JSON document). `pdserve plan` (cli.py) and `pdserve launch
--slo` (launch.py) both drive it."""

from __future__ import annotations

import argparse
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pdserve.plan.candidates import Candidate, enumerate_candidates
from pdserve.plan.costmodel import step_costs, transfer_costs
from pdserve.plan.planner import (
    PlanSLO,
    Prediction,
    capacity,
    rank,
    search_goodput,
)
from pdserve.plan.profile import Profile, default_backend, describe, load_or_measure
from pdserve.plan.simulate import Outcome, Workload, simulate

SCHEMA = "pdserve.plan/1"


def check_args(args: argparse.Namespace) -> PlanSLO:
    slo = PlanSLO.parse(args.slo)
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1 token")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.rate is not None and not 0 < args.rate < math.inf:
        raise ValueError(f"--rate must be a positive number of requests per second, got {args.rate}")
    for r in getattr(args, "rates", None) or []:
        if not 0 < r < math.inf:
            raise ValueError(f"--rates must be positive numbers of requests per second, got {r}")
    if getattr(args, "num_requests", 200) < 10:
        raise ValueError("--num-requests must be >= 10")
    return slo


def plan(args: argparse.Namespace, slo: PlanSLO, profile: Profile) -> tuple[list[Prediction], float]:
    """Every candidate's prediction, ranked, and the rate TTFT / TPOT are reported at."""
    max_len = int(profile.model["max_model_len"])
    if args.input_len + args.output_len > max_len:
        raise ValueError(f"--input-len + --output-len = {args.input_len + args.output_len} exceeds the model's "
                         f"context window ({max_len} tokens)")
    costs, transfers = step_costs(profile), transfer_costs(profile)
    transfer = transfers.get(args.backend)
    candidates = enumerate_candidates(profile.units, int(profile.key["units"]), args.input_len, slo.tpot_ms)
    candidates, left_out = fitting(candidates, args, profile)
    if not candidates:
        raise ValueError(f"no deployment's instances fit in this host's memory together; e.g. {left_out}")
    if left_out:
        print(f"left out the deployments whose instances this host cannot hold together, e.g. {left_out}\n", flush=True)
    if transfer is None and any(c.kind == "disaggregated" for c in candidates):
        raise ValueError(f"the profile has no {args.backend} transfer timings (is it installed?); "
                         f"measured: {', '.join(transfers) or 'none'}")
    wl = Workload(args.input_len, args.output_len, getattr(args, "num_requests", 200), getattr(args, "seed", 0))
    preds = []
    for cand in candidates:
        dep = cand.deployment(costs, transfer, profile.kv_bytes_per_token, profile.serving,
                              profile.state_bytes_per_request)
        good, points = search_goodput(dep, wl, slo, capacity(dep, wl), args.attainment, getattr(args, "rates", None))
        preds.append(Prediction(cand, good, points))
    best = max(p.goodput for p in preds)
    at = args.rate or best or min(r for p in preds for r, _ in p.points)
    for p in preds:
        dep = p.candidate.deployment(costs, transfer, profile.kv_bytes_per_token, profile.serving,
                                     profile.state_bytes_per_request)
        p.at_rate = at
        p.outcome = simulate(dep, wl, at)
    return rank(preds), at


def fitting(candidates: list[Candidate], args: argparse.Namespace, profile: Profile,
            available: int | None = None) -> tuple[list[Candidate], str | None]:
    """The candidates whose instances this host can hold together (the check `pdserve launch` makes of their
    cluster.yaml, launch/config.py: weights, KV pools and state of every instance on the CPU; `available` bytes,
    default MemAvailable), and why the first one left out was."""
    from pdserve.launch.config import ClusterConfig, too_big_for_memory

    # the model the profile measured (resolved: --model left out is the default model's directory)
    sized = argparse.Namespace(**{"dtype": "float32", "kv_cache_dtype": "auto", "port": 8000, **vars(args),
                                  "model": profile.key["model"]})
    kept, why = [], None
    for cand in candidates:
        problem = too_big_for_memory(ClusterConfig(**cluster_of(cand, sized, profile)), available)
        if problem is None:
            kept.append(cand)
        else:
            why = why or f"{cand.name}: {problem}"
    return kept, why


def format_table(preds: list[Prediction], slo: PlanSLO, at: float, top: int) -> str:
    head = (f"{'#':>2}  {'deployment':<22} {'layout (instances x threads)':<48} {'goodput':>8}  {'attain':>6}  "
            f"{'TTFT p50/p90 ms':>16}  {'TPOT p50/p90 ms':>16}")
    lines = [f"predicted goodput (req/s) at {slo}; attainment, TTFT and TPOT at {at:.3g} req/s", head, "-" * len(head)]
    for i, p in enumerate(preds[:top], 1):
        o = p.outcome
        att = o.attainment(slo.ttft_ms / 1000, slo.tpot_ms / 1000)
        ttft = f"{1000 * o.percentile('ttft', 50):.0f}/{1000 * o.percentile('ttft', 90):.0f}"
        tpot = f"{1000 * o.percentile('tpot', 50):.1f}/{1000 * o.percentile('tpot', 90):.1f}"
        lines.append(f"{i:>2}  {p.candidate.name:<22} {p.candidate.layout:<48} {p.goodput:>8.3g}  "
                     f"{100 * att:>5.0f}%  {ttft:>16}  {tpot:>16}")
    if len(preds) > top:
        lines.append(f"    ... {len(preds) - top} more (--top {len(preds)})")
    return "\n".join(lines)


def layout_transfer(args: argparse.Namespace, profile: Profile) -> tuple:
    """The KV transfer plan between --ctx-layout and --gen-layout: (ctx, gen, rows, bounce). Raises ValueError
    for layouts the model cannot take."""
    from pdserve.kv_transfer.bounce import BounceConfig
    from pdserve.plan.transfer import Layout, transfer_plan

    ctx = Layout.parse(args.ctx_layout) if args.ctx_layout else Layout()
    gen = Layout.parse(args.gen_layout) if args.gen_layout else Layout()
    m = profile.model
    bounce = BounceConfig() if args.bounce else None
    rows = transfer_plan(ctx, gen, num_layers=m["num_layers"], kv_heads=m["num_kv_heads"], head_dim=m["head_dim"],
                         element_bytes=m["element_bytes"], prompt_tokens=args.input_len, bounce=bounce,
                         latent=m.get("latent", False), on_device=profile.key.get("device") == "cuda",
                         kv_layout=getattr(args, "kv_layout", "HND"))
    return ctx, gen, rows, bounce


def transfer_section(args: argparse.Namespace, profile: Profile, preds: list[Prediction]) -> str:
    from pdserve.plan.transfer import format_transfer_plan

    disagg = next((p.candidate for p in preds if p.candidate.kind == "disaggregated"), None)
    if disagg is None and not (args.ctx_layout or args.gen_layout):
        return ""
    ctx, gen, rows, bounce = layout_transfer(args, profile)
    which = "" if preds[0].candidate.kind == "disaggregated" else \
        f"(the pick is aggregated: no KV moves; for {disagg.name if disagg else 'the given layouts'})\n"
    return which + format_transfer_plan(ctx, gen, rows, args.input_len, bounce)


def predicted_grid(args: argparse.Namespace, profile: Profile, preds: list[Prediction]) -> dict[str, Any]:
    """Each candidate's goodput at every (TTFT, TPOT) pair, scored at exactly --rates (as bench grid)."""
    from pdserve.bench.sweep import distserve_goodput

    costs, transfer = step_costs(profile), transfer_costs(profile).get(args.backend)
    wl = Workload(args.input_len, args.output_len, args.num_requests, args.seed)
    outcomes = {}
    for p in preds:
        dep = p.candidate.deployment(costs, transfer, profile.kv_bytes_per_token, profile.serving,
                                     profile.state_bytes_per_request)
        outcomes[p.candidate.name] = [(r, pooled(dep, wl, r, args.sim_seeds)) for r in sorted(args.rates)]
    cells = []
    for ttft in sorted(args.grid_ttft):
        for tpot in sorted(args.grid_tpot):
            cells.append({"ttft_ms": ttft, "tpot_ms": tpot, "goodput": {
                name: distserve_goodput([(r, o.attainment(ttft / 1000, tpot / 1000)) for r, o in runs], args.attainment)
                for name, runs in outcomes.items()}})
    return {"schema": "pdserve.bench.grid/1", "attainment_target": args.attainment, "predicted": True,
            "systems": list(outcomes), "cells": cells}


def pooled(dep, wl: Workload, rate: float, seeds: int) -> Outcome:
    """The outcomes of `seeds` independent arrival draws at `rate`, as one: the expected attainment of a
    run of wl.num_requests requests (a short run builds a shorter queue than a long one)."""
    runs = [simulate(dep, Workload(wl.input_len, wl.output_len, wl.num_requests, wl.seed + i), rate)
            for i in range(seeds)]
    return Outcome(np.concatenate([o.ttft for o in runs]), np.concatenate([o.tpot for o in runs]))


def plan_document(args, slo: PlanSLO, profile: Profile, path: Path, preds: list[Prediction], at: float) -> dict:
    def one(p: Prediction) -> dict[str, Any]:
        o = p.outcome
        return {"name": p.candidate.name, "kind": p.candidate.kind, "layout": p.candidate.layout,
                "goodput": round(p.goodput, 4), "points": [[round(r, 4), round(a, 4)] for r, a in p.points],
                "at_rate": at, "attainment": o.attainment(slo.ttft_ms / 1000, slo.tpot_ms / 1000),
                "ttft_ms": {q: round(1000 * o.percentile("ttft", q), 1) for q in (50, 90, 99)},
                "tpot_ms": {q: round(1000 * o.percentile("tpot", q), 2) for q in (50, 90, 99)},
                "cluster": cluster_of(p.candidate, args, profile)}

    return {"schema": SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "attainment_target": args.attainment,
            "workload": {"input_len": args.input_len, "output_len": args.output_len}, "profile": str(path),
            "pick": preds[0].candidate.name, "candidates": [one(p) for p in preds]}


def cluster_of(cand: Candidate, args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    doc = cand.cluster_yaml(model=args.model, backend=args.backend, port=args.port,
                            device=profile.key["device"])
    for inst in doc["context"] + doc["generation"]:
        if args.dtype != "float32":
            inst["config"]["dtype"] = args.dtype
        if getattr(args, "kv_cache_dtype", "auto") != "auto":
            inst["config"]["kv_cache_dtype"] = args.kv_cache_dtype
    return doc


def cluster_text(cand: Candidate, doc: dict[str, Any], slo: PlanSLO, args: argparse.Namespace,
                 goodput: float) -> str:
    head = (f"# Written by `pdserve plan` on {datetime.now(UTC):%Y-%m-%d}: {cand.name} ({cand.layout}).\n"
            f"# Predicted goodput {goodput:.3g} req/s at {slo}, {args.input_len} prompt / {args.output_len} output "
            f"tokens.\n# Start it with: pdserve launch {args.out}\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def run_plan(args: argparse.Namespace) -> tuple[list[Prediction], PlanSLO, Profile, float, Path]:
    """Profile (cached), model and rank: shared by `pdserve plan` and `pdserve launch --slo`."""
    slo = check_args(args)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and args.backend == "shm":
        raise ValueError("--backend shm moves host memory only; on CUDA the KV pools are in VRAM: use --backend nixl")
    args.backend = args.backend or default_backend(device)
    profile, path, fresh = load_or_measure(args.model, args.dtype, device, kv_cache_dtype=args.kv_cache_dtype,
                                           refresh=args.reprofile)
    print(describe(profile) + f"\n  ({'measured now' if fresh else 'cached'}: {path})\n", flush=True)
    if getattr(args, "ctx_layout", None) or getattr(args, "gen_layout", None):
        layout_transfer(args, profile)  # a layout the model cannot take fails now: before the simulation, no yaml
    preds, at = plan(args, slo, profile)
    return preds, slo, profile, at, path
