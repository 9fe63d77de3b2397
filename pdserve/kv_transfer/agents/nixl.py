"""NIXL transfer agent (UCX backend): one-sided RDMA-style writes, host DRAM or CUDA VRAM.

Our descriptor wraps NIXL's agent metadata (which already carries the registered regions and UCX
connection info) with the region list, so the initiator can check fragments and pick each
destination's memory type and device id without asking the target.

The NIXL wheel is `nixl-cu12` (module `nixl_cu12`) or `nixl-cu13` (module `nixl_cu13`); whichever
imports is used.

The progress thread. NIXL's python wrapper starts the UCX backend's progress thread with a delay of 0,
a sched_yield loop that holds a whole core while the agent is idle, which an instance pinned to one core
then shares with its own work (docs/benchmarks.md, "NIXL's progress thread on a small machine").
`progress_delay_us` (cache_transceiver_config.nixl_progress_delay_us, default 1000) is the time the
thread waits between passes; 0 keeps NIXL's own.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import uuid

import msgpack
import numpy as np

from pdserve.kv_transfer.agents.base import (
    MemoryRegion,
    RegionTable,
    TransferAgent,
    TransferAgentError,
    TransferHandle,
    TransferState,
    check_fragments,
    read_descriptor,
)

logger = logging.getLogger(__name__)

_DESCRIPTOR_VERSION = 1
DEFAULT_PROGRESS_DELAY_US = 1000
_CONSTRUCT = threading.Lock()  # _nixl_agent swaps a module attribute for the length of one construction
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.IN_PROGRESS, "ERR": TransferState.FAILED}


def import_nixl():
    """The NIXL python module of whichever wheel is installed; raises a clear error when none is."""
    errors = []
    for module in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise TransferAgentError(
        "the nixl backend needs the NIXL wheel (pip install nixl-cu12 or nixl-cu13); "
        f"none imports ({'; '.join(errors)}). Use the shm backend on one host instead."
    )


class _NixlHandle(TransferHandle):
    __slots__ = ("xfer", "state")

    def __init__(self, remote: str, num_bytes: int, num_fragments: int, xfer, state: TransferState) -> None:
        super().__init__(remote, num_bytes, num_fragments)
        self.xfer = xfer
        self.state = state


def _nixl_agent(nixl, name: str, config, progress_delay_us: int):
    """nixl.nixl_agent(name, config) whose progress thread waits `progress_delay_us` between passes. The
    wrapper builds the native config itself and sets its pthrDelay to 0, with no argument to change it,
    so the native constructor it calls is wrapped for this one call to set the delay first."""
    if progress_delay_us == 0:
        return nixl.nixl_agent(name, config)
    api = sys.modules[nixl.nixl_agent.__module__]
    native = api.nixlBind.nixlAgent

    def construct(agent_name, agent_config):
        agent_config.pthrDelay = progress_delay_us
        return native(agent_name, agent_config)

    with _CONSTRUCT:
        api.nixlBind.nixlAgent = construct
        try:
            return nixl.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = native


# NIXL has no completion event: a waiter polls the agent this often while a write or notification of
# it is awaited. A write's notification leaves only when the initiator polls the write DONE (the UCX
# backend sends it from its status check), so the initiator's polling is on the transfer's path too.
# Busy polling is worse, not better: it starves NIXL's UCX progress thread on small machines.
COMPLETION_POLL_S = 0.0001


class NixlAgent(TransferAgent):
    completion_poll_s = COMPLETION_POLL_S

    def __init__(self, name: str | None = None, backend: str = "UCX",
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> None:
        if progress_delay_us < 0:
            raise ValueError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
        nixl = import_nixl()
        self.name = name or f"nixl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._backend = backend
        config = nixl.nixl_agent_config(backends=[backend])
        self._agent = _nixl_agent(nixl, self.name, config, progress_delay_us)
        if backend not in self._agent.backends:
            raise TransferAgentError(
                f"NIXL backend {backend!r} is not available (plugins: {self._agent.get_plugin_list()})"
            )
        self._regions = RegionTable()
        self._reg_descs: dict[MemoryRegion, object] = {}
        self._peers: dict[str, tuple[bytes, RegionTable]] = {}
        self._closed = False

    # -- memory -------------------------------------------------------------------------------
    def register_memory(self, region: MemoryRegion) -> None:
        self._check_open()
        self._regions.add(region)
        mem_type, dev = _mem_type(region.device_id)
        try:
            descs = self._agent.register_memory([(region.ptr, region.nbytes, dev, "")], mem_type, [self._backend])
        except Exception as exc:
            self._regions.remove(region)
            raise TransferAgentError(f"NIXL could not register {region}: {exc}") from exc
        self._reg_descs[region] = descs

    def deregister_memory(self, region: MemoryRegion) -> None:
        self._regions.remove(region)
        self._agent.deregister_memory(self._reg_descs.pop(region), [self._backend])

    @property
    def registered_regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def local_descriptor(self) -> bytes:
        self._check_open()
        regions = [[r.ptr, r.nbytes, r.device_id] for r in self._regions]
        return msgpack.packb(
            {"kind": "nixl", "version": _DESCRIPTOR_VERSION, "name": self.name,
             "metadata": self._agent.get_agent_metadata(), "regions": regions}
        )

    # -- peers --------------------------------------------------------------------------------
    def load_remote(self, descriptor: bytes) -> str:
        self._check_open()
        desc = read_descriptor(descriptor, "nixl", _DESCRIPTOR_VERSION)
        name, metadata = desc["name"], desc["metadata"]
        known = self._peers.get(name)
        if known is not None and known[0] == metadata:
            return name
        if known is not None:
            self._agent.remove_remote_agent(name)
        loaded = self._agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise TransferAgentError(f"NIXL metadata names agent {loaded!r}, descriptor says {name!r}")
        table = RegionTable([MemoryRegion(p, n, d) for p, n, d in desc["regions"]])
        self._peers[name] = (metadata, table)
        return name

    def invalidate_remote(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            self._agent.remove_remote_agent(name)

    # -- writes -------------------------------------------------------------------------------
    def submit_write(self, remote, src_ptrs, dst_ptrs, sizes, notification: bytes) -> TransferHandle:
        self._check_open()
        src, dst, sz = check_fragments(src_ptrs, dst_ptrs, sizes)
        try:
            _, peer_table = self._peers[remote]
        except KeyError:
            raise TransferAgentError(f"peer {remote!r} was not loaded; call load_remote(descriptor) first") from None
        if len(sz) == 0:
            self._agent.send_notif(remote, bytes(notification))
            return _NixlHandle(remote, 0, 0, None, TransferState.DONE)
        local_type, local_dev = self._side(self._regions, src, sz, "local source")
        remote_type, remote_dev = self._side(peer_table, dst, sz, f"destination on {remote!r}")
        local = self._agent.get_xfer_descs(np.stack([src, sz, local_dev], axis=1), local_type)
        far = self._agent.get_xfer_descs(np.stack([dst, sz, remote_dev], axis=1), remote_type)
        try:
            xfer = self._agent.initialize_xfer("WRITE", local, far, remote, bytes(notification), [self._backend])
            state = _STATES[self._agent.transfer(xfer)]
        except Exception as exc:
            raise TransferAgentError(f"NIXL write of {len(sz)} fragments to {remote!r} failed to start: {exc}") from exc
        return _NixlHandle(remote, int(sz.sum()), len(sz), xfer, state)

    def poll(self, handle: TransferHandle) -> TransferState:
        assert isinstance(handle, _NixlHandle)
        if handle.state is TransferState.IN_PROGRESS:
            handle.state = _STATES[self._agent.check_xfer_state(handle.xfer)]
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        assert isinstance(handle, _NixlHandle)
        if self.poll(handle) is TransferState.IN_PROGRESS:
            raise TransferAgentError("cannot release a write that is still in flight; poll until it finishes")
        if handle.xfer is not None:
            self._agent.release_xfer_handle(handle.xfer)
            handle.xfer = None

    def get_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for sender, messages in self._agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            out.extend((sender, bytes(m)) for m in messages)
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        for name in list(self._peers):
            self.invalidate_remote(name)
        for region in list(self._regions):
            self.deregister_memory(region)
        self._closed = True

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferAgentError(f"agent {self.name!r} is shut down")

    @staticmethod
    def _side(table: RegionTable, ptrs: np.ndarray, sizes: np.ndarray, what: str) -> tuple[str, np.ndarray]:
        idx = table.locate(ptrs, sizes, what)
        devices = np.array([r.device_id for r in table], dtype=np.int64)[idx]
        on_device = devices >= 0
        if on_device.any() and not on_device.all():
            raise TransferAgentError(f"one write mixes host and device {what} fragments; split it by memory type")
        mem_type = "VRAM" if on_device.all() else "DRAM"
        return mem_type, np.maximum(devices, 0).astype(np.uint64)


def _mem_type(device_id: int) -> tuple[str, int]:
    return ("VRAM", device_id) if device_id >= 0 else ("DRAM", 0)
