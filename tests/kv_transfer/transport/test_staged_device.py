"""The bounce path on GPU memory: gathers and scatters run on the pool's device (device_rows.py), and a
TP1 -> TP3 NHD request over NIXL VRAM -> VRAM lands byte for byte in one descriptor per gen rank.
The cuda cases need a device (scripts/gpu_check runs `-m cuda`); test_staged_rows.py runs the device
code on CPU tensors, and the cpu case here runs the same request through the host bounce path."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvt_instance import ELT, Topology, ctx_block_ids, expected, gen_block_ids
from pdserve.kv_transfer.agents import MemoryRegion, make_agent
from pdserve.kv_transfer.agents.base import RegionTable
from pdserve.kv_transfer.agents.faults import FaultPlan, FaultyAgent
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.bounce import BounceConfig, StagingLease, gather, plan_segment_bytes, scatter
from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.transceiver import KVTransceiver, TransceiverConfig

def _torch(device: str = "cuda"):
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch


@pytest.mark.cuda
def test_a_segment_is_gathered_and_scattered_on_the_gpu():
    torch = _torch()
    dev = torch.device("cuda:0")
    n, size, pitch = 30 * 2 * 512, 128, 384  # NHD tp1 -> tp3 at 512 tokens: one head of three per row
    pool = torch.randint(0, 255, (n * pitch,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(n * size, dtype=torch.uint8, device=dev)
    src_ptrs = pool.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(pitch) + np.uint64(size)
    dst_ptrs = dst.data_ptr() + np.arange(n, dtype=np.uint64)[::-1].copy() * np.uint64(size)
    sizes = np.full(n, size, np.uint64)
    staging = torch.empty(plan_segment_bytes(sizes), dtype=torch.uint8, device=dev)
    lease = StagingLease(staging.data_ptr(), staging.numel())
    assert gather(lease, src_ptrs, dst_ptrs, sizes, "cuda:0") == plan_segment_bytes(sizes)
    regions = RegionTable([MemoryRegion.of_tensor(dst)])
    assert scatter(lease.ptr, lease.nbytes, regions, "cuda:0") == n * size
    want = pool.view(n, pitch)[:, size:2 * size].flip(0).reshape(-1)
    assert torch.equal(dst, want)


def _instance(name: str, tp: int, num_blocks: int, bounce: BounceConfig, torch, device: str,
              checksum: bool = False, faults: FaultPlan | None = None) -> list:
    """Every rank of a 3-head NHD instance in this process, its pool a tensor on `device` (cpu: shared
    memory and the shm agent; cuda: GPU memory and NIXL)."""
    layers, tpb, head_dim, heads = 4, 4, 8, 3 // tp
    ranks, infos = [], []
    for r in range(tp):
        nbytes = num_blocks * layers * 2 * heads * tpb * head_dim * ELT
        if device == "cuda":
            pool, agent = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0"), make_agent("nixl")
        else:
            shared = allocate_shared(nbytes)  # kept alive by the tensor's numpy base
            pool, agent = shared.torch(), make_agent("shm")
            _KEEP.append(shared)
        if faults is not None:
            agent = FaultyAgent(agent, faults)
        agent.register_memory(MemoryRegion.of_tensor(pool))
        tx = KVTransceiver(agent, TransceiverConfig(kv_transfer_timeout_ms=30_000, bounce=bounce,
                                                    checksum=checksum and device != "cuda"))
        if device == "cpu-rows":
            tx._bouncer.device = "cpu"  # host memory through the device path's torch copies
        table = page_table_for_block_major_pool(pool.data_ptr(), num_blocks, layers, heads, tpb, head_dim, ELT,
                                                MapperKind.NHD, range(layers))
        infos.append(RankInfo(name, r, tp, r, 1, 0, 1, 0, 1, 0, (layers,), 3, heads, head_dim, ELT, tpb, table,
                              tx.local_descriptor(), tx.endpoint))
        ranks.append((tx, pool))
    for (tx, _), info in zip(ranks, infos):
        tx.start(info, infos)
    return [(tx, pool, info) for (tx, pool), info in zip(ranks, infos)]


_KEEP: list = []  # shared buffers of the cpu case: the shm agent needs them registered and mapped


class _Info:
    def __init__(self, info: RankInfo) -> None:
        self.info = info


@pytest.mark.parametrize("device", ["cpu", "cpu-rows", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_tp1_to_tp3_nhd_is_byte_exact_in_one_descriptor_per_rank(device):
    """On cuda the gather and the scatter run on the GPU (the staging buffer is GPU memory); on cpu the
    same request takes the host bounce path, and on cpu-rows the device path's torch copies over host
    memory (what cuda runs, minus the GPU)."""
    torch = _torch(device)
    bounce = BounceConfig(staging_bytes=8 << 20, min_kv_blocks=8, min_fragments=64)
    # Checksums on (host memory only): the receiver digests what the scatter left against the sender's.
    ctx = _instance("ctx", 1, 32, bounce, torch, device, checksum=True)
    gen = _instance("gen", 3, 32, bounce, torch, device, checksum=True)
    try:
        num_tokens = 52
        ids_c = ctx_block_ids(Topology("ctx"), num_tokens)
        ids_g = gen_block_ids(Topology("gen", num_blocks=32), num_tokens)
        tx_c, pool_c, info_c = ctx[0]
        want_c = expected(_Info(info_c), len(ids_c))  # [blocks, layers, 2, T, H, D] int32 (NHD)
        pool_c.view(torch.int32).view(32, *want_c.shape[1:])[torch.from_numpy(ids_c).to(pool_c.device)] = \
            torch.from_numpy(want_c).to(pool_c.device)
        tx_c.respond_and_send_async(7, {0: ids_c})
        for tx, _, _ in gen:
            tx.request_and_receive_async(7, tx_c.endpoint, {0: ids_g})
        done, deadline = set(), time.monotonic() + 60
        while len(done) < len(gen) and time.monotonic() < deadline:
            tx_c.check_context_transfer_status()
            for i, (tx, _, _) in enumerate(gen):
                res = tx.check_gen_transfer_status()
                assert not res.failed, res.failed
                done |= {i} if res.completed == [7] else set()
        assert len(done) == len(gen), "the staged writes did not land"
        assert tx_c.stats["bounced_writes"] == 3 and tx_c.stats["fragments_written"] == 3
        for tx, pool, info in gen:
            want = expected(_Info(info), len(ids_g))
            got = pool.view(torch.int32).view(32, *want.shape[1:])[torch.from_numpy(ids_g).to(pool.device)]
            assert np.array_equal(got.cpu().numpy(), want)
    finally:
        for tx, _, _ in ctx + gen:
            tx.close()
            tx.agent.shutdown()
        _KEEP.clear()


def test_an_intact_pair_on_a_device_leases_no_staging():
    """Same heads on both sides: a few large runs, which never bounce, so the receiver on a device
    offers no staging segment (device memory held for nothing) and the write goes direct."""
    torch = _torch("cpu")
    bounce = BounceConfig(staging_bytes=8 << 20, min_kv_blocks=8, min_fragments=64)
    ctx, gen = _instance("ctx", 1, 32, bounce, torch, "cpu-rows"), _instance("gen", 1, 32, bounce, torch, "cpu-rows")
    try:
        (tx_c, _, _), (tx_g, _, _) = ctx[0], gen[0]
        ids = np.arange(13, dtype=np.int64)
        tx_c.respond_and_send_async(7, {0: ids})
        tx_g.request_and_receive_async(7, tx_c.endpoint, {0: ids})
        assert tx_g.recv_sessions[7].staging is None
        deadline = time.monotonic() + 30
        while tx_g.recv_sessions and time.monotonic() < deadline:
            tx_c.check_context_transfer_status()
            assert not tx_g.check_gen_transfer_status().failed
        assert not tx_g.recv_sessions and tx_c.stats["direct_writes"] == 1 and tx_c.stats["bounced_writes"] == 0
    finally:
        for tx, _, _ in ctx + gen:
            tx.close()
            tx.agent.shutdown()
        _KEEP.clear()


@pytest.mark.parametrize("device", ["cpu", "cpu-rows"])
def test_a_corrupted_staged_write_fails_and_writes_nothing_wrong_silently(device):
    """One byte of the staged write inverted in transit (header, table or payload): the receiver refuses
    the segment or its checksum does not match; the request fails, never lands as good KV."""
    torch = _torch("cpu")
    bounce = BounceConfig(staging_bytes=8 << 20, min_kv_blocks=8, min_fragments=64)
    ctx = _instance("ctx", 1, 32, bounce, torch, device, checksum=True, faults=FaultPlan(corrupt_rate=1.0, seed=3))
    gen = _instance("gen", 3, 32, bounce, torch, device, checksum=True)
    try:
        ids = np.arange(13, dtype=np.int64)
        tx_c = ctx[0][0]
        tx_c.respond_and_send_async(7, {0: ids})
        for tx, _, _ in gen:
            tx.request_and_receive_async(7, tx_c.endpoint, {0: ids})
        failed, done, deadline = {}, set(), time.monotonic() + 30
        while len(failed) + len(done) < len(gen) and time.monotonic() < deadline:
            tx_c.check_context_transfer_status()
            for i, (tx, _, _) in enumerate(gen):
                res = tx.check_gen_transfer_status()
                failed.update({i: res.failed[7]} if 7 in res.failed else {})
                done |= {i} if res.completed == [7] else set()
        assert not done and len(failed) == len(gen), (done, failed)
        assert tx_c.agent.injected["corrupted_writes"] == 3 and tx_c.stats["bounced_writes"] == 3
    finally:
        for tx, _, _ in ctx + gen:
            tx.close()
            tx.agent.shutdown()
        _KEEP.clear()
