"""Fault injection for the data plane: a transfer agent that wraps a real one and makes some of its
writes fail, some late, some land with one byte flipped, and loses some of its incoming
notifications. For fault tests and the fault script only (cache_transceiver_config.fault_injection);
nothing turns it on by default.

    engine ──submit_write──> FaultyAgent ──(fail? delay? corrupt?)──> real agent ──bytes──> peer
    engine <─get_notifications── FaultyAgent <──(drop?)── real agent <──notifications── peer

A failed write writes nothing and polls FAILED, as a backend error would. A delayed write reaches the
real agent `delay_ms` later. A corrupted write is the same write through the real agent, except that
one byte of one fragment comes from a scratch buffer holding that byte inverted: the receiver sees a
successful write with wrong data, which only a checksum (integrity.py) can catch. A dropped
notification means the data landed but the receiver is never told, so it must time out. Draws come
from one seeded generator, so a run can be repeated.
"""

from __future__ import annotations

import ctypes
import logging
import random
import time
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.agents.base import MemoryRegion, TransferAgent, TransferHandle, TransferState
from pdserve.kv_transfer.agents.shm import allocate_shared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultPlan:
    write_failure_rate: float = 0.0  # share of writes that fail without writing anything
    drop_notification_rate: float = 0.0  # share of incoming notifications lost after their data landed
    corrupt_rate: float = 0.0  # share of writes that land with one byte inverted (host memory only)
    delay_ms: float = 0.0  # every write starts this much later
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("write_failure_rate", "drop_notification_rate", "corrupt_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fault_injection.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.delay_ms < 0:
            raise ValueError(f"fault_injection.delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def active(self) -> bool:
        return bool(self.write_failure_rate or self.drop_notification_rate or self.corrupt_rate or self.delay_ms)


class _Injected(TransferHandle):
    """A write the wrapper holds: failed outright, or waiting for its start time."""

    __slots__ = ("failed", "start_at", "args", "inner")

    def __init__(self, remote: str, sizes: np.ndarray, failed: bool, start_at: float, args: tuple) -> None:
        super().__init__(remote, int(np.asarray(sizes, dtype=np.uint64).sum()), len(sizes))
        self.failed, self.start_at, self.args = failed, start_at, args
        self.inner: TransferHandle | None = None


_SCRATCH_BYTES = 4096  # inverted bytes of corrupted writes, used in turn
_DELAY_POLL_S = 0.001  # how often a waiter polls while delayed writes may be due


class FaultyAgent(TransferAgent):
    def __init__(self, inner: TransferAgent, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self.name = inner.name
        self._rng = random.Random(plan.seed)
        self.injected = {"failed_writes": 0, "delayed_writes": 0, "corrupted_writes": 0, "dropped_notifications": 0}
        self._scratch: np.ndarray | None = None
        self._scratch_region: MemoryRegion | None = None
        self._scratch_next = 0
        if plan.corrupt_rate:
            # Registered like any source, before the descriptor is taken, hidden from registered_regions.
            self._scratch_buffer = allocate_shared(_SCRATCH_BYTES)  # shareable: every agent can register it
            self._scratch = self._scratch_buffer.numpy(np.uint8)
            self._scratch_region = MemoryRegion(self._scratch_buffer.ptr, _SCRATCH_BYTES)
            inner.register_memory(self._scratch_region)
        log.warning("transfer agent %s injects faults: %s", self.name, plan)

    @property
    def completion_poll_s(self) -> float | None:
        """A delayed write starts when it is polled after its start time: poll while one waits."""
        inner = self.inner.completion_poll_s
        return min(inner or _DELAY_POLL_S, _DELAY_POLL_S) if self.plan.delay_ms else inner

    def set_waker(self, wake) -> None:
        self.inner.set_waker(wake)

    def register_memory(self, region: MemoryRegion) -> None:
        self.inner.register_memory(region)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self.inner.deregister_memory(region)

    @property
    def registered_regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(r for r in self.inner.registered_regions if r != self._scratch_region)

    def local_descriptor(self) -> bytes:
        return self.inner.local_descriptor()

    def load_remote(self, descriptor: bytes) -> str:
        return self.inner.load_remote(descriptor)

    def invalidate_remote(self, name: str) -> None:
        self.inner.invalidate_remote(name)

    def submit_write(self, remote, src_ptrs, dst_ptrs, sizes, notification: bytes) -> TransferHandle:
        failed = self._rng.random() < self.plan.write_failure_rate
        if failed:
            self.injected["failed_writes"] += 1
        elif self.plan.delay_ms:
            self.injected["delayed_writes"] += 1
        if not failed and self.plan.corrupt_rate and self._rng.random() < self.plan.corrupt_rate:
            src_ptrs, dst_ptrs, sizes = self._corrupt(src_ptrs, dst_ptrs, sizes)
        start_at = time.monotonic() + self.plan.delay_ms / 1000.0
        handle = _Injected(remote, sizes, failed, start_at, (remote, src_ptrs, dst_ptrs, sizes, notification))
        self._start_if_due(handle)
        return handle

    def _corrupt(self, src_ptrs, dst_ptrs, sizes):
        """The same fragments, but one byte comes inverted from the scratch buffer."""
        src, dst, size = (np.asarray(a, dtype=np.uint64) for a in (src_ptrs, dst_ptrs, sizes))
        if not size.any() or any(r.is_device for r in self.inner.registered_regions):
            return src_ptrs, dst_ptrs, sizes
        i = self._rng.choice(np.flatnonzero(size).tolist())
        k = self._rng.randrange(int(size[i]))
        at = self._scratch_next
        self._scratch_next = (at + 1) % _SCRATCH_BYTES
        self._scratch[at] = ctypes.c_uint8.from_address(int(src[i]) + k).value ^ 0xFF
        pieces = [(int(src[i]), int(dst[i]), k), (self._scratch_region.ptr + at, int(dst[i]) + k, 1),
                  (int(src[i]) + k + 1, int(dst[i]) + k + 1, int(size[i]) - k - 1)]
        pieces = [p for p in pieces if p[2] > 0]
        new = [np.concatenate([a[:i], np.array([p[j] for p in pieces], dtype=np.uint64), a[i + 1:]])
               for j, a in enumerate((src, dst, size))]
        self.injected["corrupted_writes"] += 1
        return new[0], new[1], new[2]

    def _start_if_due(self, handle: _Injected) -> None:
        if not handle.failed and handle.inner is None and time.monotonic() >= handle.start_at:
            handle.inner = self.inner.submit_write(*handle.args)
            handle.args = ()

    def poll(self, handle: TransferHandle) -> TransferState:
        assert isinstance(handle, _Injected), "a handle from another agent"
        if handle.failed:
            return TransferState.FAILED
        self._start_if_due(handle)
        return TransferState.IN_PROGRESS if handle.inner is None else self.inner.poll(handle.inner)

    def release(self, handle: TransferHandle) -> None:
        assert isinstance(handle, _Injected), "a handle from another agent"
        if handle.inner is not None:
            self.inner.release(handle.inner)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        kept = []
        for note in self.inner.get_notifications():
            if self._rng.random() < self.plan.drop_notification_rate:
                self.injected["dropped_notifications"] += 1
                continue
            kept.append(note)
        return kept

    def shutdown(self) -> None:
        log.warning("transfer agent %s injected %s", self.name, self.injected)
        if self._scratch_region is not None:
            self.inner.deregister_memory(self._scratch_region)
        self.inner.shutdown()
