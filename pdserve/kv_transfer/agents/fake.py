"""In-process transfer agent: every "remote" agent lives in this process and a write is a memmove.

It exists so the transceiver protocol can be tested without NIXL or shared memory. It keeps the
real agent contract (region checks on both sides, notification after data) and adds one test hook:
`pause()` keeps submitted writes in flight until `resume()`, so "cancel while a write is in flight"
is deterministic.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import msgpack

from pdserve.kv_transfer.agents.base import (
    CopyHandle,
    HostCopyAgent,
    TransferAgentError,
    TransferHandle,
    check_fragments,
    read_descriptor,
)
from pdserve.kv_transfer.agents.memcopy import copy_fragments

# Agents of this process by name, so a descriptor (which carries only the name) can be resolved.
_REGISTRY: "weakref.WeakValueDictionary[str, FakeAgent]" = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()
_COUNTER = itertools.count()


class _FakeHandle(CopyHandle):
    __slots__ = ("job",)

    def __init__(self, remote: str, num_bytes: int, num_fragments: int, job) -> None:
        super().__init__(remote, num_bytes, num_fragments)
        self.job = job  # the copy and the notification, run when not paused


class FakeAgent(HostCopyAgent):
    kind = "fake"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"fake-{next(_COUNTER)}"
        with _REGISTRY_LOCK:
            if self.name in _REGISTRY:
                raise TransferAgentError(f"a fake agent named {self.name!r} already exists in this process")
            _REGISTRY[self.name] = self
        super().__init__()
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._inbox_lock = threading.Lock()
        self._paused = False
        self._pending: list[_FakeHandle] = []

    # -- peers --------------------------------------------------------------------------------
    def local_descriptor(self) -> bytes:
        return msgpack.packb({"kind": "fake", "name": self.name})

    def load_remote(self, descriptor: bytes) -> str:
        name = read_descriptor(descriptor, "fake")["name"]
        if name not in _REGISTRY:
            raise TransferAgentError(f"fake agent {name!r} does not exist in this process")
        self._peers.add(name)
        return name

    def invalidate_remote(self, name: str) -> None:
        self._peers.discard(name)

    # -- writes -------------------------------------------------------------------------------
    def submit_write(self, remote, src_ptrs, dst_ptrs, sizes, notification: bytes) -> TransferHandle:
        src, dst, sz = check_fragments(src_ptrs, dst_ptrs, sizes)
        peer = self._peer(remote)
        if len(sz):
            self._regions.locate(src, sz, "local source")
            peer._regions.locate(dst, sz, f"destination on {remote!r}")

        def job() -> None:
            copy_fragments(dst, src, sz)
            peer._deliver(self.name, bytes(notification))

        handle = _FakeHandle(remote, int(sz.sum()), len(sz), job)
        if self._paused:
            self._pending.append(handle)
        else:
            self._run(handle)
        return handle

    def get_notifications(self) -> list[tuple[str, bytes]]:
        with self._inbox_lock:
            out, self._inbox = self._inbox, []
        return out

    def _close(self) -> None:
        self.resume()
        self._peers.clear()
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.name) is self:
                del _REGISTRY[self.name]

    # -- test hooks ---------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold every write submitted from now on in flight until `resume()`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        pending, self._pending = self._pending, []
        for handle in pending:
            self._run(handle)

    # -- internals ----------------------------------------------------------------------------
    def _peer(self, remote: str) -> "FakeAgent":
        self._check_open()
        if remote not in self._peers:
            raise TransferAgentError(f"peer {remote!r} was not loaded; call load_remote(descriptor) first")
        peer = _REGISTRY.get(remote)
        if peer is None or peer._closed:
            raise TransferAgentError(f"peer {remote!r} has shut down")
        return peer

    def _run(self, handle: _FakeHandle) -> None:
        job, handle.job = handle.job, None
        handle.run(job, self.kind, self._wake)

    def _deliver(self, sender: str, message: bytes) -> None:
        with self._inbox_lock:
            self._inbox.append((sender, message))
        self._wake()
