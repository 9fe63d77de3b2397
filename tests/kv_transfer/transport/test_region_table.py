"""RegionTable.locate: the one-region fast path and the per-fragment search agree, and both refuse."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.agents.base import MemoryRegion, RegionTable, TransferAgentError

A, B = MemoryRegion(0x10000, 0x1000), MemoryRegion(0x20000, 0x1000)


def test_fragments_in_one_region_take_the_fast_path():
    table = RegionTable([B, A])
    ptrs = np.arange(0x20000, 0x21000, 0x100, dtype=np.uint64)
    assert table.locate(ptrs, np.uint64(0x100), "x").tolist() == [1] * 16  # scalar size
    assert table.locate(ptrs, np.full(16, 0x100, np.uint64), "x").tolist() == [1] * 16


def test_fragments_across_regions_are_located_one_by_one():
    table = RegionTable([A, B])
    ptrs = np.array([0x20f00, 0x10000, 0x10800], np.uint64)
    assert table.locate(ptrs, np.array([0x100, 0x800, 0x800], np.uint64), "x").tolist() == [1, 0, 0]


@pytest.mark.parametrize("ptr,size", [(0x10f80, 0x100), (0x18000, 0x10), (0x0f000, 0x10)])
def test_a_fragment_outside_registered_memory_is_refused(ptr, size):
    table = RegionTable([A, B])
    ptrs = np.array([0x10000, ptr, 0x20000], np.uint64)
    with pytest.raises(TransferAgentError, match="1 x fragment\\(s\\) fall outside registered memory"):
        table.locate(ptrs, np.full(3, size, np.uint64), "x")
    with pytest.raises(TransferAgentError, match="outside registered memory"):
        RegionTable([A]).locate(np.array([0x10f80], np.uint64), np.uint64(0x100), "x")
