"""KV transfer, process to process: the transceiver path against a raw NIXL write and a local copy.

    python benchmarks/bench_kv_transfer.py [--tokens 512 2048 8192] [--dtypes fp32 bf16 fp8]
        [--backend nixl|shm] [--reps 5] [--contiguous-reps 21] [--case-timeout 240]
        [--tables contiguous nhd checksum] [--nixl-progress-delay-us US] [--device cpu|cuda] [--trace]

KV of SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64, 16 tokens per block). Every case
runs in two fresh spawned processes: a context instance (tp1) and a generation instance, started and
killed by this process, so a stuck case is recorded as "timeout" and the next one runs.

Table 1 (tp1 -> tp1, HND, one block-major pool per rank: one fragment for the whole request).
  ours: on the gen process, from `request_and_receive_async` until `check_gen_transfer_status`
        reports the request: REQUEST_DATA over ZeroMQ, plan, write, notification, both sides
        waiting with the library's own `at_least=1` polling. The context side has offered the
        request before the clock starts (prefill done).
  raw:  on the ctx process, one `submit_write` of the very same fragments (same agents, same
        registered memory, same processes, connections warm) until the initiator sees it DONE,
        polling every completion_poll_s like the transceiver: a busy poll starves NIXL's UCX progress
        thread on a small machine (1 MiB: 1.3 ms busy vs 0.2 ms with 0.1 ms sleeps, 2 cores).
        The gen process polls its agent meanwhile, as it does during ours. Reps alternate
        raw / ours, each preceded by an untimed warm-up; medians are reported.
  copy: one in-process torch copy of the same bytes (the memory-bandwidth limit).
  ours/raw: bandwidth ratio of the medians; paired: median of raw_i / ours_i over neighbouring
        reps (they share the machine's load); best: of the fastest reps. On a loaded machine the
        spread between reps of one write can exceed 3x, hence the many reps of this table.
  +ms:  what ours adds to raw per transfer (median ours - median raw); plan / submit: ours' context-side
        stages (plan_write; the agent's submit_write, which holds the whole copy when the backend does
        it synchronously). The rest of +ms is the request (REQUEST_DATA built, sent over ZeroMQ, handed
        from the listener to the executor) and the notification's way back.
  gf:   generation_first: the gen's REQUEST_DATA already waits at the ctx (parked), which then offers;
        from the offer (the ctx's clock: CLOCK_MONOTONIC, shared by both processes) until the gen's
        status reports the KV. The request over ZeroMQ is off this path; the plan and the
        notification are on it.
Table 2 (tp1 -> tp3, NHD: one fragment per layer, K/V and token per gen rank), direct vs bounce,
  with the per-request stages of the transceiver (plan, gather, submit on ctx; scatter on gen) and
  the descriptors one request writes (descs/req, all gen ranks). Bounce gathers on the pool's device:
  host memory here, GPU memory with --device cuda (kv_transfer/bounce.py).
Table 3 (tp1 -> tp1, HND contiguous, and tp1 -> tp3 NHD), checksum off vs on (integrity.py): the
  same transfer with a CRC32 per block digested on ctx and checked on gen, reps alternating off / on;
  the checksum stage seconds are summed over both sides.
--trace adds, under each row of table 1, where context_first's time goes, stage by stage (kv_trace.py).
The load average is printed with each table: absolute figures on a shared machine are noisy.
--device cuda puts every pool in GPU memory (VRAM -> VRAM over NIXL, both processes on device 0);
the copy column is then a device-to-device torch copy. Checksums read host memory, so with cuda the
checksum table does not run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import statistics
import tempfile
import time

import numpy as np

import kv_trace
from pdserve.kv_transfer.agents import make_agent
from pdserve.kv_transfer.agents.base import MemoryRegion
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.write_plan import plan_write
from pdserve.kv_transfer.transceiver import KVTransceiver, TransceiverConfig

LAYERS, HEADS, HEAD_DIM, TPB = 30, 3, 64, 16
DTYPES = {"fp32": 4, "bf16": 2, "fp8": 1}  # fp8: kv_cache_dtype fp8_e4m3, half a bf16 cache's bytes
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # RankInfo.kv_dtype
STAGES = ("plan", "gather", "submit", "scatter", "checksum")
_STEP_S = 60.0  # longest wait for one queue message inside a case; the case timeout bounds the total


def kv_bytes(tokens: int, elt: int) -> int:
    return LAYERS * 2 * HEADS * HEAD_DIM * elt * (-(-tokens // TPB)) * TPB


def poll_s(agent) -> float:
    """The raw path's polling cadence: the transceiver's for NIXL (completion_poll_s), 0.1 ms for agents
    that would wake a transceiver instead."""
    return agent.completion_poll_s or 0.0001


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


class DevicePool:
    """A pool in GPU memory with the face of a SharedBuffer that build() and ctx_main use."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.ptr, self.nbytes = self.tensor.data_ptr(), nbytes
        self.region = MemoryRegion(self.ptr, nbytes, device_id=self.tensor.device.index or 0)

    def fill_random(self) -> None:
        import torch

        self.tensor.copy_(torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()


def make_pool(nbytes: int, device: str):
    if device == "cuda":
        return DevicePool(nbytes)
    pool = allocate_shared(nbytes)
    pool.numpy()[:] = 0  # fault the pages in now, not inside the first timed write
    return pool


def build(name: str, tp: int, blocks: int, elt: int, layout: str, backend: str, bounce, checksum: bool = False,
          nixl_delay: int | None = None, device: str = "cpu", kv_dtype: str = "unspecified") -> list:
    """One instance in this process: [(transceiver, pool)] per TP rank, pools pre-touched."""
    ranks, infos = [], []
    heads = max(1, HEADS // tp)
    for tp_rank in range(tp):
        pool = make_pool(blocks * LAYERS * 2 * heads * TPB * HEAD_DIM * elt, device)
        agent = make_agent(backend, f"bench-{name}-{tp_rank}-{os.getpid()}", nixl_progress_delay_us=nixl_delay)
        agent.register_memory(pool.region)
        tx = KVTransceiver(agent, TransceiverConfig(kv_transfer_timeout_ms=600_000, bounce=bounce, checksum=checksum))
        table = page_table_for_block_major_pool(pool.ptr, blocks, LAYERS, heads, TPB, HEAD_DIM, elt,
                                                MapperKind[layout], range(LAYERS))
        infos.append(RankInfo(name, tp_rank, tp, tp_rank, 1, 0, 1, 0, 1, 0, (LAYERS,), HEADS, heads, HEAD_DIM, elt,
                              TPB, table, tx.local_descriptor(), tx.endpoint, kv_dtype=kv_dtype))
        ranks.append((tx, pool))
    for (tx, _), info in zip(ranks, infos):
        tx.start(info, infos)
    return ranks, infos


def ctx_main(case: dict, inbox, outbox) -> None:
    """Context instance (tp1). Commands: ("offer", rid, n_blocks, parked) -> serve it (parked: once the
    gen's REQUEST_DATA waits for it), answer ("offered", rid, offer time) and ("served", stage seconds,
    stats); ("raw", gen RankInfo bytes list) -> ("raw", seconds); None -> exit."""
    if case.get("trace_dir"):
        kv_trace.install(case["trace_dir"], "ctx")
    blocks = -(-case["tokens"] // TPB)
    ranks, infos = build("ctx", 1, blocks, case["elt"], case["layout"], case["backend"], case["bounce"],
                         case.get("checksum", False), case.get("nixl_delay"), case.get("device", "cpu"),
                         case.get("kv_dtype", "unspecified"))
    tx, pool = ranks[0]
    if isinstance(pool, DevicePool):
        pool.fill_random()
    else:
        pool.numpy()[:] = np.random.default_rng(0).integers(0, 255, pool.nbytes, dtype=np.uint8)
    outbox.put(tx.endpoint)
    while True:
        cmd = inbox.get(timeout=_STEP_S)
        if cmd is None:
            tx.close()
            tx.agent.shutdown()
            return
        if cmd[0] == "offer":
            _, rid, n, parked = cmd
            while parked and rid not in tx.parked_requests:  # generation_first: its REQUEST_DATA came first
                tx.poll_control()
                if rid not in tx.parked_requests:
                    tx.wait(_STEP_S)
            before, before_stats = dict(tx.stage_seconds), dict(tx.stats)
            t_offer = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the gen process's
            tx.respond_and_send_async(rid, {0: np.arange(n, dtype=np.int64)})
            outbox.put(("offered", rid, t_offer))
            while tx.has_inflight_transfer():
                res = tx.check_context_transfer_status(at_least=1)
                if res.failed:
                    raise RuntimeError(f"ctx: transfer failed: {res.failed}")
            outbox.put(("served", {k: tx.stage_seconds[k] - before[k] for k in STAGES},
                        {k: v - before_stats[k] for k, v in tx.stats.items()}))
        elif cmd[0] == "raw":
            ids = {0: np.arange(blocks, dtype=np.int64)}
            times = []
            for gen_bytes in cmd[1]:
                gen = RankInfo.from_bytes(gen_bytes)
                plan = plan_write(infos[0], gen, ids, ids)
                remote = tx.agent.load_remote(gen.agent_descriptor)  # already loaded: a dict hit
                t0 = time.perf_counter()
                handle = tx.agent.submit_write(remote, plan.src_ptrs, plan.dst_ptrs, plan.sizes, b"raw")
                while tx.agent.poll(handle).value == "in_progress":
                    time.sleep(poll_s(tx.agent))  # the library's cadence; see the module docstring
                times.append(time.perf_counter() - t0)
                tx.agent.release(handle)
            outbox.put(("raw", sum(times), len(plan)))


def gen_main(case: dict, results) -> None:
    """Generation instance: drives the ctx process and reports per-rep timings to `results`."""
    if case.get("trace_dir"):
        kv_trace.install(case["trace_dir"], "gen")
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    ctx = spawn.Process(target=ctx_main, args=(case, inbox, outbox), daemon=True)
    ctx.start()
    results.put(("pid", ctx.pid))
    try:
        blocks = -(-case["tokens"] // TPB)
        gen, infos = build("gen", case["gen_tp"], blocks, case["elt"], case["layout"], case["backend"], case["bounce"],
                           case.get("checksum", False), case.get("nixl_delay"), case.get("device", "cpu"),
                           case.get("kv_dtype", "unspecified"))
        endpoint = outbox.get(timeout=_STEP_S)
        seen = {"scatter": 0.0, "checksum": 0.0}  # gen-side stage seconds attributed to earlier requests

        def ours(rid: int, n: int, gen_first: bool = False) -> tuple[float, dict, dict]:
            """context_first: from our REQUEST_DATA to the KV in place (the ctx offered before).
            gen_first: our REQUEST_DATA waits at the ctx, which offers; from its offer to the KV in place."""
            ids = {0: np.arange(n, dtype=np.int64)}
            if not gen_first:
                inbox.put(("offer", rid, n, False))
                assert outbox.get(timeout=_STEP_S)[:2] == ("offered", rid)
            t0 = time.perf_counter()
            for tx, _ in gen:
                tx.request_and_receive_async(rid, endpoint, ids, (0, n * TPB))
            if gen_first:
                inbox.put(("offer", rid, n, True))
            for tx, _ in gen:
                res = tx.check_gen_transfer_status(at_least=1)
                if res.failed or res.completed != [rid]:
                    raise RuntimeError(f"gen: transfer of {rid} failed: {res}")
            t_end = time.perf_counter()
            elapsed = t_end - (outbox.get(timeout=_STEP_S)[2] if gen_first else t0)
            _, stages, stats = outbox.get(timeout=_STEP_S)
            for stage in seen:  # add the gen side's share of these stages
                total = sum(tx.stage_seconds[stage] for tx, _ in gen)
                stages[stage] += total - seen[stage]
                seen[stage] = total
            return elapsed, stages, stats

        def raw() -> tuple[float, int]:
            inbox.put(("raw", [i.to_bytes() for i in infos]))
            # The receivers poll their agents meanwhile, at the transceiver's cadence, as they do
            # during ours: UCX's rendezvous progresses on both sides alike. Consuming the raw
            # notification here also keeps it from the transceiver.
            pending, deadline = set(range(len(gen))), time.monotonic() + _STEP_S
            while pending:
                pending = {i for i in pending if not gen[i][0].agent.get_notifications()}
                if time.monotonic() > deadline:
                    raise RuntimeError("raw write's notification never arrived")
                time.sleep(poll_s(gen[0][0].agent))
            _, seconds, frags = outbox.get(timeout=_STEP_S)
            return seconds, frags

        # Warm-up: RankInfo exchange, connections, staging pages. The direct NHD case warms up on a
        # bounce-gate-sized prefix only (a full one takes as long as a rep and adds nothing cold).
        ours(0, blocks if case["warm_full"] else min(blocks, 96))
        if case["raw"]:
            raw()
        deadline = time.monotonic() + case["budget_s"]
        for rep in range(1, case["reps"] + 1):
            if case["raw"]:
                seconds, frags = raw()
                results.put(("raw", seconds, frags))
            elapsed, stages, stats = ours(rep, blocks)
            results.put(("ours", elapsed, stages, stats))
            if case.get("gen_first"):
                results.put(("gen_first", ours(100_000 + rep, blocks, gen_first=True)[0]))
            if time.monotonic() > deadline:
                break  # keep the reps we have rather than overrun the case timeout
        inbox.put(None)
        ctx.join(_STEP_S)
        for tx, _ in gen:
            tx.close()
            tx.agent.shutdown()
        results.put(("end",))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if ctx.is_alive():
            ctx.kill()


def run_case(case: dict, timeout_s: float) -> dict:
    """Run one case in fresh processes; {"ours": [...], "raw": [...], "stages": [...], "status": ...}."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    case = dict(case, budget_s=timeout_s / 2)
    proc = spawn.Process(target=gen_main, args=(case, results))
    proc.start()
    out = {"ours": [], "raw": [], "gen_first": [], "frags_raw": 0, "stages": [], "stats": {}, "status": "timeout"}
    pids = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                msg = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() >= deadline or not proc.is_alive():
                    out["status"] = "timeout" if proc.is_alive() else "died"
                    break
                continue
            if msg[0] == "pid":
                pids.append(msg[1])
            elif msg[0] == "raw":
                out["raw"].append(msg[1])
                out["frags_raw"] = msg[2]
            elif msg[0] == "gen_first":
                out["gen_first"].append(msg[1])
            elif msg[0] == "ours":
                out["ours"].append(msg[1])
                out["stages"].append(msg[2])
                out["stats"] = msg[3]
            elif msg[0] == "error":
                out["status"] = "error: " + msg[1]
                break
            else:
                out["status"] = "ok"
                break
    finally:
        if out["status"] != "ok":
            for pid in pids:  # the ctx process first: it would outlive a killed gen process
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return out


def torch_copy_s(nbytes: int, reps: int, device: str = "cpu") -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, scale: float = 1.0, width: int = 9, digits: int = 2) -> str:
    return f"{'-':>{width}}" if x is None else f"{x * scale:>{width}.{digits}f}"


def contiguous_table(args) -> None:
    print(f"tp1 -> tp1 (HND, contiguous)   [{load()}]")
    print(f"{'dtype':>5} {'tokens':>6} {'MiB':>7} {'descs':>7} {'reps':>4} {'ours ms':>9} {'raw ms':>9} "
          f"{'ours GB/s':>9} {'raw GB/s':>9} {'copy GB/s':>9} {'ours/raw':>8} {'paired':>6} {'best':>5} "
          f"{'+ms':>6} {'gf ms':>7} {'gf/raw':>6} {'gf +ms':>6} {'plan ms':>7} {'submit ms':>9}  status")
    for dtype in args.dtypes:
        for tokens in args.tokens:
            nbytes = kv_bytes(tokens, DTYPES[dtype])
            case = {"tokens": tokens, "elt": DTYPES[dtype], "kv_dtype": TORCH_DTYPES[dtype], "layout": "HND",
                    "gen_tp": 1, "backend": args.backend,
                    "nixl_delay": args.nixl_progress_delay_us, "device": args.device,
                    "bounce": None, "reps": args.contiguous_reps, "raw": True, "warm_full": True, "gen_first": True}
            trace = tempfile.TemporaryDirectory(prefix="kv-trace-") if args.trace else None
            case["trace_dir"] = trace and trace.name
            r = run_case(case, args.case_timeout)
            ours, raw, gf = _median(r["ours"]), _median(r["raw"]), _median(r["gen_first"])
            added = lambda t: None if t is None or raw is None else t - raw  # noqa: E731
            descs = f"{r['stats'].get('fragments_written', 0)}/{r['frags_raw']}"  # ours/raw, per request
            copy = torch_copy_s(nbytes, args.reps, args.device)
            bw = lambda s: None if s is None else nbytes / s / 1e9  # noqa: E731
            ratio = None if ours is None or raw is None else raw / ours
            best = None if ours is None or raw is None else min(r["raw"]) / min(r["ours"])
            paired = _median([a / b for a, b in zip(r["raw"], r["ours"])])
            print(f"{dtype:>5} {tokens:>6} {nbytes / 2**20:>7.1f} {descs:>7} {len(r['ours']):>4} {_fmt(ours, 1e3)} "
                  f"{_fmt(raw, 1e3)} {_fmt(bw(ours))} {_fmt(bw(raw))} {_fmt(bw(copy))} {_fmt(ratio, width=8)} "
                  f"{_fmt(paired, width=6)} {_fmt(best, width=5)} {_fmt(added(ours), 1e3, 6)} {_fmt(gf, 1e3, 7)} "
                  f"{_fmt(None if gf is None or raw is None else raw / gf, width=6)} {_fmt(added(gf), 1e3, 6)} "
                  f"{_fmt(_median([st['plan'] for st in r['stages']]), 1e3, 7, 3)} "
                  f"{_fmt(_median([st['submit'] for st in r['stages']]), 1e3, 9, 3)}  {r['status']}", flush=True)
            if trace is not None:
                print(kv_trace.report(trace.name, args.contiguous_reps), flush=True)
                trace.cleanup()


def nhd_table(args) -> None:
    print(f"\ntp1 -> tp3 (NHD head mismatch: one fragment per layer, K/V and token per gen rank)   [{load()}]")
    print("stages: per request, summed over the 3 gen ranks (plan/gather/submit on ctx, scatter on gen)")
    print(f"{'dtype':>5} {'tokens':>6} {'MiB':>7} {'frags/rank':>10} {'descs/req':>9} {'mode':>6} {'reps':>4} "
          f"{'total ms':>9} "
          + " ".join(f"{s + ' ms':>10}" for s in STAGES[:4]) + f" {'speedup':>7}  status")
    for dtype in args.dtypes:
        for tokens in args.tokens:
            nbytes = kv_bytes(tokens, DTYPES[dtype])
            rows = {}
            skip_direct = args.direct_max_tokens is not None and tokens > args.direct_max_tokens
            for mode in ("bounce",) if skip_direct else ("direct", "bounce"):
                bounce = BounceConfig(staging_bytes=3 * nbytes) if mode == "bounce" else None
                case = {"tokens": tokens, "elt": DTYPES[dtype], "kv_dtype": TORCH_DTYPES[dtype], "layout": "NHD",
                        "gen_tp": 3, "backend": args.backend,
                        "nixl_delay": args.nixl_progress_delay_us, "device": args.device,
                        "bounce": bounce, "reps": args.reps, "raw": False, "warm_full": mode == "bounce"}
                rows[mode] = run_case(case, args.case_timeout)
            direct, bounced = (_median(rows[m]["ours"]) if m in rows else None for m in ("direct", "bounce"))
            for mode, r in rows.items():
                stats = r["stats"]
                writes = stats.get("direct_writes", 0) + stats.get("bounced_writes", 0)
                frags = stats.get("fragments_written", 0) // max(1, writes)
                if mode == "bounce" and stats and not stats.get("bounced_writes"):
                    mode = "gated"  # the bounce gates sent it direct
                speed = direct / bounced if mode == "bounce" and direct and bounced else None
                stages = " ".join(_fmt(_median([s[k] for s in r["stages"]]), 1e3, 10, 1) for k in STAGES[:4])
                descs = stats.get("fragments_written", 0)
                print(f"{dtype:>5} {tokens:>6} {nbytes / 2**20:>7.1f} {frags:>10} {descs:>9} {mode:>6} "
                      f"{len(r['ours']):>4} "
                      f"{_fmt(_median(r['ours']), 1e3, 9, 1)} {stages} {_fmt(speed, width=7)}  {r['status']}",
                      flush=True)


def checksum_table(args) -> None:
    print(f"\nchecksum off vs on (CRC32 per block; stage = digest on ctx + check on gen)   [{load()}]")
    print(f"{'dtype':>5} {'tokens':>6} {'MiB':>7} {'pair':>9} {'reps':>4} {'off ms':>8} {'on ms':>8} {'on/off':>7} "
          f"{'crc ms':>8} {'crc GB/s':>8}  status")
    for dtype in args.dtypes:
        for tokens in args.tokens:
            nbytes = kv_bytes(tokens, DTYPES[dtype])
            for pair, layout, gen_tp in (("tp1->tp1", "HND", 1), ("tp1->tp3", "NHD", 3)):
                rows = {}
                for checksum in (False, True):
                    case = {"tokens": tokens, "elt": DTYPES[dtype], "kv_dtype": TORCH_DTYPES[dtype], "layout": layout,
                            "gen_tp": gen_tp,
                            "backend": args.backend, "nixl_delay": args.nixl_progress_delay_us, "bounce": None,
                            "reps": args.reps, "raw": False, "warm_full": False, "checksum": checksum}
                    rows[checksum] = run_case(case, args.case_timeout)
                off, on = _median(rows[False]["ours"]), _median(rows[True]["ours"])
                crc = _median([st["checksum"] for st in rows[True]["stages"]])
                status = rows[False]["status"] if rows[False]["status"] != "ok" else rows[True]["status"]
                print(f"{dtype:>5} {tokens:>6} {nbytes / 2**20:>7.1f} {pair:>9} {len(rows[True]['ours']):>4} "
                      f"{_fmt(off, 1e3, 8, 1)} {_fmt(on, 1e3, 8, 1)} "
                      f"{_fmt(None if not off or on is None else on / off, width=7)} {_fmt(crc, 1e3, 8, 1)} "
                      f"{_fmt(None if not crc else 2 * nbytes / crc / 1e9, width=8)}  {status}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--backend", default="nixl", choices=["nixl", "shm"])
    parser.add_argument("--nixl-progress-delay-us", type=int, default=None,
                        help="NIXL's progress thread delay (cache_transceiver_config.nixl_progress_delay_us; "
                             "default: pdserve's, 1000; 0: NIXL's own busy loop)")
    parser.add_argument("--reps", type=int, default=5, help="reps of the NHD cases (seconds each when direct)")
    parser.add_argument("--contiguous-reps", type=int, default=21, help="raw/ours rep pairs of the contiguous cases")
    parser.add_argument("--case-timeout", type=float, default=240.0,
                        help="seconds per case (processes started, warm-up, reps); past half of it no new rep starts")
    parser.add_argument("--tables", nargs="+", default=["contiguous", "nhd"], choices=["contiguous", "nhd", "checksum"])
    parser.add_argument("--direct-max-tokens", type=int, default=None,
                        help="NHD table: skip the direct case above this many tokens (default: none on cpu, 512 "
                             "with --device cuda, where a direct case costs seconds (~28 us a descriptor: 2968 ms a "
                             "rep at 2048 tokens) and scripts/gpu_check's KV step has 110 s for every case)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the KV pools live (cuda: VRAM -> VRAM; needs --backend nixl, no checksum table)")
    parser.add_argument("--trace", action="store_true",
                        help="table 1: print where context_first's time goes, stage by stage (kv_trace.py)")
    args = parser.parse_args()
    if args.direct_max_tokens is None and args.device == "cuda":
        args.direct_max_tokens = 512
    if args.device == "cuda" and (args.backend != "nixl" or "checksum" in args.tables):
        parser.error("--device cuda moves VRAM with NIXL only and has no checksum table (CRC32 reads host memory)")
    print(f"backend={args.backend}  device={args.device}  SmolLM2 KV: {LAYERS} layers x {HEADS} KV heads x "
          f"head_dim {HEAD_DIM}, {TPB} tokens/block, medians, {os.cpu_count()} CPUs\n")
    if "contiguous" in args.tables:
        contiguous_table(args)
    if "nhd" in args.tables:
        nhd_table(args)
    if "checksum" in args.tables:
        checksum_table(args)
    print(f"\n[{load()}]")


if __name__ == "__main__":
    main()
