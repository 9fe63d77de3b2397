"""Instances built from arith's test topologies (pdserve.testing.kv_oracle) over shareable memory,
for transceiver tests of the harder layouts: layer-major pools, several layer groups, PP x TP mixes,
tokens_per_block mismatch. The KV oracle is testing.logical_kv (seeded, so both processes agree)."""

from __future__ import annotations

import time

import numpy as np

from pdserve.testing import kv_oracle as sim
from pdserve.kv_transfer.agents import MemoryRegion, make_agent
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.transceiver import KVTransceiver, TransceiverConfig


def build(name: str, topo: sim.Topology, model: sim.ModelShape, backend: str):
    ranks = []
    for r in range(topo.world_size):
        buffers = [allocate_shared(n) for n in sim.pool_sizes(topo, model, r)]
        agent = make_agent(backend, f"{name}-{r}-{time.monotonic_ns()}")
        for b in buffers:
            agent.register_memory(MemoryRegion(b.ptr, b.nbytes))
        tx = KVTransceiver(agent, TransceiverConfig(kv_transfer_timeout_ms=20_000))
        info = sim.make_rank_info(name, topo, model, r, [b.ptr for b in buffers], tx.local_descriptor(), tx.endpoint)
        ranks.append((sim.SimRank(info, [b.numpy() for b in buffers]), tx, buffers))
    infos = [s.info for s, _, _ in ranks]
    for s, tx, _ in ranks:
        tx.start(s.info, infos)
    return ranks


def block_ids(topo: sim.Topology, model: sim.ModelShape, num_tokens: int, reverse: bool) -> dict:
    n = -(-num_tokens // topo.tokens_per_block)
    ids = np.arange(n, dtype=np.int64)
    ids = topo.num_blocks - 1 - ids if reverse else ids
    return {g: ids for g in range(model.num_layer_groups)}


def held(rank: sim.SimRank, kv: np.ndarray) -> np.ndarray:
    """The part of the logical KV this rank stores (zeros elsewhere), as gather_logical_kv returns."""
    out = np.zeros_like(kv)
    h0, h1 = rank.info.head_range
    layers = rank.info.page_table.global_layer_ids
    out[layers, :, h0:h1] = kv[layers, :, h0:h1]
    return out


def pump(txs, ctx_side: bool, count: int, timeout_s: float) -> list:
    got = [[] for _ in txs]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(len(g) < count for g in got):
        for i, tx in enumerate(txs):
            res = tx.check_context_transfer_status() if ctx_side else tx.check_gen_transfer_status()
            got[i] += res.completed + [("failed", k, v) for k, v in res.failed.items()]
        time.sleep(0.001)
    return got


def run_ctx(topo, model, backend, num_tokens, outbox, inbox, timeout_s: float = 30.0) -> None:
    """Child process: scatter the logical KV into every ctx rank, serve request 1, report, wait."""
    ranks = build("ctx", topo, model, backend)
    kv = sim.logical_kv(model, num_tokens)
    ids = block_ids(topo, model, num_tokens, reverse=False)
    for s, tx, _ in ranks:
        sim.scatter_logical_kv(s, kv, ids, num_tokens)
        tx.respond_and_send_async(1, ids)
    outbox.put(ranks[0][1].endpoint)
    outbox.put(pump([tx for _, tx, _ in ranks], True, 1, timeout_s))
    inbox.get(timeout=timeout_s)
    for _, tx, _ in ranks:
        tx.close()
        tx.agent.shutdown()
