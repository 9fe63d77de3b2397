"""Bounce buffer pieces: gates, staging leases, gather/scatter round trip, corrupt segments."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.agents.base import MemoryRegion, RegionTable
from pdserve.kv_transfer.agents.fake import FakeAgent
from pdserve.kv_transfer.bounce import BounceConfig, StagingBuffer, gather, plan_segment_bytes, scatter
from pdserve.kv_transfer.errors import KVTransferError


def test_gates():
    cfg = BounceConfig()
    small = np.full(2048, 256, np.uint64)
    assert cfg.kv_passes(96, small) and not cfg.kv_passes(95, small)
    assert not cfg.kv_passes(96, small[:1023])  # too few fragments
    assert not cfg.kv_passes(96, np.full(2048, 32 << 10, np.uint64))  # fragments too large on average
    assert cfg.state_passes(np.full(8192, 256, np.uint64)) and not cfg.state_passes(np.full(4096, 256, np.uint64))
    with pytest.raises(ValueError, match="min_kv_blocks"):
        BounceConfig(min_kv_blocks=0)


def test_staging_leases_coalesce():
    agent = FakeAgent()
    staging = StagingBuffer(agent, 1 << 16)
    assert agent.registered_regions == (staging.region,)
    a, b, c = staging.lease(1000), staging.lease(5000), staging.lease(100)
    assert staging.lease(1 << 16) is None
    for lease in (b, a, c):
        staging.release(lease)
    assert staging.free_bytes == 1 << 16 and staging.lease(1 << 16) is not None
    agent.shutdown()


@pytest.mark.parametrize("uniform", [True, False])
def test_gather_scatter_round_trip(uniform):
    agent = FakeAgent()
    staging = StagingBuffer(agent, 1 << 20)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 1 << 30, 1 << 15, dtype=np.int32)
    dst = np.zeros_like(src)
    n = 2000
    sizes = np.full(n, 32, np.uint64) if uniform else rng.integers(1, 9, n).astype(np.uint64) * 4
    slots = rng.permutation(len(src) * 4 // 64)[:n].astype(np.uint64) * 64
    dslots = rng.permutation(len(src) * 4 // 64)[:n].astype(np.uint64) * 64
    lease = staging.lease(plan_segment_bytes(sizes))
    total = gather(lease, src.ctypes.data + slots, dst.ctypes.data + dslots, sizes)
    assert total == plan_segment_bytes(sizes)
    regions = RegionTable([MemoryRegion(dst.ctypes.data, dst.nbytes)])
    assert scatter(lease.ptr, lease.nbytes, regions) == int(sizes.sum())
    s8, d8 = src.view(np.uint8), dst.view(np.uint8)
    for s, d, z in zip(slots.tolist(), dslots.tolist(), sizes.tolist()):
        assert (d8[d:d + z] == s8[s:s + z]).all()
    # A segment pointing outside our KV memory is refused before any byte moves.
    with pytest.raises(KVTransferError, match="outside registered memory"):
        scatter(lease.ptr, lease.nbytes, RegionTable([MemoryRegion(dst.ctypes.data, 64)]))
    staging.release(lease)
    agent.shutdown()


def test_corrupt_segment_is_refused():
    agent = FakeAgent()
    staging = StagingBuffer(agent, 4096)
    lease = staging.lease(4096)
    with pytest.raises(KVTransferError, match="corrupt"):
        scatter(lease.ptr, lease.nbytes, RegionTable([staging.region]))
    agent.shutdown()
