"""Transfer agents: in-process fake, and shm / NIXL between two separate processes."""

from __future__ import annotations

import multiprocessing as mp

import msgpack
import numpy as np
import pytest

from pdserve.kv_transfer.agents import MemoryRegion, TransferAgentError, TransferState, make_agent
from pdserve.kv_transfer.agents.fake import FakeAgent
from pdserve.kv_transfer.agents.memcopy import copy_fragments
from pdserve.kv_transfer.agents.shm import ShmAgent, allocate_shared
from kvt_agent_peer import run_target, wait_state

TIMEOUT_S = 30


def _region(array: np.ndarray) -> MemoryRegion:
    return MemoryRegion(array.ctypes.data, array.nbytes)


def test_copy_fragments_vectorised_and_loop_paths_agree():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, 1 << 16, dtype=np.uint8)
    for size, count in ((24, 1000), (6, 700), (3000, 10)):
        dst = np.zeros_like(src)
        offs = rng.permutation(len(src) // size)[:count].astype(np.uint64) * size
        doffs = rng.permutation(len(src) // size)[:count].astype(np.uint64) * size
        copy_fragments(dst.ctypes.data + doffs, src.ctypes.data + offs, np.full(count, size, np.uint64))
        for d, s in zip(doffs[:50].tolist(), offs[:50].tolist()):
            assert (dst[d:d + size] == src[s:s + size]).all()
        assert int(dst.astype(np.int64).sum()) == sum(int(src[s:s + size].astype(np.int64).sum())
                                                      for s in offs.tolist())


def test_fake_agent_write_then_notification():
    a, b = FakeAgent(), FakeAgent()
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory(_region(src))
    b.register_memory(_region(dst))
    peer = a.load_remote(b.local_descriptor())
    h = a.submit_write(peer, [src.ctypes.data + 10], [dst.ctypes.data + 100], [50], b"done-1")
    assert a.poll(h) is TransferState.DONE
    a.release(h)
    assert (dst[100:150] == src[10:60]).all() and dst[:100].sum() == 0
    assert b.get_notifications() == [(a.name, b"done-1")]
    assert b.get_notifications() == []
    a.shutdown(), b.shutdown()


def test_fake_agent_pause_keeps_write_in_flight():
    a, b = FakeAgent(), FakeAgent()
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    a.register_memory(_region(src)), b.register_memory(_region(dst))
    peer = a.load_remote(b.local_descriptor())
    a.pause()
    h = a.submit_write(peer, [src.ctypes.data], [dst.ctypes.data], [64], b"x")
    assert a.poll(h) is TransferState.IN_PROGRESS and dst.sum() == 0 and b.get_notifications() == []
    with pytest.raises(TransferAgentError, match="in flight"):
        a.release(h)
    a.resume()
    assert a.poll(h) is TransferState.DONE and dst.sum() == 64
    a.shutdown(), b.shutdown()


@pytest.mark.parametrize("backend", ["fake", "shm"])
def test_write_outside_registered_memory_is_refused(backend):
    alloc = allocate_shared if backend == "shm" else (lambda n: _Plain(n))
    a, b = make_agent(backend), make_agent(backend)
    src, dst = alloc(1024), alloc(1024)
    a.register_memory(src.region), b.register_memory(dst.region)
    peer = a.load_remote(b.local_descriptor())
    with pytest.raises(TransferAgentError, match="outside registered memory"):
        a.submit_write(peer, [src.ptr], [dst.ptr + 1000], [100], b"")
    with pytest.raises(TransferAgentError, match="outside registered memory"):
        a.submit_write(peer, [src.ptr - 8], [dst.ptr], [16], b"")
    with pytest.raises(TransferAgentError, match="not loaded"):
        a.submit_write("nobody", [src.ptr], [dst.ptr], [16], b"")
    a.shutdown(), b.shutdown()


@pytest.mark.parametrize("backend, other", [("fake", "shm"), ("shm", "fake"), ("nixl", "shm")])
def test_a_descriptor_from_elsewhere_is_refused(backend, other):
    """Garbage, another backend's agent, another descriptor version: each named, nothing loaded."""
    agent, peer = make_agent(backend), make_agent(other)
    try:
        with pytest.raises(TransferAgentError, match="not a transfer-agent descriptor"):
            agent.load_remote(b"\x00garbage")
        with pytest.raises(TransferAgentError, match=rf"'{other}' agent, this is the {backend} agent; configure one "
                                                     "backend on both sides"):
            agent.load_remote(peer.local_descriptor())
        if backend != "fake":  # fake descriptors never leave the process, so they carry no version
            desc = msgpack.unpackb(agent.local_descriptor())
            desc["version"] += 1
            with pytest.raises(TransferAgentError, match=rf"{backend} descriptor version 2 != 1; run one pdserve"):
                agent.load_remote(msgpack.packb(desc))
    finally:
        agent.shutdown(), peer.shutdown()


class _Plain:
    def __init__(self, n: int) -> None:
        self.array = np.zeros(n, np.uint8)
        self.ptr = self.array.ctypes.data
        self.region = MemoryRegion(self.ptr, n)


def test_shm_refuses_unshareable_memory_and_remote_host():
    agent = ShmAgent()
    plain = np.zeros(128, np.uint8)
    with pytest.raises(TransferAgentError, match="allocate_shared"):
        agent.register_memory(_region(plain))
    other = ShmAgent()
    desc = msgpack.unpackb(other.local_descriptor())
    desc["host"] = ["gpu-node-7", desc["host"][1]]
    with pytest.raises(TransferAgentError, match="gpu-node-7.*same host"):
        agent.load_remote(msgpack.packb(desc))
    with pytest.raises(TransferAgentError, match="'fake' agent"):
        agent.load_remote(FakeAgent().local_descriptor())
    agent.shutdown(), other.shutdown()


def test_shm_in_process_write_and_torch_view():
    torch = pytest.importorskip("torch")
    a, b = ShmAgent(), ShmAgent()
    src, dst = allocate_shared(1 << 16), allocate_shared(1 << 16)
    src.torch(torch.float32).copy_(torch.arange(1 << 14, dtype=torch.float32))
    a.register_memory(src.region), b.register_memory(dst.region)
    peer = a.load_remote(b.local_descriptor())
    h = a.submit_write(peer, [src.ptr], [dst.ptr], [1 << 16], b"n")
    assert wait_state(a, h, TIMEOUT_S) is TransferState.DONE
    assert torch.equal(dst.torch(torch.float32), src.torch(torch.float32))
    a.shutdown(), b.shutdown()
    src.free(), dst.free()


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_write_between_two_processes_is_byte_exact(backend):
    """The target process registers a buffer and waits for one notification; we write into it."""
    ctx = mp.get_context("spawn")
    to_target, from_target = ctx.Queue(), ctx.Queue()
    nbytes = 1 << 20
    proc = ctx.Process(target=run_target, args=(backend, nbytes, to_target, from_target), daemon=True)
    proc.start()
    try:
        agent = make_agent(backend)
        src = allocate_shared(nbytes)
        rng = np.random.default_rng(1)
        src.numpy()[:] = rng.integers(0, 255, nbytes, dtype=np.uint8)
        agent.register_memory(src.region)
        descriptor, dst_ptr = from_target.get(timeout=TIMEOUT_S)
        peer = agent.load_remote(descriptor)
        # Two fragments, swapped halves, plus an untouched tail, so order and bounds both matter.
        half = nbytes // 4
        srcs = np.array([src.ptr, src.ptr + half], np.uint64)
        dsts = np.array([dst_ptr + half, dst_ptr], np.uint64)
        h = agent.submit_write(peer, srcs, dsts, np.array([half, half], np.uint64), b"req-7")
        assert wait_state(agent, h, TIMEOUT_S) is TransferState.DONE
        agent.release(h)
        to_target.put("check")
        sender, message, received = from_target.get(timeout=TIMEOUT_S)
        expected = np.zeros(nbytes, np.uint8)
        expected[half:2 * half] = src.numpy()[:half]
        expected[:half] = src.numpy()[half:2 * half]
        assert (sender, message) == (agent.name, b"req-7")
        assert np.array_equal(np.frombuffer(received, np.uint8), expected)
        agent.shutdown()
        src.free()
    finally:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


@pytest.mark.cuda
def test_nixl_vram_to_vram_between_processes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvt_agent_peer import run_vram_target

    ctx = mp.get_context("spawn")
    to_target, from_target = ctx.Queue(), ctx.Queue()
    nbytes = 16 << 20
    proc = ctx.Process(target=run_vram_target, args=(nbytes, to_target, from_target), daemon=True)
    proc.start()
    try:
        agent = make_agent("nixl")
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        agent.register_memory(MemoryRegion.of_tensor(src))
        descriptor, dst_ptr = from_target.get(timeout=60)
        peer = agent.load_remote(descriptor)
        h = agent.submit_write(peer, [src.data_ptr()], [dst_ptr], [nbytes], b"vram")
        assert wait_state(agent, h, 60) is TransferState.DONE
        to_target.put("check")
        sender, message, received = from_target.get(timeout=60)
        assert message == b"vram" and received == src.cpu().numpy().tobytes()
        agent.shutdown()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
