"""keep_freed_memory: a freed large activation is reused by the next step instead of being mapped
(and page-faulted) afresh."""

from __future__ import annotations

import ctypes.util
import resource
import sys

import pytest
import torch

from pdserve.engine.host_malloc import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="glibc only")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_freed_48_mib_tensor_is_reused_without_page_faults():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
    n = 48 * 2**20 // 4  # above glibc's largest default mmap threshold (32 MiB)
    torch.ones(n)  # first use maps and faults the pages in; the tensor is freed at once
    before = _minor_faults()
    torch.ones(n)
    # Untuned glibc would mmap again: one fault per 4 KiB page, ~12000 of them.
    assert _minor_faults() - before < 1000
