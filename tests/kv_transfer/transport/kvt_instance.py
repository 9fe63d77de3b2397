"""Test instances for transceiver tests: every rank of one instance (pool, agent, transceiver) in one
process, with a KV oracle so the receiver can check every byte it got.

Oracle: the int32 at (global layer, K/V, global head, token, d) is
    ((((layer * 2 + kv) * 16 + head) * 1024 + token) * 64 + d)
so a byte landing in the wrong layer, head, token or lane is caught.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.agents import MemoryRegion, make_agent
from pdserve.kv_transfer.agents.faults import FaultPlan, FaultyAgent
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool
from pdserve.kv_transfer.rank_info import RankInfo, flat_rank
from pdserve.kv_transfer.transceiver import KVTransceiver, TransceiverConfig

ELT = 4  # int32 oracle values


@dataclass(frozen=True)
class Topology:
    name: str
    tp: int = 1
    pp: int = 1
    layers: int = 4
    heads: int = 2  # the model's unique KV heads
    head_dim: int = 8
    tokens_per_block: int = 4
    layout: str = "HND"
    num_blocks: int = 16


@dataclass
class Rank:
    info: RankInfo
    tx: KVTransceiver
    pool: object  # SharedBuffer

    def kv(self) -> np.ndarray:
        """The pool as [blocks, local layers, 2, H, T, D] (HND) or [blocks, local layers, 2, T, H, D] (NHD)."""
        t = self.info
        lo, hi = t.layer_range
        h, tpb, d = t.kv_heads_per_rank, t.tokens_per_block, t.head_dim
        inner = (h, tpb, d) if t.page_table.mapper_kind is MapperKind.HND else (tpb, h, d)
        return self.pool.numpy(np.int32).reshape(-1, hi - lo, 2, *inner)


def build_instance(topo: Topology, backend: str, timeout_ms: int = 20_000, bounce=None,
                   cluster_token: str | None = None, checksum: bool = False, faults: FaultPlan | None = None,
                   canary_slots: int = 0) -> list[Rank]:
    """Every rank of `topo` in this process. canary_slots > 0 adds that many slots past topo.num_blocks,
    kept for the first-contact canary (canary.py), which then runs when the peer has them too."""
    ranks = []
    per_stage = [topo.layers // topo.pp + (1 if s < topo.layers % topo.pp else 0) for s in range(topo.pp)]
    kv_per_rank = max(1, topo.heads // topo.tp)
    kind = MapperKind[topo.layout]
    for pp_rank in range(topo.pp):
        lo = sum(per_stage[:pp_rank])
        for tp_rank in range(topo.tp):
            rank = flat_rank(pp_rank, tp_rank, 0, topo.tp, 1)
            slot = per_stage[pp_rank] * 2 * kv_per_rank * topo.tokens_per_block * topo.head_dim * ELT
            num_slots = topo.num_blocks + canary_slots
            pool = allocate_shared(num_slots * slot)
            agent = make_agent(backend, f"{topo.name}-{rank}-{backend}-{time.monotonic_ns()}")
            if faults is not None:
                agent = FaultyAgent(agent, faults)
            agent.register_memory(MemoryRegion(pool.ptr, pool.nbytes))
            tx = KVTransceiver(agent, TransceiverConfig(kv_transfer_timeout_ms=timeout_ms, bounce=bounce,
                                                        cluster_token=cluster_token, checksum=checksum))
            table = page_table_for_block_major_pool(
                pool.ptr, num_slots, per_stage[pp_rank], kv_per_rank, topo.tokens_per_block, topo.head_dim,
                ELT, kind, range(lo, lo + per_stage[pp_rank]))
            info = RankInfo(topo.name, rank, topo.tp, tp_rank, topo.pp, pp_rank, 1, 0, 1, 0, tuple(per_stage),
                            topo.heads, kv_per_rank, topo.head_dim, ELT, topo.tokens_per_block, table,
                            tx.local_descriptor(), tx.endpoint, canary_slots)
            ranks.append(Rank(info, tx, pool))
    ranks.sort(key=lambda r: r.info.rank)
    infos = [r.info for r in ranks]
    for r in ranks:
        r.tx.start(r.info, infos)
    return ranks


def shutdown(ranks: list[Rank], proc=None, timeout_s: float = 40.0) -> None:
    """Close every rank's transceiver and agent, then reap `proc` (a peer instance's process), killing it
    if it does not exit in time."""
    for r in ranks:
        r.tx.close()
        r.tx.agent.shutdown()
    if proc is not None:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()


def expected(rank: Rank, num_blocks: int) -> np.ndarray:
    """Oracle values of `num_blocks` consecutive token blocks of this rank, in its pool layout."""
    t = rank.info
    lo, hi = t.layer_range
    h0, h1 = t.head_range
    tpb = t.tokens_per_block
    blk = np.arange(num_blocks)[:, None, None, None, None, None]
    layer = np.arange(lo, hi)[None, :, None, None, None, None]
    kv = np.arange(2)[None, None, :, None, None, None]
    head = np.arange(h0, h1)
    tok = np.arange(tpb)
    d = np.arange(t.head_dim)[None, None, None, None, None, :]
    if t.page_table.mapper_kind is MapperKind.HND:
        head, tok = head[None, None, None, :, None, None], tok[None, None, None, None, :, None]
    else:
        head, tok = head[None, None, None, None, :, None], tok[None, None, None, :, None, None]
    token = blk * tpb + tok
    return ((((layer * 2 + kv) * 16 + head) * 1024 + token) * 64 + d).astype(np.int32)


def fill(rank: Rank, block_ids: np.ndarray) -> None:
    rank.kv()[block_ids] = expected(rank, len(block_ids))


def mismatches(rank: Rank, block_ids: np.ndarray, num_tokens: int) -> int:
    """Wrong int32 values in the first `num_tokens` tokens of the request's blocks."""
    got = rank.kv()[block_ids]
    want = expected(rank, len(block_ids))
    tpb = rank.info.tokens_per_block
    token_axis = 4 if rank.info.page_table.mapper_kind is MapperKind.HND else 3
    tokens = (np.arange(len(block_ids))[:, None] * tpb + np.arange(tpb)[None, :])
    shape = [len(block_ids), 1, 1, 1, 1, 1]
    shape[token_axis] = tpb
    valid = (tokens < num_tokens).reshape(shape)
    return int(((got != want) & valid).sum())


def ctx_block_ids(topo: Topology, num_tokens: int) -> np.ndarray:
    n = -(-num_tokens // topo.tokens_per_block)
    return np.arange(n, dtype=np.int64) * 2 + 1  # odd blocks: non-contiguous on purpose


def gen_block_ids(topo: Topology, num_tokens: int) -> np.ndarray:
    n = -(-num_tokens // topo.tokens_per_block)
    return np.arange(topo.num_blocks - 1, topo.num_blocks - 1 - n, -1, dtype=np.int64)  # reversed


def offer_and_ask(ctx: list[Rank], gen: list[Rank], rid: int, num_tokens: int) -> np.ndarray:
    """Offer `rid` on every ctx rank (its blocks filled with the oracle) and ask for it on every gen rank;
    the gen block ids it will land in."""
    ids_c = ctx_block_ids(Topology("ctx", tokens_per_block=ctx[0].info.tokens_per_block), num_tokens)
    ids_g = gen_block_ids(Topology("gen", tokens_per_block=gen[0].info.tokens_per_block), num_tokens)
    for r in ctx:
        fill(r, ids_c)
        r.tx.respond_and_send_async(rid, {0: ids_c})
    for r in gen:
        r.tx.request_and_receive_async(rid, ctx[0].tx.endpoint, {0: ids_g})
    return ids_g


def pump_until(ranks: list[Rank], side: str, count: int, timeout_s: float, also: list[Rank] = ()) -> dict:
    """Poll every rank until each reported `count` finished sessions; returns per-rank results.
    `also`: ranks of the other side living in this process, polled too so they make progress."""
    done = {r.info.rank: ([], {}) for r in ranks}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in also:
            r.tx.check_context_transfer_status() if side == "gen" else r.tx.check_gen_transfer_status()
        for r in ranks:
            check = r.tx.check_context_transfer_status if side == "ctx" else r.tx.check_gen_transfer_status
            res = check()
            done[r.info.rank][0].extend(res.completed)
            done[r.info.rank][1].update(res.failed)
        if all(len(c) + len(f) >= count for c, f in done.values()):
            return done
        time.sleep(0.001)
    raise TimeoutError(f"{side} sessions still in flight after {timeout_s} s: {done}")


def run_ctx_instance(topo: Topology, backend: str, requests: dict, outbox, inbox, respond_delay_s: float = 0.0,
                     timeout_s: float = 30.0, bounce=None) -> None:
    """Child process: a context instance that prefills (fills the oracle) and serves `requests`
    (request id -> num_tokens), then reports its outcome and leftover state."""
    ranks = build_instance(topo, backend, bounce=bounce)
    outbox.put(ranks[0].tx.endpoint)
    for r in ranks:
        for rid, num_tokens in requests.items():
            fill(r, ctx_block_ids(topo, num_tokens))
    time.sleep(respond_delay_s)
    for rid, num_tokens in requests.items():
        for r in ranks:
            r.tx.respond_and_send_async(rid, {0: ctx_block_ids(topo, num_tokens)})
    results = pump_until(ranks, "ctx", len(requests), timeout_s)
    leftovers = sum(len(r.tx.send_sessions) + len(r.tx.parked_requests) for r in ranks)
    outbox.put((results, leftovers, [r.tx.stats for r in ranks]))
    inbox.get(timeout=timeout_s)  # keep memory mapped until the receiver has checked
    shutdown(ranks)
