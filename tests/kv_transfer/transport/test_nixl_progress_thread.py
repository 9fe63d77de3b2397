"""NIXL's progress thread must not hold a core: NIXL's python wrapper starts it as a sched_yield loop
(delay 0), which took a whole core while idle and halved the prefill of an instance pinned to one core.
pdserve gives it a delay (cache_transceiver_config.nixl_progress_delay_us); 0 keeps NIXL's loop."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from pdserve.kv_transfer.agents import MemoryRegion, TransferState, make_agent


def _idle_cpu_share(delay_us, answer) -> None:
    agent = make_agent("nixl", f"idle-{delay_us}", nixl_progress_delay_us=delay_us)
    time.sleep(0.3)  # the thread is up
    t0, c0 = time.monotonic(), time.process_time()  # process time: every thread of this process
    time.sleep(1.0)
    answer.put((time.process_time() - c0) / (time.monotonic() - t0))
    agent.shutdown()


def idle_cpu_share(delay_us: int | None) -> float:
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    proc = ctx.Process(target=_idle_cpu_share, args=(delay_us, answer), daemon=True)
    proc.start()
    try:
        return answer.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def test_an_idle_agent_leaves_the_core_alone():
    assert idle_cpu_share(None) < 0.25  # the default delay: measured 2% of a core
    assert idle_cpu_share(0) > 0.5  # NIXL's own loop (measured 100%): the knob reaches the thread


def test_writes_still_complete_with_the_delay():
    a, b = make_agent("nixl", "pt-a"), make_agent("nixl", "pt-b")
    src, dst = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
    try:
        a.register_memory(MemoryRegion(src.ctypes.data, src.nbytes))
        b.register_memory(MemoryRegion(dst.ctypes.data, dst.nbytes))
        peer = a.load_remote(b.local_descriptor())
        h = a.submit_write(peer, np.array([src.ctypes.data], np.uint64), np.array([dst.ctypes.data], np.uint64),
                           np.array([src.nbytes], np.uint64), b"done")
        deadline = time.monotonic() + 30
        while (state := a.poll(h)) is TransferState.IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.001)
        assert state is TransferState.DONE
        assert np.array_equal(src, dst)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        make_agent("nixl", "neg", nixl_progress_delay_us=-1)
