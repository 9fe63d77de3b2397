"""Keep glibc from handing freed tensor memory back to the kernel between forward steps.

PyTorch's CPU allocator is plain malloc. By default glibc serves every block above its mmap
threshold with a fresh mmap and unmaps it on free, so each large activation of every layer pays
page faults and page zeroing again, every step. A 2048-token SmolLM2 prefill allocates ~100 MB per
layer that way. Raising the mmap threshold and the trim threshold keeps freed blocks in the heap for
the next step, which spares every step those faults, prefill and decode alike.

The cost is that the process keeps its peak heap instead of shrinking after a burst, which a serving
process that reaches its working set on every long prompt wants anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 * 2**20  # glibc's ceiling for this knob on 64-bit
TRIM_THRESHOLD = 2**30

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc for this process (once). Returns False where there is no glibc mallopt."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no glibc mallopt here; host allocator left as it is")
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _done = ok
    if not ok:
        log.debug("mallopt refused the thresholds; host allocator left as it is")
    return ok


# -- weights in huge pages --------------------------------------------------------------------------

HUGE_PAGE = 2 * 2**20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised byte tensor of `nbytes` in fresh anonymous memory that starts on a 2 MiB boundary,
    asked of the kernel in transparent huge pages (madvise MADV_HUGEPAGE) before anything touches it.

    Why: a decode step streams every weight once, and in 4 KiB pages the hardware's prefetch stops at each
    page's end and every page costs a TLB walk (docs/benchmarks.md, "The decode GEMV: prefetch and huge
    pages"). Where the kernel grants none (THP off), this is ordinary memory, aligned the same."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
        except OSError as e:
            log.debug("madvise(MADV_HUGEPAGE) refused (%s); the weights stay in 4 KiB pages", e)
    return whole[start:start + nbytes]
