"""Fault injection for the data plane: a transfer agent that wraps a real one and makes some of its
writes fail, some late, and loses some of its incoming notifications. For fault tests and the fault
script only (cache_transceiver_config.fault_injection); nothing turns it on by default.

    engine ──submit_write──> FaultyAgent ──(fail? delay?)──> real agent ──bytes──> peer
    engine <─get_notifications── FaultyAgent <──(drop?)── real agent <──notifications── peer

A failed write writes nothing and polls FAILED, as a backend error would. A delayed write reaches the
real agent `delay_ms` later. A dropped notification means the data landed but the receiver is never
told, so it must time out. Draws come from one seeded generator, so a run can be repeated.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.agents.base import MemoryRegion, TransferAgent, TransferHandle, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultPlan:
    write_failure_rate: float = 0.0  # share of writes that fail without writing anything
    drop_notification_rate: float = 0.0  # share of incoming notifications lost after their data landed
    delay_ms: float = 0.0  # every write starts this much later
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("write_failure_rate", "drop_notification_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fault_injection.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.delay_ms < 0:
            raise ValueError(f"fault_injection.delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def active(self) -> bool:
        return bool(self.write_failure_rate or self.drop_notification_rate or self.delay_ms)


class _Injected(TransferHandle):
    """A write the wrapper holds: failed outright, or waiting for its start time."""

    __slots__ = ("failed", "start_at", "args", "inner")

    def __init__(self, remote: str, sizes: np.ndarray, failed: bool, start_at: float, args: tuple) -> None:
        super().__init__(remote, int(np.asarray(sizes, dtype=np.uint64).sum()), len(sizes))
        self.failed, self.start_at, self.args = failed, start_at, args
        self.inner: TransferHandle | None = None


class FaultyAgent(TransferAgent):
    def __init__(self, inner: TransferAgent, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self.name = inner.name
        self._rng = random.Random(plan.seed)
        self.injected = {"failed_writes": 0, "delayed_writes": 0, "dropped_notifications": 0}
        log.warning("transfer agent %s injects faults: %s", self.name, plan)

    def register_memory(self, region: MemoryRegion) -> None:
        self.inner.register_memory(region)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self.inner.deregister_memory(region)

    @property
    def registered_regions(self) -> tuple[MemoryRegion, ...]:
        return self.inner.registered_regions

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
        start_at = time.monotonic() + self.plan.delay_ms / 1000.0
        handle = _Injected(remote, sizes, failed, start_at, (remote, src_ptrs, dst_ptrs, sizes, notification))
        self._start_if_due(handle)
        return handle

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
        self.inner.shutdown()
