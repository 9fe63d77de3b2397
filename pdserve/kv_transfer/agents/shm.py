"""Shared-memory transfer agent for peers on one host (and machines without NIXL).

The target's registered memory must be shareable, so the engine allocates its KV pool with
`allocate_shared(nbytes)`: an unlinked /dev/shm file mapped into this process, reachable by peers
through /proc/<pid>/fd/<fd>. The agent's descriptor lists
each registered region as (ptr, nbytes, file path, offset in file). The initiator maps the peer's
files and memmoves into them: a one-sided write, the target's CPU does nothing. After the copy the
initiator sends the notification as one datagram to the target's abstract Unix socket, so a
notification always follows its data.

    pool = allocate_shared(num_blocks * slot_bytes)   # SharedBuffer, unlinked when freed
    kv = pool.torch(torch.bfloat16).view(num_blocks, layers, 2, heads, tokens, head_dim)
    agent.register_memory(pool.region)

A descriptor from another host (different hostname or boot id) is refused: the files would not be
the same memory there.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import select
import socket
import threading
import uuid
import weakref
from dataclasses import dataclass

import msgpack
import numpy as np

from pdserve.kv_transfer.agents.base import (
    CopyHandle,
    HostCopyAgent,
    MemoryRegion,
    RegionTable,
    TransferAgentError,
    TransferHandle,
    check_fragments,
    read_descriptor,
)
from pdserve.kv_transfer.agents.memcopy import copy_fragments

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
_DESCRIPTOR_VERSION = 1
# The owner's mapping comes with its pages allocated and its page tables filled, so that no request pays
# the pool's page faults. A peer's mapping of the same pages fills its page tables as it writes, which is
# cheaper than filling them all at first contact.
_MAP_SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): equal only for processes that can map the same /dev/shm files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown"
    return socket.gethostname(), boot_id


class SharedBuffer:
    """An unlinked /dev/shm file mapped read-write; `ptr` is its address in this process.

    Peers open it as /proc/<our pid>/fd/<fd> while we hold the fd (until `free()` or garbage
    collection); the memory itself lives until the last mapping is dropped.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"allocate_shared needs nbytes > 0, got {nbytes}")
        self.nbytes = nbytes
        name = os.path.join(_SHM_DIR, f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # Unlinked at once and reached through our open fd, so nothing is left behind even when
        # this process dies without running finalizers (multiprocessing children skip atexit).
        os.unlink(name)
        try:
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=_MAP_SHARED_POPULATED)
        except BaseException:
            os.close(fd)
            raise
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.inode = os.fstat(fd).st_ino  # fd numbers are reused; the inode tells files apart
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.ptr = int(self._array.ctypes.data)
        self._close_fd = weakref.finalize(self, _close_quietly, fd)
        _ALLOCATIONS[self.ptr] = self

    @property
    def region(self) -> MemoryRegion:
        return MemoryRegion(self.ptr, self.nbytes)

    def numpy(self, dtype=np.uint8) -> np.ndarray:
        return self._array.view(dtype)

    def torch(self, dtype=None):
        """A 1-D torch tensor over the whole buffer (shares memory)."""
        import torch

        return torch.from_numpy(self._array).view(dtype or torch.uint8)

    def free(self) -> None:
        """Stop publishing the buffer (peers that mapped it keep their mapping)."""
        _ALLOCATIONS.pop(self.ptr, None)
        self._close_fd()


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's pages now: a /dev/shm too small for the pool is a clear error here, not a
    SIGBUS at the first write past its end (Docker gives containers 64 MiB unless told --shm-size)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        st = os.statvfs(_SHM_DIR)
        raise MemoryError(
            f"cannot allocate {nbytes / 2**30:.2f} GiB in {_SHM_DIR} for shared KV memory: "
            f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free there ({exc.strerror}). Lower kv_cache_memory_gb "
            f"(or num_kv_blocks), or give {_SHM_DIR} more room (docker run --shm-size)") from None


def allocate_shared(nbytes: int) -> SharedBuffer:
    """Allocate host memory the shm agent can register (use it for the KV pool and staging buffers)."""
    return SharedBuffer(nbytes)


_ALLOCATIONS: "weakref.WeakValueDictionary[int, SharedBuffer]" = weakref.WeakValueDictionary()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _backing_file(region: MemoryRegion) -> tuple[str, int, int]:
    """(path, inode, offset of the region in the file)."""
    for buf in list(_ALLOCATIONS.values()):
        if buf.ptr <= region.ptr and region.ptr + region.nbytes <= buf.ptr + buf.nbytes:
            return buf.path, buf.inode, region.ptr - buf.ptr
    raise TransferAgentError(
        f"region [{region.ptr:#x}, +{region.nbytes}) was not allocated with allocate_shared(); the shm agent "
        "can only register shareable memory (allocate the KV pool with "
        "pdserve.kv_transfer.agents.shm.allocate_shared)"
    )


@dataclass
class _PeerRegion:
    ptr: int
    nbytes: int
    local_ptr: int  # where this region is mapped in this process


class ShmAgent(HostCopyAgent):
    kind = "shm"

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name or f"shm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._host = host_identity()
        self._files: dict[MemoryRegion, tuple[str, int, int]] = {}
        self._peers: dict[str, tuple[RegionTable, list[_PeerRegion], str]] = {}
        self._maps: dict[tuple[str, int], tuple[mmap.mmap, np.ndarray]] = {}
        self._notify_addr = f"\0pdserve-shm-{uuid.uuid4().hex}"
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._inbox.bind(self._notify_addr)
        self._inbox.setblocking(False)
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name=f"{self.name}-copy", daemon=True)
        self._worker.start()
        # Notifications are read as they arrive by a thread that sleeps in poll() on the inbox, so the
        # executor is woken by them (set_waker) instead of polling the socket.
        self._received: list[tuple[str, bytes]] = []
        self._received_lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._reader = threading.Thread(target=self._read_inbox, name=f"{self.name}-inbox", daemon=True)
        self._reader.start()

    # -- memory -------------------------------------------------------------------------------
    def register_memory(self, region: MemoryRegion) -> None:
        self._check_host(region)  # before the backing-file search, whose error would mislead for VRAM
        backing = _backing_file(region)
        super().register_memory(region)
        self._files[region] = backing

    def deregister_memory(self, region: MemoryRegion) -> None:
        super().deregister_memory(region)
        del self._files[region]

    def local_descriptor(self) -> bytes:
        regions = [[r.ptr, r.nbytes, *self._files[r]] for r in self._regions]
        return msgpack.packb(
            {"kind": "shm", "version": _DESCRIPTOR_VERSION, "name": self.name, "host": list(self._host),
             "notify": self._notify_addr, "regions": regions}
        )

    # -- peers --------------------------------------------------------------------------------
    def load_remote(self, descriptor: bytes) -> str:
        desc = read_descriptor(descriptor, "shm", _DESCRIPTOR_VERSION)
        host = tuple(desc["host"])
        if host != self._host:
            raise TransferAgentError(
                f"shm peer {desc['name']!r} is on host {host[0]!r} (boot {host[1]}) but this agent is on "
                f"{self._host[0]!r} (boot {self._host[1]}); shared memory only reaches peers on the same host, "
                "use the nixl backend across hosts"
            )
        name = desc["name"]
        peer_regions = []
        for ptr, nbytes, path, inode, offset in desc["regions"]:
            base = self._map(path, inode, offset + nbytes)
            peer_regions.append(_PeerRegion(ptr, nbytes, base + offset))
        peer_regions.sort(key=lambda r: r.ptr)
        table = RegionTable([MemoryRegion(r.ptr, r.nbytes) for r in peer_regions])
        self._peers[name] = (table, peer_regions, desc["notify"])
        return name

    def invalidate_remote(self, name: str) -> None:
        self._peers.pop(name, None)

    # -- writes -------------------------------------------------------------------------------
    def submit_write(self, remote, src_ptrs, dst_ptrs, sizes, notification: bytes) -> TransferHandle:
        self._check_open()
        src, dst, sz = check_fragments(src_ptrs, dst_ptrs, sizes)
        try:
            table, peer_regions, notify = self._peers[remote]
        except KeyError:
            raise TransferAgentError(f"peer {remote!r} was not loaded; call load_remote(descriptor) first") from None
        local_dst = dst
        if len(sz):
            self._regions.locate(src, sz, "local source")
            idx = table.locate(dst, sz, f"destination on {remote!r}")
            shift = np.array([r.local_ptr - r.ptr for r in peer_regions], dtype=np.int64)
            local_dst = (dst.astype(np.int64) + shift[idx]).astype(np.uint64)
        handle = CopyHandle(remote, int(sz.sum()), len(sz))
        message = msgpack.packb([self.name, bytes(notification)])
        self._jobs.put((handle, local_dst, src, sz, notify, message))
        return handle

    def get_notifications(self) -> list[tuple[str, bytes]]:
        with self._received_lock:
            out, self._received = self._received, []
        return out

    def _close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)
        os.write(self._stop_w, b"x")
        self._reader.join(timeout=30)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        self._inbox.close()
        self._outbox.close()
        self._files.clear()
        self._peers.clear()
        self._maps.clear()  # mmaps close when their last view is dropped

    # -- internals ----------------------------------------------------------------------------
    def _map(self, path: str, inode: int, min_bytes: int) -> int:
        key = (path, inode)
        if key not in self._maps:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise TransferAgentError(f"cannot open peer shm file {path}: {exc}") from exc
            try:
                if os.fstat(fd).st_ino != inode:
                    raise TransferAgentError(f"peer shm file {path} is no longer the registered buffer (freed?)")
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._maps[key] = (mm, np.frombuffer(mm, dtype=np.uint8))
        mm, array = self._maps[key]
        if len(mm) < min_bytes:
            raise TransferAgentError(f"peer shm file {path} holds {len(mm)} bytes, descriptor claims {min_bytes}")
        return int(array.ctypes.data)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handle, dst, src, sz, notify, message = job

            def copy() -> None:
                copy_fragments(dst, src, sz)
                self._outbox.sendto(message, notify)

            handle.run(copy, self.kind, self._wake)

    def _read_inbox(self) -> None:
        poller = select.poll()
        poller.register(self._inbox, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            got = []
            while True:
                try:
                    data = self._inbox.recv(1 << 20)
                except BlockingIOError:
                    break
                try:
                    sender, message = msgpack.unpackb(data)
                    got.append((str(sender), bytes(message)))
                except Exception:
                    logger.warning("shm agent %s dropped a malformed notification (%d bytes)", self.name, len(data))
            if got:
                with self._received_lock:
                    self._received.extend(got)
                self._wake()
