"""One rank's end of the KV exchange: its transfer agent, transceiver and RankInfo.

Every rank of an instance owns a `KVConnector` over its own KV pool. Rank 0 decides *what* moves
(commands in the step spec, identical on every rank and applied in the same order); each rank moves
its own bytes and reports what finished. Rank 0 changes a request's state only once every rank has
reported on it (`TransferTally`), so no rank frees or reads blocks another rank is still writing.

The commands and the report are typed and versioned in wire.py. A `ReceiveKV` carries the
context instance's RankInfos, fetched once by rank 0 off the step loop (`PeerDirectory`), so no rank
ever waits on the network inside a step.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.config import CacheTransceiverConfig
from pdserve.engine.kv.wire import CancelKV, ForgetPeer, KVCommand, RankReport, ReceiveKV, SendKV
from pdserve.kv_transfer.agents import MemoryRegion, make_agent
from pdserve.kv_transfer.agents.faults import FaultyAgent
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.page_table import (BufferEntry, LayerGroup, MapperKind, PhysicalPool, PoolView, Section,
                                           page_table_for_block_major_pool, page_table_for_latent_pool)
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.transceiver import KVTransceiver
from pdserve.kernels.kv_quant import SCHEME, KVScales
from pdserve.parallel.state import ParallelState

log = logging.getLogger(__name__)

LAYER_GROUP = 0  # the full-attention layers (all of a Llama-family model's)
STATE_GROUP = 1  # a hybrid model's recurrent layers: one state slot per request (page_table.LayerGroup.recurrent)


def shared_pool_allocator(backend: str | None):
    """The shm agent can only expose memory it allocated; other backends take any tensor."""
    if backend != "shm":
        return None
    from pdserve.kv_transfer.agents.shm import allocate_shared

    buffers = []  # keep the mappings alive as long as the pool

    def allocate(nbytes: int) -> torch.Tensor:
        buf = allocate_shared(nbytes)
        buffers.append(buf)
        return buf.torch()

    allocate.buffers = buffers
    return allocate


@dataclass(frozen=True)
class KVPoolGeometry:
    """What a rank's KV pool holds, beyond its tensor: the layout, its layers and heads."""

    layout: str  # "HND" or "NHD" (kv_transfer.page_table.MapperKind)
    first_layer: int  # global id of the pool's first layer
    stage_layers: tuple[int, ...]  # layers per pipeline stage
    total_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    tokens_per_block: int
    canary_slots: int = 0  # slots past the cache manager's, kept for the first-contact canary

    kv_layer_ids: tuple[int, ...] | None = None  # global ids of the pool's layers; None: first_layer onwards
    latent: bool = False  # MLA: one latent per token and layer, the same on every TP rank (a REPLICATED pool)
    kv_scales: KVScales | None = None  # an FP8 pool's static scales (kernels/kv_quant.py), in pool layer order

    def __post_init__(self) -> None:
        if self.layout not in MapperKind.__members__:
            raise ValueError(f"KV layout must be HND or NHD, got {self.layout!r}")


@dataclass(frozen=True)
class StateBuffer:
    """One recurrent-state pool of a hybrid model: tensor [num_slots, layers, ...], a slot's layer
    contiguous; each layer's bytes are `sections` (page_table.Section), TP-cut section by section."""

    role: str
    tensor: torch.Tensor
    sections: tuple[Section, ...]


def _recurrent_group(buffers: list[StateBuffer], layer_ids: tuple[int, ...], first_pool: int):
    """The pools and the recurrent layer group of a hybrid model's state (slot-major: every layer of
    a slot together, so a request's state is one run per pool)."""
    pools, views = [], []
    for i, b in enumerate(buffers):
        slots, layers = b.tensor.shape[:2]
        per_layer = b.tensor[0, 0].numel() * b.tensor.element_size()
        pools.append(PhysicalPool(b.tensor.data_ptr(), layers * per_layer, slots, layer_stride=0))
        entries = tuple(BufferEntry(layer, layer * per_layer, per_layer) for layer in range(layers))
        views.append(PoolView(first_pool + i, frozenset({b.role}), entries, MapperKind.SECTIONED, (b.sections,)))
    return pools, LayerGroup(STATE_GROUP, layer_ids, None, tuple(views), recurrent=True)


class KVConnector:
    def __init__(self, cfg: CacheTransceiverConfig, ps: ParallelState, instance_name: str, pool: torch.Tensor,
                 geometry: KVPoolGeometry, state: list[StateBuffer] = (), state_layer_ids: tuple[int, ...] = ()):
        self.ps = ps
        self.agent = make_agent(cfg.backend, name=f"{instance_name}-rank{ps.rank}",
                                nixl_progress_delay_us=cfg.nixl_progress_delay_us)
        if cfg.fault_injection is not None and cfg.fault_injection.active:
            self.agent = FaultyAgent(self.agent, cfg.fault_injection)
        self.regions = [MemoryRegion.of_tensor(t) for t in [pool, *(b.tensor for b in state)]]
        for region in self.regions:
            self.agent.register_memory(region)
        self.tx = KVTransceiver(self.agent, cfg.to_transceiver_config(), host=cfg.host)
        g = geometry
        num_local = pool.shape[1]
        layer_ids = g.kv_layer_ids if g.kv_layer_ids is not None else range(g.first_layer, g.first_layer + num_local)
        if g.latent:
            table = page_table_for_latent_pool(
                base=pool.data_ptr(), num_blocks=pool.shape[0], num_layers=num_local, tokens_per_block=g.tokens_per_block,
                latent_bytes=g.head_dim * pool.element_size(), global_layer_ids=layer_ids)
        else:
            table = page_table_for_block_major_pool(
                base=pool.data_ptr(), num_blocks=pool.shape[0], num_layers=num_local, kv_heads=g.kv_heads_per_rank,
                tokens_per_block=g.tokens_per_block, head_dim=g.head_dim, element_bytes=pool.element_size(),
                layout=MapperKind[g.layout], global_layer_ids=layer_ids)
        self.hybrid = bool(state)
        if self.hybrid:
            pools, group = _recurrent_group(list(state), tuple(state_layer_ids), len(table.pools))
            table = replace(table, pools=table.pools + tuple(pools), layer_groups=table.layer_groups + (group,))
        self.info = RankInfo(
            instance_name=instance_name, rank=ps.rank, tp_size=ps.tp_size, tp_rank=ps.tp_rank, pp_size=ps.pp_size,
            pp_rank=ps.pp_rank, cp_size=1, cp_rank=0, dp_size=1, dp_rank=0, layers_per_pp_stage=g.stage_layers,
            total_kv_heads=g.total_kv_heads, kv_heads_per_rank=g.kv_heads_per_rank, head_dim=g.head_dim,
            element_bytes=pool.element_size(), tokens_per_block=g.tokens_per_block, page_table=table,
            agent_descriptor=self.tx.local_descriptor(), control_endpoint=self.tx.endpoint,
            canary_slots=g.canary_slots, kv_dtype=str(pool.dtype).removeprefix("torch."),
            kv_scale_scheme=SCHEME if g.kv_scales is not None else "none",
            kv_scales=tuple(zip(layer_ids, g.kv_scales.k, g.kv_scales.v)) if g.kv_scales is not None else ())
        self.endpoint: str | None = None  # rank 0's control endpoint: what peers are told
        self._cancelling: set[int] = set()

    def start(self, instance: list[RankInfo]) -> None:
        self.tx.start(self.info, instance)
        self.endpoint = instance[0].control_endpoint

    def apply(self, commands: list[KVCommand]) -> RankReport:
        """Run rank 0's commands, then report what finished on this rank."""
        report = RankReport()
        for cmd in commands:
            try:
                if isinstance(cmd, SendKV):
                    blocks = self._ids(cmd.block_ids, cmd.state_slot)
                    self.tx.respond_and_send_async(cmd.disagg_id, blocks,
                                                   token_range=(cmd.token_start, cmd.token_end), last=cmd.last,
                                                   state=cmd.state)
                elif isinstance(cmd, ReceiveKV):
                    self.tx.add_instance(cmd.ctx_endpoint, cmd.ctx_rank_infos)
                    self.tx.request_and_receive_async(cmd.disagg_id, cmd.ctx_endpoint,
                                                      self._ids(cmd.block_ids, cmd.state_slot),
                                                      ctx_dp_rank=cmd.ctx_dp_rank, timeout_ms=cmd.timeout_ms,
                                                      wait_for_offer=cmd.wait_for_offer)
                elif isinstance(cmd, CancelKV):
                    self._cancelling.add(cmd.disagg_id)
                elif isinstance(cmd, ForgetPeer):
                    self.tx.forget_instance(cmd.ctx_endpoint)
                else:
                    raise AssertionError(f"unknown KV command {cmd!r}")
            except Exception as e:  # fails this command's request only, never the step (and the engine)
                rid = getattr(cmd, "disagg_id", 0)
                if isinstance(e, (KVTransferError, OSError, ValueError)):
                    log.warning("rank %d: KV %s of request %d failed: %s", self.ps.rank, cmd.KIND.name, rid, e)
                else:
                    log.exception("rank %d: KV %s of request %d failed", self.ps.rank, cmd.KIND.name, rid)
                report.failed[rid] = f"{type(e).__name__}: {e}"
        if self.tx.send_sessions:
            r = self.tx.check_context_transfer_status()
            report.done += r.completed
            report.failed.update(r.failed)
        elif self.tx.control_pending:  # REQUEST_DATA ahead of our prefill, CANCELs: read and expire them
            self.tx.poll_control()
        if self.tx.recv_sessions:
            r = self.tx.check_gen_transfer_status()
            report.done += r.completed
            report.failed.update(r.failed)
            report.tokens.update(r.tokens)
            report.states.update(r.states)
            report.unknown += r.unknown
        for rid in list(self._cancelling):
            if self.tx.cancel_request(rid):
                self._cancelling.discard(rid)
                report.cancelled.append(rid)
        return report

    def _ids(self, block_ids: tuple[int, ...], state_slot: int) -> dict[int, np.ndarray]:
        """A command's ids per layer group: the blocks, and a hybrid model's state slot (-1: not this time)."""
        ids = {LAYER_GROUP: np.asarray(block_ids, dtype=np.int64)}
        if self.hybrid:
            ids[STATE_GROUP] = np.array([state_slot], dtype=np.int64)
        return ids

    def close(self) -> None:
        self.tx.close()
        for region in self.regions:
            self.agent.deregister_memory(region)
        self.agent.shutdown()


class PeerDirectory:
    """Rank 0's cache of context instances' RankInfos. A new endpoint is fetched on a helper thread;
    the step loop only polls, so an unreachable peer costs its own requests a timeout, nobody else."""

    def __init__(self, fetch):
        self._fetch = fetch
        self._known: dict[str, list[bytes]] = {}
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-peer-fetch")

    def lookup(self, endpoint: str) -> list[bytes] | Exception | None:
        """The RankInfos, the exception that fetching them raised (reported once), or None: not yet."""
        if endpoint in self._known:
            return self._known[endpoint]
        fut = self._pending.get(endpoint)
        if fut is None:
            self._pending[endpoint] = self._pool.submit(self._fetch, endpoint)
            return None
        if not fut.done():
            return None
        del self._pending[endpoint]
        if fut.exception() is not None:
            return fut.exception()
        self._known[endpoint] = fut.result()
        return self._known[endpoint]

    def forget(self, endpoint: str) -> None:
        self._known.pop(endpoint, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TransferTally:
    """Rank 0's view: a request's transfer is settled once every rank reported it done, failed or
    cancelled. Settled as success only if every rank reported done."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._seen: dict[int, dict[int, str]] = {}  # disagg id -> rank -> "done" | reason
        self.tokens: dict[int, int] = {}  # from rank 0's reports: every rank receives the same prompt
        self.states: dict[int, bytes] = {}
        self.unknown: set[int] = set()  # from any rank: the context side holds no such request

    def add(self, rank: int, report: RankReport) -> None:
        self.unknown.update(report.unknown)
        if rank == 0:
            self.tokens.update(report.tokens)
            self.states.update(report.states)
        for rid in report.done:
            self._seen.setdefault(rid, {})[rank] = "done"
        for rid, reason in report.failed.items():
            self._seen.setdefault(rid, {})[rank] = reason
        for rid in report.cancelled:
            self._seen.setdefault(rid, {}).setdefault(rank, "cancelled")

    def settled(self) -> dict[int, str | None]:
        """disagg id -> None (success) or the failure reason, for every request all ranks reported."""
        out = {}
        for rid, by_rank in list(self._seen.items()):
            if len(by_rank) == self.world_size:
                reasons = [r for r in by_rank.values() if r != "done"]
                out[rid] = reasons[0] if reasons else None
                del self._seen[rid]
        return out
