"""Child-process side of the two-process agent tests (imported by name in a spawned process)."""

from __future__ import annotations

import time

from pdserve.kv_transfer.agents import TransferState, make_agent
from pdserve.kv_transfer.agents.shm import allocate_shared


def wait_state(agent, handle, timeout_s: float) -> TransferState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = agent.poll(handle)
        if state is not TransferState.IN_PROGRESS:
            return state
        time.sleep(0.0005)
    raise TimeoutError(f"write still in flight after {timeout_s} s")


def run_target(backend: str, nbytes: int, inbox, outbox, timeout_s: float = 30.0) -> None:
    """Register a zeroed buffer, publish (descriptor, address), then report the first notification
    and the buffer's bytes once the parent says "check"."""
    agent = make_agent(backend)
    buf = allocate_shared(nbytes)
    agent.register_memory(buf.region)
    outbox.put((agent.local_descriptor(), buf.ptr))
    assert inbox.get(timeout=timeout_s) == "check"
    deadline = time.monotonic() + timeout_s
    notes = []
    while not notes and time.monotonic() < deadline:
        notes = agent.get_notifications()
        time.sleep(0.0005)
    sender, message = notes[0]
    outbox.put((sender, message, buf.numpy().tobytes()))
    agent.shutdown()
    buf.free()


def run_vram_target(nbytes: int, inbox, outbox, timeout_s: float = 60.0) -> None:
    """Like run_target, over a CUDA tensor registered with the NIXL agent."""
    import torch

    from pdserve.kv_transfer.agents import MemoryRegion

    agent = make_agent("nixl")
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    agent.register_memory(MemoryRegion.of_tensor(buf))
    outbox.put((agent.local_descriptor(), buf.data_ptr()))
    assert inbox.get(timeout=timeout_s) == "check"
    deadline = time.monotonic() + timeout_s
    notes = []
    while not notes and time.monotonic() < deadline:
        notes = agent.get_notifications()
        time.sleep(0.0005)
    sender, message = notes[0]
    outbox.put((sender, message, buf.cpu().numpy().tobytes()))
    agent.shutdown()
