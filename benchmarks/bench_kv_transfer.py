"""KV transfer, process to process: the transceiver path against a raw NIXL write and a local copy.

    python benchmarks/bench_kv_transfer.py [--tokens 512 2048 8192] [--dtypes fp32 bf16] [--backend nixl]

KV of SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64, 16 tokens per block). A context
instance runs in a spawned process and writes into this process's generation instance.

Table 1 (tp1 -> tp1, HND, one pool per rank): time from `request_and_receive_async` to
`check_gen_transfer_status` reporting the request (control round trip + plan + write +
notification; RankInfo exchange warmed up first), against one raw NIXL write of the same bytes
between two processes, and one in-process `torch` copy (the memory-bandwidth limit).
Table 2 (tp1 -> tp3, NHD: one fragment per layer, K/V and token per gen rank), direct vs bounce.
Every row reports the median of --reps runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

from pdserve.kv_transfer.agents import MemoryRegion, make_agent
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.transceiver import KVTransceiver, TransceiverConfig

LAYERS, HEADS, HEAD_DIM, TPB = 30, 3, 64, 16
DTYPES = {"fp32": 4, "bf16": 2}
TIMEOUT_S = 120


def build(name: str, tp: int, blocks: int, elt: int, layout: MapperKind, backend: str, bounce) -> list:
    ranks, infos = [], []
    heads = max(1, HEADS // tp)
    for tp_rank in range(tp):
        pool = allocate_shared(blocks * LAYERS * 2 * heads * TPB * HEAD_DIM * elt)
        agent = make_agent(backend, f"bench-{name}-{tp_rank}-{time.monotonic_ns()}")
        agent.register_memory(MemoryRegion(pool.ptr, pool.nbytes))
        tx = KVTransceiver(agent, TransceiverConfig(kv_transfer_timeout_ms=TIMEOUT_S * 1000, bounce=bounce))
        table = page_table_for_block_major_pool(pool.ptr, blocks, LAYERS, heads, TPB, HEAD_DIM, elt, layout,
                                                range(LAYERS))
        info = RankInfo(name, tp_rank, tp, tp_rank, 1, 0, 1, 0, 1, 0, (LAYERS,), HEADS, heads, HEAD_DIM, elt, TPB,
                        table, tx.local_descriptor(), tx.endpoint)
        ranks.append((tx, pool))
        infos.append(info)
    for (tx, _), info in zip(ranks, infos):
        tx.start(info, infos)
    return ranks


def ctx_main(blocks: int, elt: int, layout: str, backend: str, bounce, inbox, outbox) -> None:
    """Context instance (tp1): answers every request id it is sent until told to stop."""
    ranks = build("ctx", 1, blocks, elt, MapperKind[layout], backend, bounce)
    ranks[0][1].numpy()[:] = np.random.default_rng(0).integers(0, 255, ranks[0][1].nbytes, dtype=np.uint8)
    outbox.put(ranks[0][0].endpoint)
    ids = {0: np.arange(blocks, dtype=np.int64)}
    while True:
        while not inbox.empty():
            rid = inbox.get()
            if rid is None:
                outbox.put(ranks[0][0].stats)
                for tx, _ in ranks:
                    tx.close()
                    tx.agent.shutdown()
                return
            for tx, _ in ranks:
                tx.respond_and_send_async(rid, ids)
        for tx, _ in ranks:
            tx.check_context_transfer_status()
        time.sleep(0.0002)


def transceiver_run(tokens: int, elt: int, layout: str, gen_tp: int, backend: str, bounce, reps: int):
    """Median seconds per request for ctx tp1 -> gen tp`gen_tp`, plus the sender's stats."""
    blocks = -(-tokens // TPB)
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=ctx_main, args=(blocks, elt, layout, backend, bounce, inbox, outbox), daemon=True)
    proc.start()
    try:
        endpoint = outbox.get(timeout=TIMEOUT_S)
        gen = build("gen", gen_tp, blocks, elt, MapperKind[layout], backend, bounce)
        ids = {0: np.arange(blocks, dtype=np.int64)}
        times = []
        for rid in range(reps + 1):  # request 0 warms up the RankInfo exchange and connections
            inbox.put(rid)
            t0 = time.perf_counter()
            for tx, _ in gen:
                tx.request_and_receive_async(rid, endpoint, ids, (0, tokens))
            pending = {i for i in range(gen_tp)}
            while pending:
                for i in list(pending):
                    res = gen[i][0].check_gen_transfer_status()
                    if res.failed:
                        raise RuntimeError(f"transfer failed: {res.failed}")
                    if res.completed:
                        pending.discard(i)
            if rid:
                times.append(time.perf_counter() - t0)
        inbox.put(None)
        stats = outbox.get(timeout=TIMEOUT_S)
        for tx, _ in gen:
            tx.close()
            tx.agent.shutdown()
        return statistics.median(times), stats
    finally:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def raw_target(nbytes: int, backend: str, inbox, outbox) -> None:
    agent = make_agent(backend)
    buf = allocate_shared(nbytes)
    agent.register_memory(buf.region)
    outbox.put((agent.local_descriptor(), buf.ptr))
    inbox.get(timeout=TIMEOUT_S)
    agent.shutdown()


def raw_nixl_run(nbytes: int, backend: str, reps: int) -> float:
    """Median seconds of one single-descriptor write of nbytes into another process."""
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=raw_target, args=(nbytes, backend, inbox, outbox), daemon=True)
    proc.start()
    try:
        agent = make_agent(backend)
        src = allocate_shared(nbytes)
        src.numpy()[:] = 7
        agent.register_memory(src.region)
        desc, dst = outbox.get(timeout=TIMEOUT_S)
        peer = agent.load_remote(desc)
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            h = agent.submit_write(peer, [src.ptr], [dst], [nbytes], b"x")
            while agent.poll(h).value == "in_progress":
                pass
            agent.release(h)
            if i:
                times.append(time.perf_counter() - t0)
        agent.shutdown()
        inbox.put("bye")
        return statistics.median(times)
    finally:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def torch_copy_run(nbytes: int, reps: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--backend", default="nixl", choices=["nixl", "shm"])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    print(f"backend={args.backend}  SmolLM2 KV: {LAYERS} layers x {HEADS} KV heads x head_dim {HEAD_DIM}, "
          f"{TPB} tokens/block, median of {args.reps}\n")
    print("tp1 -> tp1 (HND, contiguous)")
    print(f"{'dtype':>5} {'tokens':>6} {'MiB':>7} {'frags':>5} {'ours GB/s':>9} {'raw GB/s':>9} {'copy GB/s':>9} "
          f"{'ours/raw':>8} {'ours/copy':>9}")
    for dtype in args.dtypes:
        elt = DTYPES[dtype]
        for tokens in args.tokens:
            nbytes = LAYERS * 2 * HEADS * HEAD_DIM * elt * (-(-tokens // TPB)) * TPB
            ours, stats = transceiver_run(tokens, elt, "HND", 1, args.backend, None, args.reps)
            frags = stats["fragments_written"] // stats["direct_writes"]
            raw = raw_nixl_run(nbytes, args.backend, args.reps)
            copy = torch_copy_run(nbytes, args.reps)
            print(f"{dtype:>5} {tokens:>6} {nbytes / 2**20:>7.1f} {frags:>5} {gbs(nbytes, ours):>9.2f} "
                  f"{gbs(nbytes, raw):>9.2f} {gbs(nbytes, copy):>9.2f} {raw / ours:>8.2f} {copy / ours:>9.2f}")

    print("\ntp1 -> tp3 (NHD head mismatch: one fragment per layer, K/V and token per gen rank)")
    print(f"{'dtype':>5} {'tokens':>6} {'MiB':>7} {'frags/rank':>10} {'direct ms':>9} {'bounce ms':>9} {'speedup':>7}")
    for dtype in args.dtypes:
        elt = DTYPES[dtype]
        for tokens in args.tokens:
            nbytes = LAYERS * 2 * HEADS * HEAD_DIM * elt * (-(-tokens // TPB)) * TPB
            direct, dstats = transceiver_run(tokens, elt, "NHD", 3, args.backend, None, args.reps)
            cfg = BounceConfig(staging_bytes=3 * nbytes)
            bounced, bstats = transceiver_run(tokens, elt, "NHD", 3, args.backend, cfg, args.reps)
            frags = dstats["fragments_written"] // max(1, dstats["direct_writes"])
            mode = "" if bstats["bounced_writes"] else " (gate: direct)"
            print(f"{dtype:>5} {tokens:>6} {nbytes / 2**20:>7.1f} {frags:>10} {direct * 1e3:>9.1f} "
                  f"{bounced * 1e3:>9.1f} {direct / bounced:>7.2f}{mode}")


if __name__ == "__main__":
    main()
