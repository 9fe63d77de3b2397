"""Transfer agents: the data plane. Only these modules touch NIXL or shared memory.

`make_agent(backend)` picks one by configured name; nothing else in pdserve names a backend.
"""

from __future__ import annotations

from pdserve.kv_transfer.agents.base import (
    MemoryRegion,
    TransferAgent,
    TransferAgentError,
    TransferHandle,
    TransferState,
)

BACKENDS = ("nixl", "shm", "fake")


def make_agent(backend: str, name: str | None = None, nixl_progress_delay_us: int | None = None) -> TransferAgent:
    """A transfer agent for `backend` ("nixl", "shm" or "fake"); the name must be unique per process.
    `nixl_progress_delay_us`: NIXL only, its progress thread's wait between passes (nixl.py; None: 1000)."""
    if backend == "nixl":
        from pdserve.kv_transfer.agents.nixl import DEFAULT_PROGRESS_DELAY_US, NixlAgent

        delay = DEFAULT_PROGRESS_DELAY_US if nixl_progress_delay_us is None else nixl_progress_delay_us
        return NixlAgent(name, progress_delay_us=delay)
    if backend == "shm":
        from pdserve.kv_transfer.agents.shm import ShmAgent

        return ShmAgent(name)
    if backend == "fake":
        from pdserve.kv_transfer.agents.fake import FakeAgent

        return FakeAgent(name)
    raise ValueError(f"unknown transfer backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "MemoryRegion", "TransferAgent", "TransferAgentError", "TransferHandle",
           "TransferState", "make_agent"]
