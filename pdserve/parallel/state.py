"""Process groups for tensor and pipeline parallelism.

Ranks are laid out TP-minor: `rank = pp_rank * tp_size + tp_rank`. Rank 0 is the first pipeline
stage's first TP rank; it schedules and serves HTTP. With one rank nothing here touches
torch.distributed, so single-process code paths stay free of collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: object | None = field(default=None, repr=False)
    # Control messages (msgpack in CPU tensors) need gloo even when the model's collectives use NCCL.
    cpu_group: object | None = field(default=None, repr=False)
    # On CPU, the TP group's all-reduce through shared memory where its ranks share a host: set by the engine
    # after init_parallel (parallel/shm_all_reduce.py, attach_shm_all_reduce)
    tp_shm: object | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_leader(self) -> int:
        """The rank that samples: TP rank 0 of the last pipeline stage."""
        return (self.pp_size - 1) * self.tp_size

    def stage_rank(self, pp_rank: int) -> int:
        return pp_rank * self.tp_size + self.tp_rank

    # Collectives. Each is the identity with a single TP rank.

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            if self.tp_shm is not None and self.tp_shm.fits(x):
                return self.tp_shm(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def tp_all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def init_parallel(tp_size: int, pp_size: int, rank: int, host: str, port: int, device: torch.device,
                  timeout_s: float, workers: list | None = None) -> ParallelState:
    """Join the process group and build one TP group per pipeline stage (every rank must build all).

    The model's collectives run on NCCL when `device` is a CUDA device (made this process's current
    device first, so NCCL binds the rank to it), on gloo otherwise. Rank 0 hosts the store and,
    before the collective rendezvous, waits until every worker process has checked in, watching
    `workers` (multiprocessing.Process objects): a worker that dies during start-up becomes an error
    naming its exit code instead of a rendezvous that never completes.
    """
    world = tp_size * pp_size
    state = ParallelState(tp_size=tp_size, pp_size=pp_size, rank=rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return state
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        _await_workers(store, workers or [], world, timeout_s)
    else:
        store.set(f"alive/{rank}", "1")
    dist.init_process_group(backend=backend, store=store, world_size=world, rank=rank, timeout=timeout)
    if backend != "gloo":
        state.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    for pp in range(pp_size):
        group = dist.new_group(list(range(pp * tp_size, (pp + 1) * tp_size)))
        if pp == state.pp_rank:
            state.tp_group = group
    return state


def _await_workers(store, workers: list, world: int, timeout_s: float) -> None:
    keys = [f"alive/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = [p for p in workers if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"rank process {dead[0].name} exited with code {dead[0].exitcode} during start-up; "
                               "its log above says why")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank processes did not start within {timeout_s:.0f} s (dist_timeout_s)")
        time.sleep(0.05)


# Control messages between ranks travel as msgpack bytes inside uint8 tensors (never pickle).
# `group` is a gloo group so the same code works when the model's collectives run on NCCL.

def broadcast_bytes(data: bytes | None, src: int = 0, group=None) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
           else torch.empty(int(n), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def send_bytes(data: bytes, dst: int, group=None) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)


def recv_bytes(src: int, group=None) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group)
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return buf.numpy().tobytes()
