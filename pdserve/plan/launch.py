"""`pdserve launch --slo ttft:MS,tpot:MS`: plan the deployment (cached profile), then launch its cluster.yaml."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pdserve.plan.run import cluster_of, cluster_text, format_table, run_plan


def planned_cluster(args: argparse.Namespace) -> str | None:
    """The path of the pick's cluster.yaml, or None after saying why nothing should start."""
    preds, slo, profile, at, _ = run_plan(args)
    print(format_table(preds, slo, at, top=5), flush=True)
    pick = preds[0]
    if pick.goodput <= 0:
        print(f"pdserve launch: error: no deployment on this machine keeps >= {100 * args.attainment:.0f}% of "
              f"requests within {slo} for {args.input_len}-token prompts and {args.output_len}-token outputs, even at "
              "low load; loosen the SLO (see `pdserve plan` for the closest), or pass a cluster.yaml", file=sys.stderr)
        return None
    args.out = str(Path(tempfile.mkdtemp(prefix="pdserve-plan-")) / "cluster.yaml")
    doc = cluster_of(pick.candidate, args, profile)
    Path(args.out).write_text(cluster_text(pick.candidate, doc, slo, args, pick.goodput))
    print(f"\npdserve launch: launching {pick.candidate.name} ({pick.candidate.layout}), predicted goodput "
          f"{pick.goodput:.3g} req/s; its cluster.yaml: {args.out}\n", flush=True)
    return args.out
