"""The device bounce path (device_rows.py, bounce.gather/scatter with a device): the same torch code
that runs on a GPU pool, run here on CPU tensors, byte for byte against the host path and the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kv_transfer import device_rows
from pdserve.kv_transfer.agents.base import MemoryRegion, RegionTable
from pdserve.kv_transfer.agents.fake import FakeAgent
from pdserve.kv_transfer.bounce import StagingBuffer, gather, plan_segment_bytes, scatter
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.page_table import MapperKind
from pdserve.testing import kv_oracle as oracle

CPU = torch.device("cpu")


@pytest.mark.parametrize("offsets, size", [
    ([0, 384, 768, 1536, 2304], 128),  # the NHD shape: rows of a 384-byte pitch
    ([0, 192, 448, 1024], 128),  # pitch 64 < size: rows of the view overlap, fragments do not
    ([8], 40),  # one fragment: no pitch
])
def test_rows_round_trip(offsets, size):
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 255, 4096, dtype=np.uint8)
    back = np.zeros_like(pool)
    packed = np.zeros(len(offsets) * size, np.uint8)
    src = pool.ctypes.data + np.array(offsets, np.uint64)
    device_rows.gather_rows(packed.ctypes.data, src, size, CPU)
    assert packed.tobytes() == b"".join(pool[o:o + size].tobytes() for o in offsets)
    device_rows.scatter_rows(back.ctypes.data + np.array(offsets, np.uint64), packed.ctypes.data, size, CPU)
    written = np.zeros(4096, bool)
    for o in offsets:
        written[o:o + size] = True
    assert np.array_equal(back[written], pool[written]) and not back[~written].any()


def _plan(rng, n, uniform):
    """n non-overlapping fragments at 64-byte aligned slots of a 1 MiB source and destination."""
    sizes = np.full(n, 128, np.uint64) if uniform else rng.choice([64, 128, 192], n).astype(np.uint64)
    slots = (1 << 20) // 256
    return (rng.permutation(slots)[:n].astype(np.uint64) * 256, rng.permutation(slots)[:n].astype(np.uint64) * 256,
            sizes)


@pytest.mark.parametrize("uniform", [True, False])
def test_a_device_segment_lands_like_a_host_one(uniform):
    """gather/scatter through the device path (torch, here on CPU) leave the same bytes as the host
    path; fragments of several sizes are laid out as one packed run per size."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 255, 1 << 20, dtype=np.uint8)
    agent = FakeAgent()
    staging = StagingBuffer(agent, 1 << 21)
    s_off, d_off, sizes = _plan(rng, 3000, uniform)
    outs = []
    for device in (None, "cpu"):
        dst = np.zeros(1 << 20, np.uint8)
        lease = staging.lease(plan_segment_bytes(sizes))
        assert gather(lease, src.ctypes.data + s_off, dst.ctypes.data + d_off, sizes, device) == \
            plan_segment_bytes(sizes)
        regions = RegionTable([MemoryRegion(dst.ctypes.data, dst.nbytes)])
        assert scatter(lease.ptr, lease.nbytes, regions, device) == int(sizes.sum())
        with pytest.raises(KVTransferError, match="outside registered memory"):  # checked before any copy
            scatter(lease.ptr, lease.nbytes, RegionTable([MemoryRegion(dst.ctypes.data, 64)]), device)
        staging.release(lease)
        outs.append(dst)
    for s, d, z in zip(s_off.tolist(), d_off.tolist(), sizes.tolist()):
        assert outs[1][d:d + z].tobytes() == src[s:s + z].tobytes()
    assert np.array_equal(outs[0], outs[1])
    agent.shutdown()


def test_a_corrupt_device_segment_is_refused():
    agent = FakeAgent()
    staging = StagingBuffer(agent, 1 << 16)
    lease = staging.lease(4096)
    with pytest.raises(KVTransferError, match="corrupt"):
        scatter(lease.ptr, lease.nbytes, RegionTable([staging.region]), "cpu")
    agent.shutdown()


def _staged_copy(plan) -> None:
    """One write the way the device bounce path makes it: gather into a segment, scatter from it."""
    segment = np.zeros(plan_segment_bytes(plan.sizes) + 64, np.uint8)
    ptr = -(-segment.ctypes.data // 64) * 64
    lease = type("Lease", (), {"ptr": ptr, "nbytes": plan_segment_bytes(plan.sizes)})()
    gather(lease, plan.src_ptrs, plan.dst_ptrs, plan.sizes, "cpu")
    lo, hi = int(plan.dst_ptrs.min()), int((plan.dst_ptrs + plan.sizes).max())
    span = RegionTable([MemoryRegion(lo, hi - lo)])
    scatter(ptr, lease.nbytes, span, "cpu")


@pytest.mark.parametrize("layout, ctx_tp, gen_tp", [("NHD", 1, 4), ("NHD", 4, 2), ("HND", 1, 2)])
def test_staged_head_mismatch_is_byte_exact_in_the_oracle(layout, ctx_tp, gen_tp):
    """TP head mismatch through the staged path: every gen rank holds its exact re-cut KV, and bytes
    outside the transfer keep their sentinel (the oracle's write-once check)."""
    model = oracle.ModelShape(num_layers=3, total_kv_heads=4, head_dim=8)
    ctx = oracle.make_instance("ctx", oracle.Topology(tp=ctx_tp, layout=MapperKind[layout]), model)
    gen = oracle.make_instance("gen", oracle.Topology(tp=gen_tp, layout=MapperKind[layout]), model, fill=0xAB)
    ids = lambda info: {0: np.arange(5, dtype=np.int64)}  # noqa: E731
    report = oracle.simulate_transfer(ctx, gen, model, 5 * 16, ids, ids, copy=_staged_copy)
    assert report.writers


def test_on_a_device_only_the_shape_gate_applies():
    """A GPU write pays per descriptor (tens of microseconds each), so a short prompt's many small
    fragments are staged too; on the host the block gate keeps short prompts direct."""
    from pdserve.kv_transfer.bounce import BounceConfig

    cfg, nhd = BounceConfig(), np.full(30 * 2 * 64, 128, np.uint64)  # 64 tokens: 4 blocks of 16
    assert not cfg.kv_passes(4, nhd) and cfg.kv_passes(4, nhd, on_device=True)
    assert not cfg.kv_passes(4, np.full(60, 4096, np.uint64), on_device=True)  # few fragments: direct
