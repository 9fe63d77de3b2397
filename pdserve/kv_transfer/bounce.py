"""Bounce buffer: many small fragments -> one contiguous staging write -> scatter on the receiver.

The NHD head-mismatch mapper emits one fragment per (layer, K/V, token); thousands of sub-16 KiB
descriptors cost far more in per-descriptor overhead than in bytes. With bouncing, the sender
gathers them into its registered staging buffer and writes that once into the receiver's staging
segment; the receiver, on the write's notification, scatters it into its KV pool.

Staging segment written by the sender (little-endian)::

    [magic u64 | num_fragments u64 | payload_bytes u64 | uniform_size u64]  32 bytes
    [dst_ptrs u64 x n][sizes u64 x n, omitted when uniform_size > 0]         the sender's plan
    [payload: fragment 0 | fragment 1 | ...]                                 in plan order

The table costs 8 bytes per fragment for equal-sized fragments (the NHD case), 16 otherwise; the
receiver sizes its segments at 1.5x its payload bound to leave room for it.

All address arithmetic stays on the sender; the receiver checks every destination lies in its own
registered memory before it scatters.

Where the copies run: with the KV in host memory (device None) they are CPU copies (numpy rows,
agents/memcopy.py). With the KV in GPU memory the staging buffer is GPU memory on the pool's device
and the segment never touches the host: the sender writes the header and table with one small copy and
packs the payload with one `index_select` per fragment size (device_rows.py); the receiver reads the
header and table back (a small copy), checks them on the host as above, and unpacks the payload with
one `index_copy_` per fragment size. Fragments are laid out sorted by size (stable), so each size is
one packed run. So a head-mismatch write of tens of thousands of fragments is one descriptor per
(writer, receiver) however the pool is laid out.

Gates (all must pass, and both sides' `BounceConfig` must be equal, else the direct path is used,
with a warning on a mismatch): the KV payload spans >= min_kv_blocks blocks (host memory only; or a
state payload is >= min_state_bytes), and the descriptor shape is >= min_fragments fragments averaging
<= max_avg_fragment_bytes. Off by default (TransceiverConfig.bounce = None).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.kv_transfer.agents.base import MemoryRegion, RegionTable, TransferAgent
from pdserve.kv_transfer.agents.memcopy import copy_fragments, gather_packed, host_view, scatter_packed
from pdserve.kv_transfer.agents.shm import allocate_shared
from pdserve.kv_transfer.errors import KVTransferError

logger = logging.getLogger(__name__)

_MAGIC = 0x50445356_424F554E  # "PDSVBOUN"
_HEADER_BYTES = 32
_ALIGN = 64


@dataclass(frozen=True)
class BounceConfig:
    staging_bytes: int = 256 << 20  # per rank; holds one segment per concurrent writer/receive
    min_kv_blocks: int = 96
    min_state_bytes: int = 2 << 20
    min_fragments: int = 1024
    max_avg_fragment_bytes: int = 16 << 10

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BounceConfig.{name} must be a positive int, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def shape_passes(self, sizes: np.ndarray) -> bool:
        n = len(sizes)
        return n >= self.min_fragments and int(sizes.sum()) <= self.max_avg_fragment_bytes * n

    def kv_passes(self, num_blocks: int, sizes: np.ndarray, on_device: bool = False) -> bool:
        """On a device the block gate does not apply: a GPU write costs tens of microseconds per
        descriptor (30,720 took 862 ms, docs/benchmarks.md) while the gather is one kernel, so any
        plan of the many-small-fragments shape is staged, however short the prompt."""
        return (on_device or num_blocks >= self.min_kv_blocks) and self.shape_passes(sizes)

    def state_passes(self, sizes: np.ndarray) -> bool:
        return int(sizes.sum()) >= self.min_state_bytes and self.shape_passes(sizes)


def segment_bytes(num_fragments: int, payload_bytes: int, uniform: bool = False) -> int:
    return _HEADER_BYTES + (8 if uniform else 16) * num_fragments + payload_bytes


def segment_bound(payload_bound: int) -> int:
    """Receiver-side segment size for at most `payload_bound` payload bytes (see the table cost)."""
    return segment_bytes(0, payload_bound + payload_bound // 2)


def _uniform_size(sizes: np.ndarray) -> int:
    return int(sizes[0]) if len(sizes) and bool((sizes == sizes[0]).all()) else 0


def plan_segment_bytes(sizes: np.ndarray) -> int:
    """Bytes the sender's segment for this plan takes."""
    return segment_bytes(len(sizes), int(sizes.sum()), _uniform_size(sizes) > 0)


@dataclass(frozen=True)
class StagingLease:
    """A segment of the staging buffer, held by one request's transfer until it is released."""

    ptr: int
    nbytes: int


class StagingBuffer:
    """A registered buffer handed out in leases (first fit, coalescing on release): host memory, or GPU
    memory of `device` (the KV pool's: "cuda:N") so that gathers and scatters stay on the device."""

    def __init__(self, agent: TransferAgent, nbytes: int, device: str | None = None) -> None:
        self.device = device
        if device is None:
            self._memory = allocate_shared(nbytes)  # shareable, so every agent backend can register it
            self.region = MemoryRegion(self._memory.ptr, nbytes)
        else:
            import torch

            self._memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.region = MemoryRegion.of_tensor(self._memory)
        agent.register_memory(self.region)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self.nbytes = nbytes

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def lease(self, nbytes: int) -> StagingLease | None:
        """A segment of at least nbytes, or None when the buffer is too full (caller goes direct)."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        for i, (offset, size) in enumerate(self._free):
            if size >= need:
                self._free[i:i + 1] = [(offset + need, size - need)] if size > need else []
                return StagingLease(self.region.ptr + offset, need)
        return None

    def release(self, lease: StagingLease) -> None:
        self._free.append((lease.ptr - self.region.ptr, lease.nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for offset, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged


def gather(lease: StagingLease, src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray,
           device: str | None = None) -> int:
    """Pack the plan into `lease` (sender side); returns the segment's byte count. `device`: where the
    source fragments and the lease live (None: host memory)."""
    if device is not None:
        return _gather_on(device, lease, src_ptrs, dst_ptrs, sizes)
    n, payload, uniform = len(sizes), int(sizes.sum()), _uniform_size(sizes)
    total = plan_segment_bytes(sizes)
    assert total <= lease.nbytes, (total, lease.nbytes)
    table_words = n if uniform else 2 * n
    head = host_view(lease.ptr, _HEADER_BYTES + 8 * table_words, np.uint64)
    head[:4] = (_MAGIC, n, payload, uniform)
    head[4:4 + n] = dst_ptrs
    payload_ptr = lease.ptr + _HEADER_BYTES + 8 * table_words
    if uniform:  # the NHD shape: no offsets to build, rows go straight into the payload
        gather_packed(payload_ptr, src_ptrs, uniform)
        return total
    head[4 + n:] = sizes
    offsets = np.zeros(n, np.uint64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    copy_fragments(np.uint64(payload_ptr) + offsets, src_ptrs.astype(np.uint64, copy=False),
                   sizes.astype(np.uint64, copy=False))
    return total


def scatter(segment_ptr: int, segment_nbytes: int, local_regions: RegionTable, device: str | None = None) -> int:
    """Unpack a segment the sender wrote into our staging (receiver side); returns payload bytes.
    `device`: where the segment and our KV live (None: host memory)."""
    if device is not None:
        return _scatter_on(device, segment_ptr, segment_nbytes, local_regions)
    magic, n, payload, uniform = host_view(segment_ptr, _HEADER_BYTES, np.uint64).tolist()
    table_words = _check_header(segment_ptr, segment_nbytes, magic, n, payload, uniform)
    table = host_view(segment_ptr + _HEADER_BYTES, 8 * table_words, np.uint64)
    dst = table[:n].copy()  # our own copy: the checks below must hold for the bytes we then use
    sizes = _checked_sizes(table, n, payload, uniform, dst, local_regions)
    payload_ptr = segment_ptr + _HEADER_BYTES + 8 * table_words
    if uniform:
        scatter_packed(dst, payload_ptr, uniform)
        return payload
    offsets = np.zeros(n, np.uint64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    copy_fragments(dst, np.uint64(payload_ptr) + offsets, sizes)
    return payload


def _check_header(segment_ptr: int, segment_nbytes: int, magic: int, n: int, payload: int, uniform: int) -> int:
    """The table's length in words, once the header is one of ours and fits the segment."""
    if magic != _MAGIC or segment_bytes(n, payload, uniform > 0) > segment_nbytes:
        raise KVTransferError(
            f"bounce segment at {segment_ptr:#x} is corrupt (magic {magic:#x}, {n} fragments, {payload} bytes "
            f"in a {segment_nbytes}-byte segment); both sides must run the same bounce protocol"
        )
    return n if uniform else 2 * n


def _checked_sizes(table: np.ndarray, n: int, payload: int, uniform: int, dst: np.ndarray,
                   local_regions: RegionTable) -> np.ndarray:
    """Every fragment's size, once the sizes add up and every destination lies in our KV memory."""
    if uniform:
        if uniform * n != payload:
            raise KVTransferError(f"bounce segment holds {n} fragments of {uniform} bytes, header says {payload}")
        local_regions.locate(dst, np.uint64(uniform), "bounce destination")
        return np.full(n, uniform, np.uint64)
    sizes = table[n:2 * n].copy()
    if int(sizes.sum()) != payload:
        raise KVTransferError(f"bounce segment sizes sum to {int(sizes.sum())}, header says {payload}")
    local_regions.locate(dst, sizes, "bounce destination")
    return sizes


def _runs(sizes: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, size) of each run of equal consecutive sizes."""
    starts = np.flatnonzero(np.concatenate(([True], sizes[1:] != sizes[:-1]))).tolist() if len(sizes) else []
    ends = starts[1:] + [len(sizes)]
    return [(a, b, int(sizes[a])) for a, b in zip(starts, ends)]


def _gather_on(device: str, lease: StagingLease, src_ptrs: np.ndarray, dst_ptrs: np.ndarray,
               sizes: np.ndarray) -> int:
    import torch

    from pdserve.kv_transfer import device_rows

    dev = torch.device(device)
    src, dst, sizes = (np.asarray(a, np.uint64) for a in (src_ptrs, dst_ptrs, sizes))
    order = np.argsort(sizes, kind="stable")  # one packed run per fragment size
    src, dst, sizes = src[order], dst[order], sizes[order]
    n, payload, uniform = len(sizes), int(sizes.sum()), _uniform_size(sizes)
    total = plan_segment_bytes(sizes)
    assert total <= lease.nbytes, (total, lease.nbytes)
    table = [np.array([_MAGIC, n, payload, uniform], np.uint64), dst] + ([] if uniform else [sizes])
    device_rows.copy_in(lease.ptr, np.concatenate(table), dev)
    at = lease.ptr + _HEADER_BYTES + 8 * (n if uniform else 2 * n)
    for start, end, size in _runs(sizes):
        device_rows.gather_rows(at, src[start:end], size, dev)
        at += (end - start) * size
    device_rows.synchronize(dev)  # the peer reads the segment once we submit the write
    return total


def _scatter_on(device: str, segment_ptr: int, segment_nbytes: int, local_regions: RegionTable) -> int:
    import torch

    from pdserve.kv_transfer import device_rows

    dev = torch.device(device)
    if segment_nbytes < _HEADER_BYTES:
        raise KVTransferError(f"bounce segment of {segment_nbytes} bytes cannot hold a header")
    magic, n, payload, uniform = device_rows.copy_out(segment_ptr, _HEADER_BYTES, dev).view(np.uint64).tolist()
    table_words = _check_header(segment_ptr, segment_nbytes, magic, n, payload, uniform)
    table = device_rows.copy_out(segment_ptr + _HEADER_BYTES, 8 * table_words, dev).view(np.uint64)
    dst = table[:n]
    sizes = _checked_sizes(table, n, payload, uniform, dst, local_regions)
    at = segment_ptr + _HEADER_BYTES + 8 * table_words
    for start, end, size in _runs(sizes):
        device_rows.scatter_rows(dst[start:end], at, size, dev)
        at += (end - start) * size
    device_rows.synchronize(dev)  # the staging lease is reused once we return
    return payload
