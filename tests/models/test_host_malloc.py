"""keep_freed_memory: a freed large activation is reused by the next step instead of being mapped
(and page-faulted) afresh. huge_page_buffer: the decode weights in 2 MiB pages, and the engine keeps them
there."""

from __future__ import annotations

import ctypes.util
import re
import resource
import sys
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.host_malloc import HUGE_PAGE, huge_page_buffer, keep_freed_memory
from pdserve.kernels import cpu
from pdserve.models import layers
from pdserve.testing import make_tiny_model

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


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ("" where it has none)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else ""


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _skip_without_huge_pages():
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode() or 'absent'} here")


def test_a_huge_page_buffer_starts_on_a_huge_page_and_gets_them():
    """Under THP "madvise" (the usual default) only memory that asked gets huge pages: without the
    madvise this buffer had none."""
    buf = huge_page_buffer(8 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 8 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    _skip_without_huge_pages()
    buf.fill_(1)  # the pages are granted at first touch
    assert _huge_kib(buf.data_ptr()) >= 4 * HUGE_PAGE // 1024  # at least half of it, should memory be short


@pytest.mark.skipif(not cpu.skinny_linear_runs(), reason="no native GEMV here: no plain weights kept")
def test_the_engine_keeps_its_decode_weights_in_huge_pages(tmp_path):
    """Every linear's plain weight (what the GEMV streams at a decode step) lies in one 2 MiB-aligned buffer
    of huge pages and holds the layer's weight (the greedy-output tests run the engine on them)."""
    d = make_tiny_model(tmp_path / "m", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=2048, vocab_size=512)
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8)) as llm:
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, layers._LINEARS)]
        plain = [m.gemv_weight for m in linears]
        assert all(w is not None and w.is_contiguous() for w in plain)
        starts = sorted(w.data_ptr() for w in plain)
        assert starts[0] % HUGE_PAGE == 0 and all(a % 64 == 0 for a in starts)
        assert len({w.untyped_storage().data_ptr() for w in plain}) == 1  # one buffer
        x = torch.randn(2, plain[0].shape[1])
        torch.testing.assert_close(layers.linear(x, linears[0].weight), x @ plain[0].T, rtol=1e-5, atol=1e-5)
        if _thp_mode() in ("always", "madvise"):
            assert _huge_kib(starts[0]) > 0
