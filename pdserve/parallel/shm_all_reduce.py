"""All-reduce through shared memory for the tensor-parallel ranks of one host, on CPU.

gloo's all-reduce goes through loopback TCP and wakes a thread on each call, and a decode step of a
30-layer model makes 60 of them; a shared segment costs a fraction of that
(benchmarks/bench_all_reduce.py; docs/benchmarks.md, "Tensor-parallel all-reduce through shared
memory"). Here the group's first rank allocates one /dev/shm segment, the others map it, and each call
is a copy into the rank's slot, a wait for the other ranks' sequence numbers, and a sum of the slots in
rank order (csrc/shm_all_reduce.c), so every rank gets the same bits.

Used when every rank of the group runs on this host and loaded the kernel library, and /dev/shm has
room for the segment (4 MiB per rank), for fp32 and bf16 tensors that fit a slot (`SLOT_BYTES`);
anything else (a prefill chunk too large, another dtype) stays on gloo. Every rank takes the same path
for a call, since the rule depends only on the tensor's size and dtype, which agree across ranks. A
rank that dies leaves the others an error naming it, at once; a rank that stops answering, an error
after the group's timeout (dist_timeout_s).
`PDSERVE_SHM_ALL_REDUCE=0` keeps every call on gloo.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from pdserve.env import settings
from pdserve.host import host_id
from pdserve.kernels import cpu
from pdserve.parallel.state import ParallelState

log = logging.getLogger(__name__)

SLOT_BYTES = 2 << 20  # a prefill chunk of 512 tokens x 1024 hidden fp32 fits; larger ones go to gloo
FLAG_BYTES = 64  # FLAG_BYTES in csrc/shm_all_reduce.c
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_TIMEOUT, _PEER_GONE = 1, 16  # return codes of shm_all_reduce (2: arguments refused)


class AllReduceError(RuntimeError):
    """A peer rank died or stopped answering inside an all-reduce."""


class ShmAllReduce:
    """One TP group's segment. Build it on every rank of the group at once (it talks over `group`)."""

    def __init__(self, group, group_ranks: list[int], rank: int, lib: ctypes.CDLL, timeout_s: float,
                 host: str) -> None:
        from pdserve.kv_transfer.agents.shm import allocate_shared

        world = len(group_ranks)
        self.rank = group_ranks.index(rank)
        self.world = world
        self.timeout_s = timeout_s
        self._lib = lib
        self._seq = 0
        nbytes = world * FLAG_BYTES + 2 * world * SLOT_BYTES
        mine = {"pid": os.getpid(), "host": host, "pid_ns": _pid_namespace()}
        self._owned = None
        if self.rank == 0:
            try:
                self._owned = allocate_shared(nbytes)
                mine["path"], mine["inode"] = self._owned.path, self._owned.inode
            except MemoryError as exc:  # /dev/shm too small: every rank learns it below and stays on gloo
                mine["error"] = str(exc)
        peers = [msgpack.unpackb(b) for b in _all_gather_bytes(msgpack.packb(mine), world, group)]
        if len({p["host"] for p in peers}) != 1:
            raise ValueError("the ranks of this group run on different hosts")
        # The segment is reached as /proc/<rank 0's pid>/fd/N, and peers are watched by pid: one pid namespace.
        if len({p["pid_ns"] for p in peers}) != 1:
            raise ValueError("the ranks of this group run in different pid namespaces")
        if "error" in peers[0]:
            raise ValueError(peers[0]["error"])
        self._mapping = None
        problem = ""
        if self._owned is not None:
            self.ptr = self._owned.ptr
        else:
            try:
                self._mapping = _map(peers[0]["path"], peers[0]["inode"], nbytes)
                self.ptr = int(np.frombuffer(self._mapping, dtype=np.uint8).ctypes.data)
            except (OSError, ValueError) as exc:
                problem = f"rank {self.rank} cannot map rank 0's segment: {exc}"
        # every rank mapped it before rank 0 stops publishing its fd; if one could not, all stay on gloo
        problems = [msgpack.unpackb(b) for b in _all_gather_bytes(msgpack.packb(problem), world, group)]
        if any(problems):
            raise ValueError(next(p for p in problems if p))
        self._pids = (ctypes.c_int32 * world)(*[p["pid"] for p in peers])
        if self._owned is not None:
            self._owned.free()  # the memory lives on in every rank's mapping; nothing is left in /dev/shm

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype in _DTYPES and x.device.type == "cpu" and x.is_contiguous()
                and x.numel() * x.element_size() <= SLOT_BYTES)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` across the group in place (x must `fit`)."""
        self._seq += 1
        status = self._lib.shm_all_reduce(self.ptr, SLOT_BYTES, self.rank, self.world, self._seq, x.data_ptr(),
                                          x.numel(), _DTYPES[x.dtype], self._pids, self.timeout_s)
        if status == 0:
            return x
        if status >= _PEER_GONE:
            peer = status - _PEER_GONE
            raise AllReduceError(f"tensor-parallel rank {peer} of this group (pid {self._pids[peer]}) exited during "
                                 "an all-reduce")
        if status == _TIMEOUT:
            raise AllReduceError(f"an all-reduce waited {self.timeout_s:.0f} s (dist_timeout_s) for a "
                                 "tensor-parallel rank that is alive but does not answer")
        raise AllReduceError(f"shm_all_reduce refused its arguments (status {status})")


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"unknown-{os.getpid()}"  # unknown: never equal, so the group stays on gloo


def _map(path: str, inode: int, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_ino != inode:
            raise ValueError(f"{path} is not the segment its owner published (its fd was reused)")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _all_gather_bytes(data: bytes, world: int, group) -> list[bytes]:
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[: int(s.item())].numpy().tobytes() for p, s in zip(parts, sizes)]


def shm_all_reduce_for(group, group_ranks: list[int], rank: int, timeout_s: float,
                       host: str) -> ShmAllReduce | None:
    """The group's shared-memory all-reduce, or None (every rank of the group agrees) where it cannot
    run: disabled, a rank without the kernel library, or ranks on different hosts."""
    lib = cpu.load() if settings().shm_all_reduce else None
    ready = torch.tensor([1 if lib is not None and hasattr(lib, "shm_all_reduce") else 0], dtype=torch.int64)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
    if not ready.item():
        return None
    lib.shm_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double]
    lib.shm_all_reduce.restype = ctypes.c_int
    try:
        return ShmAllReduce(group, group_ranks, rank, lib, timeout_s, host)
    except ValueError as exc:
        log.info("tensor-parallel all-reduce stays on gloo: %s", exc)
        return None


def attach_shm_all_reduce(state: ParallelState, device: torch.device, timeout_s: float) -> None:
    """After init_parallel, on every rank: the TP group's all-reduce through shared memory, where it can run
    (CPU ranks of one host with the kernel library); gloo otherwise."""
    if device.type == "cpu" and state.tp_size > 1:
        stage = list(range(state.pp_rank * state.tp_size, (state.pp_rank + 1) * state.tp_size))
        state.tp_shm = shm_all_reduce_for(state.tp_group, stage, state.rank, timeout_s, host_id())
