"""Tensor-parallel all-reduce on CPU: gloo against pdserve's shared-memory all-reduce, side by side.

    python benchmarks/bench_all_reduce.py [--worlds 2 3 4] [--shapes 1 8x576 64x576 512x576] [--calls 300]

For each group size, ranks are real processes on this host (one thread each, as a TP instance's ranks
run with num_threads 1 per core), joined as pdserve joins them (`init_parallel`), and each shape is
summed `--calls` times through gloo, then through the shared segment, alternating over 3 rounds. It
prints rank 0's median time per call and the ratio, and checks that both paths gave every rank the
same sum. Nothing here is a test; the figures go to docs/benchmarks.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.host import free_port

from pdserve.parallel.shm_all_reduce import attach_shm_all_reduce
from pdserve.parallel.state import init_parallel

ROUNDS = 3


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


def _all_reduce(ps, path: str, t: torch.Tensor) -> None:
    if path == "gloo":
        dist.all_reduce(t, group=ps.tp_group)
    else:
        ps.tp_shm(t)


def _rank(rank: int, world: int, port: int, shapes: list[str], calls: int, out) -> None:
    torch.set_num_threads(1)
    ps = init_parallel(world, 1, rank, "127.0.0.1", port, torch.device("cpu"), 60.0)
    attach_shm_all_reduce(ps, torch.device("cpu"), 60.0)
    if ps.tp_shm is None:
        raise SystemExit("no shared-memory all-reduce here (PDSERVE_SHM_ALL_REDUCE=0, or no kernel library)")
    rows = []
    for text in shapes:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(_shape(text), generator=gen)
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        sums = {}
        for _ in range(ROUNDS):
            for path in times:
                for _ in range(10):
                    _all_reduce(ps, path, x.clone())
                y = x.clone()
                start = time.perf_counter()
                for _ in range(calls):
                    y.copy_(x)
                    _all_reduce(ps, path, y)
                times[path].append((time.perf_counter() - start) / calls)
                sums[path] = y.clone()
        # the shm sum is the same on every rank; gloo's agrees with it to rounding
        gathered = [torch.empty_like(sums["shm"]) for _ in range(world)]
        dist.all_gather(gathered, sums["shm"], group=ps.tp_group)
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        close = torch.allclose(sums["shm"], sums["gloo"], rtol=1e-5, atol=1e-5)
        rows.append((text, statistics.median(times["gloo"]), statistics.median(times["shm"]), same and close))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--shapes", nargs="+", default=["1", "8x576", "64x576", "512x576"])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; one thread per rank; "
          f"median of {ROUNDS} rounds of {args.calls} calls, rank 0")
    print("| ranks | shape | gloo, us | shm, us | shm / gloo | same sum |")
    print("|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args.shapes, args.calls, out)) for r in range(world)]
        for p in procs:
            p.start()
        rows = out.get(timeout=600)
        for p in procs:
            p.join()
        for text, gloo, shm, ok in rows:
            same = "yes" if ok else "NO"
            print(f"| {world} | {text} | {gloo * 1e6:.0f} | {shm * 1e6:.0f} | {shm / gloo:.3f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
