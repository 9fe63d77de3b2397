"""Test support: synthetic instances over numpy memory and a byte-exact transfer oracle.

Reused by the transport and engine tests. The "logical" KV of a prompt is one uint8 tensor

    kv: [num_layers, 2 (K,V), total_kv_heads, num_tokens, head_token_bytes]

(``head_token_bytes = head_dim * element_bytes``). ``scatter_logical_kv`` cuts it into one rank's
pools the way that rank stores it (its PP layers, its TP heads, its layout and block size);
``gather_logical_kv`` reads it back. An oracle transfer scatters into every ctx rank, runs
``plan_write`` for every (ctx, gen) pair with real addresses, copies with ``ctypes.memmove``
and compares each gen rank with the logical KV re-cut to its layout, byte for byte, counting
writes so that every destination byte is written exactly once.

Buffer convention (test-only; the transfer code knows no role names): a view with role {"k"}
or {"v"} holds only K or only V; any other K/V view lists K then V per layer. REPLICATED views
hold ``[tokens_per_block, bytes_per_token]`` per layer, from a logical tensor
``replicated: [num_layers, num_tokens, bytes_per_token]``.

Hybrid models (``ModelShape.recurrent_every``): every layer but each ``recurrent_every``-th is
recurrent and holds a state in a recurrent layer group (id ``num_layer_groups``) of SECTIONED
buffers, one slot per request. Its logical form is ``state[layer][buffer][section]``, a
``[units, unit_bytes]`` uint8 array each; a rank holds its TP share of each section.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from pdserve.kv_transfer.page_table import (
    BufferEntry,
    LayerGroup,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
    Section,
    kv_buffer_index,
    sectioned_bytes,
    page_table_for_block_major_pool,
    page_table_for_layer_major_pools,
)
from pdserve.kv_transfer.rank_info import RankInfo, flat_rank
from pdserve.kv_transfer.write_plan import TransferPlan, plan_write, writers_for

BlockIds = Mapping[int, np.ndarray]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 4
    total_kv_heads: int = 4
    head_dim: int = 4
    element_bytes: int = 2
    num_layer_groups: int = 1  # layer l is in group l % num_layer_groups
    sliding_window: int | None = None  # for groups 1.. (group 0 is full attention)
    replicated_bytes_per_token: int = 0  # > 0 adds a REPLICATED pool per layer group
    # > 0: layers l with l % recurrent_every != recurrent_every - 1 are recurrent (Qwen3.5: 4, three
    # DeltaNet layers, then one attention layer); each has the buffers of state_buffers, each buffer its
    # sections as (units, unit_bytes), e.g. a Mamba2 conv state [x | B | C] and an SSM state [heads].
    recurrent_every: int = 0
    state_buffers: tuple[tuple[tuple[int, int], ...], ...] = (((8, 6), (2, 4), (2, 4)), ((4, 16),))

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent_every > 0 and layer % self.recurrent_every != self.recurrent_every - 1

    @property
    def sections(self) -> tuple[tuple[Section, ...], ...]:
        return tuple(tuple(Section(*sec) for sec in buf) for buf in self.state_buffers)

    @property
    def head_token_bytes(self) -> int:
        return self.head_dim * self.element_bytes


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    layout: MapperKind = MapperKind.HND
    tokens_per_block: int = 16
    pool_kind: str = "block_major"  # or "layer_major" (separate K and V pools)
    layers_per_pp_stage: tuple[int, ...] | None = None
    num_blocks: int = 8
    num_state_slots: int = 4  # recurrent state slots (hybrid models)
    state_pool: str = "layer_major"  # or "slot_major" (every recurrent layer's state of a slot together)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    def stages(self, num_layers: int) -> tuple[int, ...]:
        if self.layers_per_pp_stage is not None:
            return self.layers_per_pp_stage
        base, extra = divmod(num_layers, self.pp)
        return tuple(base + (p < extra) for p in range(self.pp))


@dataclass
class SimRank:
    info: RankInfo
    pools: list[np.ndarray] = field(default_factory=list)  # uint8, pools[i] at page_table.pools[i].base


def rank_coords(topo: Topology, rank: int) -> tuple[int, int, int]:
    """(pp, tp, cp) of a CP-minor flat rank."""
    pp, rest = divmod(rank, topo.tp * topo.cp)
    tp, cp = divmod(rest, topo.cp)
    assert flat_rank(pp, tp, cp, topo.tp, topo.cp) == rank
    return pp, tp, cp


def _rank_layout(topo: Topology, model: ModelShape, rank: int) -> tuple[list[tuple[int, list[int]]], int]:
    """[(group id, global layers of this rank in that group)], kv heads per rank. The recurrent group
    (hybrid models), if this rank has recurrent layers, comes last."""
    pp, _, _ = rank_coords(topo, rank)
    stages = topo.stages(model.num_layers)
    lo = sum(stages[:pp])
    layers = range(lo, lo + stages[pp])
    groups = [(g, [layer for layer in layers if layer % model.num_layer_groups == g and not model.is_recurrent(layer)])
              for g in range(model.num_layer_groups)]
    groups.append((model.num_layer_groups, [layer for layer in layers if model.is_recurrent(layer)]))
    tp_per_dp = topo.tp // topo.dp
    return [(g, ls) for g, ls in groups if ls], max(1, model.total_kv_heads // tp_per_dp)


def pool_sizes(topo: Topology, model: ModelShape, rank: int) -> list[int]:
    """Bytes of each pool of ``rank``, in page-table order (allocate these, then make_rank_info)."""
    groups, heads = _rank_layout(topo, model, rank)
    buffer = heads * topo.tokens_per_block * model.head_token_bytes
    sizes = []
    for g, layers in groups:
        if g == model.num_layer_groups:
            sizes.append(topo.num_state_slots * len(layers) * _state_bytes(topo, model))
            continue
        if topo.pool_kind == "block_major":
            sizes.append(topo.num_blocks * len(layers) * 2 * buffer)
        else:
            sizes += [topo.num_blocks * len(layers) * buffer] * 2
        if model.replicated_bytes_per_token:
            sizes.append(topo.num_blocks * len(layers) * topo.tokens_per_block * model.replicated_bytes_per_token)
    return sizes


def _state_bytes(topo: Topology, model: ModelShape) -> int:
    """Bytes of one recurrent layer's state on a rank: its share of every buffer's sections."""
    return sum(sectioned_bytes(buf, topo.tp // topo.dp) for buf in model.sections)


def _state_view(topo: Topology, model: ModelShape, base: int, num_layers: int,
                pool_index: int) -> tuple[PhysicalPool, PoolView]:
    """The state pool of ``num_layers`` recurrent layers: layer-major (layer l of slot s at
    ``l * num_slots * per_layer + s * per_layer``) or slot-major (``s * layers * per_layer + l * per_layer``)."""
    per_layer, tp = _state_bytes(topo, model), topo.tp // topo.dp
    sizes = [sectioned_bytes(buf, tp) for buf in model.sections]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    slot_major = topo.state_pool == "slot_major"
    entries = tuple(BufferEntry(layer, (layer * per_layer if slot_major else 0) + at, size)
                    for layer in range(num_layers) for at, size in zip(starts, sizes))
    pool = (PhysicalPool(base, num_layers * per_layer, topo.num_state_slots, layer_stride=0) if slot_major
            else PhysicalPool(base, per_layer, topo.num_state_slots))
    return pool, PoolView(pool_index, frozenset({"state"}), entries, MapperKind.SECTIONED, model.sections)


def make_rank_info(
    name: str, topo: Topology, model: ModelShape, rank: int, bases: Sequence[int],
    agent_descriptor: bytes = b"", control_endpoint: str = "tcp://127.0.0.1:0",
) -> RankInfo:
    """RankInfo of ``rank`` whose pools (sized by ``pool_sizes``) start at ``bases``."""
    groups, heads = _rank_layout(topo, model, rank)
    t, bases = topo.tokens_per_block, list(bases)
    pools: list[PhysicalPool] = []
    layer_groups = []
    for g, layers in groups:
        if g == model.num_layer_groups:
            if layers:
                pool, view = _state_view(topo, model, bases.pop(0), len(layers), len(pools))
                pools.append(pool)
                layer_groups.append(LayerGroup(g, tuple(layers), None, (view,), recurrent=True))
            continue
        window = model.sliding_window if g > 0 else None
        args = (topo.num_blocks, len(layers), heads, t, model.head_dim, model.element_bytes, topo.layout, layers)
        if topo.pool_kind == "block_major":
            sub = page_table_for_block_major_pool(bases.pop(0), *args, sliding_window=window, group_id=g)
        else:
            sub = page_table_for_layer_major_pools(bases.pop(0), bases.pop(0), *args, sliding_window=window, group_id=g)
        views = [PoolView(v.pool_index + len(pools), v.role, v.entries) for v in sub.layer_groups[0].views]
        pools += sub.pools
        if model.replicated_bytes_per_token:
            size = t * model.replicated_bytes_per_token
            pools.append(PhysicalPool(bases.pop(0), size, topo.num_blocks))
            entries = tuple(BufferEntry(i, 0, size) for i in range(len(layers)))
            views.append(PoolView(len(pools) - 1, frozenset({"replicated"}), entries, MapperKind.REPLICATED))
        layer_groups.append(LayerGroup(g, tuple(layers), window, tuple(views)))
    pp, tp, cp = rank_coords(topo, rank)
    return RankInfo(
        instance_name=name, rank=rank, tp_size=topo.tp, tp_rank=tp, pp_size=topo.pp, pp_rank=pp,
        cp_size=topo.cp, cp_rank=cp, dp_size=topo.dp, dp_rank=tp // (topo.tp // topo.dp),
        layers_per_pp_stage=topo.stages(model.num_layers), total_kv_heads=model.total_kv_heads,
        kv_heads_per_rank=heads, head_dim=model.head_dim, element_bytes=model.element_bytes,
        tokens_per_block=t, page_table=PageTable(tuple(pools), tuple(layer_groups), topo.layout, t),
        agent_descriptor=agent_descriptor, control_endpoint=control_endpoint,
    )


def make_instance(name: str, topo: Topology, model: ModelShape, fill: int = 0) -> list[SimRank]:
    """Every rank of an instance, in flat-rank order, over numpy memory filled with ``fill``."""
    ranks = []
    for r in range(topo.world_size):
        pools = [np.full(n, fill, dtype=np.uint8) for n in pool_sizes(topo, model, r)]
        ranks.append(SimRank(make_rank_info(name, topo, model, r, [p.ctypes.data for p in pools]), pools))
    return ranks


def logical_kv(model: ModelShape, num_tokens: int, seed: int = 0) -> np.ndarray:
    """Random bytes: [num_layers, 2, total_kv_heads, num_tokens, head_token_bytes] uint8."""
    shape = (model.num_layers, 2, model.total_kv_heads, num_tokens, model.head_token_bytes)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def logical_replicated(model: ModelShape, num_tokens: int, seed: int = 1) -> np.ndarray:
    """Random bytes: [num_layers, num_tokens, replicated_bytes_per_token] uint8."""
    shape = (model.num_layers, num_tokens, model.replicated_bytes_per_token)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)



def _walk(rank: SimRank, block_ids: BlockIds, num_tokens: int):
    """Yield (buffer bytes [size] view, kind, kv index, global layer, heads, tokens [t0, t1), T)."""
    info, pt = rank.info, rank.info.page_table
    t = pt.tokens_per_block
    for g in pt.layer_groups:
        if g.recurrent:
            continue  # per slot, not per block: _walk_state
        ids = np.asarray(block_ids[g.group_id])
        for v in g.views:
            pool, arr = pt.pools[v.pool_index], rank.pools[v.pool_index]
            for local, entries in v.entries_by_layer().items():
                for b, e in enumerate(entries):
                    for i, blk in enumerate(ids[: -(-num_tokens // t)]):
                        if blk < 0:
                            continue
                        off = local * pool.effective_layer_stride + int(blk) * pool.effective_slot_stride + e.offset
                        yield (arr[off: off + e.size], pt.kind_of(v), kv_buffer_index(v, b), g.global_layer_ids[local],
                               info.head_range, (i * t, min(i * t + t, num_tokens)), t)


def logical_state(model: ModelShape, seed: int = 2) -> list[list[list[np.ndarray]]]:
    """Random bytes: state[layer][buffer][section], [units, unit_bytes] uint8 (recurrent layers only;
    [] for the others)."""
    rng = np.random.default_rng(seed)
    return [[[rng.integers(0, 256, size=(sec.units, sec.unit_bytes), dtype=np.uint8) for sec in buf]
             for buf in model.sections] if model.is_recurrent(layer) else [] for layer in range(model.num_layers)]


def _walk_state(rank: SimRank, slot_ids: BlockIds):
    """Yield (section share bytes [n] view, global layer, buffer, section, units [lo, hi)) of the slot."""
    info, pt = rank.info, rank.info.page_table
    for g in pt.layer_groups:
        if not g.recurrent or slot_ids[g.group_id][0] < 0:
            continue
        (slot,) = np.asarray(slot_ids[g.group_id]).tolist()
        for v in g.views:
            pool, arr = pt.pools[v.pool_index], rank.pools[v.pool_index]
            for local, entries in v.entries_by_layer().items():
                for b, (e, sections) in enumerate(zip(entries, v.sections)):
                    at = local * pool.effective_layer_stride + slot * pool.effective_slot_stride + e.offset
                    for i, sec in enumerate(sections):
                        lo, hi = sec.unit_range(info.tp_per_dp, info.tp_local)
                        n = (hi - lo) * sec.unit_bytes
                        yield arr[at: at + n], g.global_layer_ids[local], b, i, (lo, hi)
                        at += n


def scatter_state(rank: SimRank, state: list, slot_ids: BlockIds) -> None:
    """Write the rank's share of the logical state into its slot of each recurrent group."""
    for buf, layer, b, i, (lo, hi) in _walk_state(rank, slot_ids):
        buf[:] = state[layer][b][i][lo:hi].ravel()


def scatter_logical_kv(
    rank: SimRank, kv: np.ndarray, block_ids: BlockIds, num_tokens: int, replicated: np.ndarray | None = None
) -> None:
    """Write tokens [0, num_tokens) of the logical KV into ``rank``'s pools at ``block_ids``."""
    for buf, kind, kvi, layer, (h0, h1), (t0, t1), t in _walk(rank, block_ids, num_tokens):
        n = t1 - t0
        if kind == MapperKind.REPLICATED:
            buf.reshape(t, -1)[:n] = replicated[layer, t0:t1]
        elif kind == MapperKind.HND:
            buf.reshape(h1 - h0, t, -1)[:, :n] = kv[layer, kvi, h0:h1, t0:t1]
        else:
            buf.reshape(t, h1 - h0, -1)[:n] = kv[layer, kvi, h0:h1, t0:t1].transpose(1, 0, 2)


def gather_logical_kv(rank: SimRank, block_ids: BlockIds, num_tokens: int, model: ModelShape) -> np.ndarray:
    """Read the rank's KV back as the logical tensor; bytes it does not hold stay 0."""
    kv = np.zeros((model.num_layers, 2, model.total_kv_heads, num_tokens, model.head_token_bytes), np.uint8)
    for buf, kind, kvi, layer, (h0, h1), (t0, t1), t in _walk(rank, block_ids, num_tokens):
        n = t1 - t0
        if kind == MapperKind.HND:
            kv[layer, kvi, h0:h1, t0:t1] = buf.reshape(h1 - h0, t, -1)[:, :n]
        elif kind == MapperKind.NHD:
            kv[layer, kvi, h0:h1, t0:t1] = buf.reshape(t, h1 - h0, -1)[:n].transpose(1, 0, 2)
    return kv


def execute_plan(plan: TransferPlan) -> None:
    """Do the plan's copies in this process (both sides' memory must live here)."""
    for s, d, n in zip(plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist()):
        ctypes.memmove(d, s, n)


def count_writes(rank: SimRank, plans: Sequence[TransferPlan]) -> list[np.ndarray]:
    """How many fragments of ``plans`` cover each byte of each of ``rank``'s pools."""
    bases = np.array([p.ctypes.data for p in rank.pools], dtype=np.uint64)
    order = np.argsort(bases)
    diffs = [np.zeros(p.size + 1, dtype=np.int64) for p in rank.pools]
    for plan in plans:
        which = order[np.searchsorted(bases[order], plan.dst_ptrs, side="right") - 1]
        for i, diff in enumerate(diffs):
            sel = which == i
            start = (plan.dst_ptrs[sel] - bases[i]).astype(np.int64)
            end = start + plan.sizes[sel].astype(np.int64)
            assert (end <= rank.pools[i].size).all(), "a fragment runs past the end of its pool"
            np.add.at(diff, start, 1)
            np.add.at(diff, end, -1)
    return [np.cumsum(d)[:-1] for d in diffs]


@dataclass
class TransferReport:
    writers: dict[int, list[int]]  # gen rank -> ctx ranks that wrote it
    fragments: dict[tuple[int, int], int]  # (ctx rank, gen rank) -> fragments in the plan


def simulate_transfer(
    ctx: Sequence[SimRank], gen: Sequence[SimRank], model: ModelShape, num_tokens: int,
    ctx_ids: Callable[[RankInfo], BlockIds], gen_ids: Callable[[RankInfo], BlockIds], seed: int = 0,
    copy: Callable[[TransferPlan], None] | None = None,
) -> TransferReport:
    """Oracle: scatter, plan, copy, then assert every gen rank holds its exact re-cut KV.

    ``copy`` moves one plan's bytes (default: a memmove per fragment); a test passes another data path
    (e.g. the bounce path's gather and scatter) to hold it to the same oracle.

    Gen pools must start filled with a sentinel; bytes outside the transferred span must keep it.
    Every ctx rank's ids cover ``ceil(num_tokens / T_ctx)`` blocks (-1 where a CP rank does not
    own the block); gen ids may cover more tokens than that.
    """
    kv = logical_kv(model, num_tokens, seed)
    rep = logical_replicated(model, num_tokens, seed + 1) if model.replicated_bytes_per_token else None
    state = logical_state(model, seed + 2)
    for c in ctx:
        scatter_logical_kv(c, kv, ctx_ids(c.info), num_tokens, rep)
        scatter_state(c, state, ctx_ids(c.info))
    report = TransferReport({}, {})
    for g in gen:
        writers = writers_for(g.info, [c.info for c in ctx])
        before = [p.copy() for p in g.pools]
        plans = []
        for c in ctx:
            plan = plan_write(c.info, g.info, ctx_ids(c.info), gen_ids(g.info))
            assert (plan is not None) == (c.info.rank in writers), f"ctx {c.info.rank} vs writers {writers}"
            if plan is not None:
                (copy or execute_plan)(plan)
                plans.append(plan)
                report.fragments[(c.info.rank, g.info.rank)] = len(plan)
        report.writers[g.info.rank] = writers
        sent = {gid for gid, ids in ctx_ids(ctx[0].info).items() if len(ids) and ids[0] >= 0}
        _check_gen_rank(g, before, plans, kv, rep, state, ctx[0].info.tokens_per_block, num_tokens, gen_ids(g.info),
                        sent)
    return report


def _check_gen_rank(g, before, plans, kv, rep, state, ctx_tpb, num_tokens, ids, sent) -> None:
    t = g.info.tokens_per_block
    recurrent = {lg.group_id for lg in g.info.page_table.layer_groups if lg.recurrent}
    state_ids = {gid: (b if gid in sent else np.full_like(b, -1)) for gid, b in ids.items() if gid in recurrent}
    ids = {gid: b for gid, b in ids.items() if gid not in recurrent}
    # Tokens the transfer covers: the ctx blocks (ctx_tpb each) and the gen blocks overlap.
    covered = {gid: min(-(-num_tokens // ctx_tpb) * ctx_tpb, len(b) * t) for gid, b in ids.items()}
    mask_rank = SimRank(g.info, [np.zeros_like(p) for p in before])
    ones_kv = np.ones((kv.shape[0], 2, kv.shape[2], max(covered.values(), default=0), kv.shape[4]), np.uint8)
    ones_rep = None if rep is None else np.ones((rep.shape[0], ones_kv.shape[3], rep.shape[2]), np.uint8)
    for gid, n in covered.items():
        scatter_logical_kv(mask_rank, ones_kv, {k: (v if k == gid else np.full_like(v, -1)) for k, v in ids.items()},
                           n, ones_rep)
    scatter_state(mask_rank, [[[np.ones_like(sec) for sec in buf] for buf in layer] for layer in state], state_ids)
    want_rank = SimRank(g.info, [np.zeros_like(p) for p in before])
    scatter_logical_kv(want_rank, kv, ids, num_tokens, rep)
    scatter_state(want_rank, state, state_ids)
    counts = count_writes(g, plans)
    for i, (pool, old) in enumerate(zip(g.pools, before)):
        mask = mask_rank.pools[i].astype(bool)
        bad = np.flatnonzero(counts[i] != mask)
        assert bad.size == 0, (
            f"gen rank {g.info.rank} pool {i}: byte {bad[0]} written {counts[i][bad[0]]} times, "
            f"expected {int(mask[bad[0]])}"
        )
        want = np.where(mask, want_rank.pools[i], old)
        bad = np.flatnonzero(pool != want)
        assert bad.size == 0, f"gen rank {g.info.rank} pool {i}: {bad.size} bytes differ, first at {bad[0]}"
