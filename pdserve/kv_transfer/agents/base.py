"""The transfer-agent interface: one-sided writes into memory a peer registered.

Lifecycle of one agent (one per rank)::

    agent = make_agent(...)                      # fake / shm / nixl, chosen by config
    agent.register_memory(MemoryRegion(...))     # every region a peer may write or we read from
    desc = agent.local_descriptor()              # opaque bytes, shipped inside RankInfo
    ...
    peer = agent.load_remote(peer_desc)          # -> peer agent name
    h = agent.submit_write(peer, src, dst, sizes, notification=b"...")
    while agent.poll(h) is TransferState.IN_PROGRESS: ...
    agent.release(h)
    ...
    agent.get_notifications()                    # on the target: [(peer name, message), ...]

Semantics every backend keeps:
* A notification attached to a write is delivered only after every byte of that write is visible in
  the target's memory, so "notification received" means "data landed".
* The descriptor reflects the regions registered when it was produced; register first, then publish.
* Addresses are absolute in the owning process (src on the initiator, dst on the target), and a
  fragment must lie inside one registered region; otherwise `TransferAgentError` names it.

Waking the waiter. `set_waker(wake)` hands the agent a callback (cheap, never blocking, safe from any
thread) that it calls whenever a write it submitted finishes or a notification arrives, so that the
executor sleeps until something happened instead of polling. `completion_poll_s` is None for agents that
do (fake, shm); an agent whose backend cannot tell (NIXL's API has no completion event or file
descriptor, and a write's notification leaves only when the initiator polls it DONE) gives the interval
at which a waiter must poll it while work it owns is in flight.

The fake and shm agents, whose writes are CPU copies in this process, share `HostCopyAgent`: the
region table, the shut-down flag and handles the copy marks finished.
"""

from __future__ import annotations

import abc
import enum
import logging
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from pdserve.kv_transfer.errors import KVTransferError

logger = logging.getLogger(__name__)


class TransferAgentError(KVTransferError):
    """A transfer agent refused an operation (bad region, unknown peer, backend failure)."""


class TransferState(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous byte range owned by this process. device_id -1 is host DRAM, >= 0 a CUDA device."""

    ptr: int
    nbytes: int
    device_id: int = -1

    def __post_init__(self) -> None:
        if self.ptr <= 0 or self.nbytes <= 0:
            raise ValueError(f"MemoryRegion needs ptr > 0 and nbytes > 0, got ptr={self.ptr:#x} nbytes={self.nbytes}")

    @property
    def is_device(self) -> bool:
        return self.device_id >= 0

    @classmethod
    def of_tensor(cls, tensor) -> "MemoryRegion":
        """The region of a contiguous torch tensor (the engine's KV pool)."""
        if not tensor.is_contiguous():
            raise ValueError("MemoryRegion.of_tensor needs a contiguous tensor; call .contiguous() first")
        device_id = tensor.get_device() if tensor.is_cuda else -1
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_id)


class RegionTable:
    """Sorted, non-overlapping regions; locates fragments with one vectorised search."""

    def __init__(self, regions: list[MemoryRegion] | tuple[MemoryRegion, ...] = ()) -> None:
        self._regions: list[MemoryRegion] = []
        for region in regions:
            self.add(region)

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self):
        return iter(self._regions)

    def add(self, region: MemoryRegion) -> None:
        for other in self._regions:
            if region.ptr < other.ptr + other.nbytes and other.ptr < region.ptr + region.nbytes:
                raise TransferAgentError(
                    f"region [{region.ptr:#x}, +{region.nbytes}) overlaps registered region "
                    f"[{other.ptr:#x}, +{other.nbytes}); deregister it first"
                )
        self._regions.append(region)
        self._regions.sort(key=lambda r: r.ptr)

    def remove(self, region: MemoryRegion) -> None:
        try:
            self._regions.remove(region)
        except ValueError:
            raise TransferAgentError(f"region [{region.ptr:#x}, +{region.nbytes}) is not registered") from None

    def locate(self, ptrs: np.ndarray, sizes: np.ndarray, what: str) -> np.ndarray:
        """Index of the region holding each fragment [ptr, ptr + size); raises if any lies outside."""
        ptrs = np.asarray(ptrs, dtype=np.uint64)
        sizes = np.broadcast_to(np.asarray(sizes, dtype=np.uint64), ptrs.shape)  # a scalar size is allowed
        if len(self._regions) == 0:
            raise TransferAgentError(f"no {what} memory is registered")
        starts = np.array([r.ptr for r in self._regions], dtype=np.uint64)
        ends = starts + np.array([r.nbytes for r in self._regions], dtype=np.uint64)
        if len(ptrs):
            # Common case (a whole plan inside one pool): if the span [min ptr, max end) lies in one
            # region, every fragment does; two passes instead of a search per fragment.
            lo, hi = ptrs.min(), (ptrs + sizes).max()
            first = int(np.searchsorted(starts, lo, side="right")) - 1
            if first >= 0 and hi <= ends[first]:
                return np.full(len(ptrs), first, np.int64)
        idx = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
        bad = idx < 0
        safe = np.maximum(idx, 0)
        bad |= ptrs + sizes > ends[safe]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransferAgentError(
                f"{int(bad.sum())} {what} fragment(s) fall outside registered memory, first "
                f"[{int(ptrs[i]):#x}, +{int(sizes[i])}); register the region that holds them"
            )
        return safe


def check_fragments(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Coerce a write's fragment arrays to uint64 and check they are parallel 1-D arrays."""
    arrays = tuple(np.ascontiguousarray(a, dtype=np.uint64) for a in (src_ptrs, dst_ptrs, sizes))
    if any(a.ndim != 1 for a in arrays) or not (len(arrays[0]) == len(arrays[1]) == len(arrays[2])):
        raise ValueError(
            "src_ptrs, dst_ptrs and sizes must be 1-D arrays of one length, got shapes "
            f"{[a.shape for a in arrays]}"
        )
    return arrays


def read_descriptor(descriptor: bytes, kind: str, version: int | None = None) -> dict:
    """A peer's `local_descriptor()` bytes, decoded: refused with what to fix when they are not a
    descriptor, come from another backend's agent, or carry another descriptor version."""
    try:
        desc = msgpack.unpackb(descriptor)
        theirs = desc["kind"]
    except Exception as exc:
        raise TransferAgentError(f"not a transfer-agent descriptor: {exc}") from exc
    if theirs != kind:
        raise TransferAgentError(
            f"descriptor is for a {theirs!r} agent, this is the {kind} agent; configure one backend on both sides")
    if version is not None and desc.get("version") != version:
        raise TransferAgentError(f"{kind} descriptor version {desc.get('version')} != {version}; run one pdserve "
                                 "version on both sides")
    return desc


class TransferHandle:
    """An opaque in-flight write; backends subclass it to carry their state."""

    __slots__ = ("remote", "num_bytes", "num_fragments")

    def __init__(self, remote: str, num_bytes: int, num_fragments: int) -> None:
        self.remote = remote
        self.num_bytes = num_bytes
        self.num_fragments = num_fragments


class TransferAgent(abc.ABC):
    """One rank's data-plane endpoint. Not thread-safe: call it from one thread (the executor's)."""

    name: str
    # None: the agent calls its waker on every completion and notification (see the module docstring);
    # seconds: it cannot, and a waiter polls it this often while a write or notification is awaited.
    completion_poll_s: float | None = None

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """Call `wake` whenever a write of ours finishes or a notification arrives (None: stop)."""
        self._waker = wake

    def _wake(self) -> None:
        wake = getattr(self, "_waker", None)
        if wake is not None:
            wake()

    @abc.abstractmethod
    def register_memory(self, region: MemoryRegion) -> None: ...

    @abc.abstractmethod
    def deregister_memory(self, region: MemoryRegion) -> None: ...

    @property
    @abc.abstractmethod
    def registered_regions(self) -> tuple[MemoryRegion, ...]: ...

    @abc.abstractmethod
    def local_descriptor(self) -> bytes:
        """What a peer passes to `load_remote` to write into our registered memory."""

    @abc.abstractmethod
    def load_remote(self, descriptor: bytes) -> str:
        """Load a peer from its descriptor (idempotent); returns the peer's agent name."""

    @abc.abstractmethod
    def invalidate_remote(self, name: str) -> None:
        """Forget a peer; later writes to it raise. Unknown names are ignored."""

    @abc.abstractmethod
    def submit_write(
        self, remote: str, src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray, notification: bytes
    ) -> TransferHandle:
        """Start writing local [src, src+size) to the peer's [dst, dst+size); never blocks on the copy.

        `notification` reaches the peer's `get_notifications` after the data; an empty fragment list
        sends the notification alone.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState: ...

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free a finished handle (DONE or FAILED). Releasing one IN_PROGRESS is an error."""

    @abc.abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender agent name, message)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Deregister everything and drop peers; the agent is unusable afterwards."""


class CopyHandle(TransferHandle):
    """A write that a CPU copy in this process carries out (fake and shm agents)."""

    __slots__ = ("state",)

    def __init__(self, remote: str, num_bytes: int, num_fragments: int) -> None:
        super().__init__(remote, num_bytes, num_fragments)
        self.state = TransferState.IN_PROGRESS

    def run(self, copy, kind: str, wake: Callable[[], None]) -> None:
        """Do the write (`copy()`, which moves the bytes and then notifies), record how it ended, and
        wake the initiator's waiter."""
        try:
            copy()
            self.state = TransferState.DONE
        except Exception:
            logger.exception("%s write of %d bytes to %r failed", kind, self.num_bytes, self.remote)
            self.state = TransferState.FAILED
        wake()


class HostCopyAgent(TransferAgent):
    """The bookkeeping of agents whose writes are CPU copies of host memory (fake, shm).

    It keeps the registered regions (host memory only), the shut-down flag, and `CopyHandle`s,
    which the copy marks DONE or FAILED. A backend sets `kind`, registers its extra per-region
    state around `register_memory`, and implements descriptors, peers, the write itself,
    notifications and `_close` (what its shutdown frees).
    """

    kind: str  # the backend's name, as in its descriptor

    def __init__(self) -> None:
        self._regions = RegionTable()
        self._closed = False

    def register_memory(self, region: MemoryRegion) -> None:
        self._check_host(region)
        self._regions.add(region)

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._regions.remove(region)

    @property
    def registered_regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def poll(self, handle: TransferHandle) -> TransferState:
        assert isinstance(handle, CopyHandle), "a handle from another agent"
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        assert isinstance(handle, CopyHandle), "a handle from another agent"
        if handle.state is TransferState.IN_PROGRESS:
            raise TransferAgentError("cannot release a write that is still in flight; poll until it finishes")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close()
        self._regions = RegionTable()

    @abc.abstractmethod
    def _close(self) -> None:
        """Free what the backend holds (threads, sockets, peers); called once, by `shutdown`."""

    def _check_host(self, region: MemoryRegion) -> None:
        if region.is_device:
            raise TransferAgentError(f"the {self.kind} agent moves host memory only; use the nixl agent for VRAM")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferAgentError(f"agent {self.name!r} is shut down")
