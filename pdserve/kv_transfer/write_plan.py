"""The write plan: which source rank writes which bytes of which destination rank.

Three questions, answered in order for a (ctx rank, gen rank) pair:

1. Layers -> pools (``_match_views``). A ctx layer group finds the gen layer group holding its
   global layers; hitting two gen groups means the sides group layers differently and fails.
   Inside the group each ctx view pairs with the unique gen view of an equal role whose layers
   overlap; mapper kinds must agree.
2. Ownership (``_elected``). Every destination byte has exactly one writer:
   - K/V pools: the ranks share heads; with head duplication (total_kv_heads < tp) several ctx
     ranks hold the same head and the one at index ``gen.tp_rank % duplication`` inside the
     replica group writes (spread by the peer's dp and tp rank).
   - REPLICATED pools: a fan-in election picks one ctx TP rank among those whose TP slice
     overlaps the gen rank's, spread by the gen's dp rank.
   - SECTIONED pools (recurrent state): each section is elected on its own, as heads are: the ctx
     ranks holding a unit the gen rank holds, and among copies the one at ``gen.tp_rank % copies``.
   - PP: a layer lives in exactly one ctx stage. CP: every CP rank may write; each one only
     passes ids >= 0 for the blocks it holds (-1 = not mine / not this time).
3. Bytes: a mapper (``mappers/``) expands the pair to (src, dst, size) per sub-block, or per slot
   for a recurrent group (one slot id per side: the state after exactly the request's tokens).

All address arithmetic runs on the sender; the receiver only calls ``writers_for``.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from pdserve.kv_transfer.errors import AlignmentError, KVTransferError
from pdserve.kv_transfer.mappers import RegionMapper, build_mapper, merge_contiguous
from pdserve.kv_transfer.mappers.base import PairGeometry
from pdserve.kv_transfer.page_table import LayerGroup, MapperKind, PageTable, PhysicalPool, PoolView
from pdserve.kv_transfer.rank_info import RankInfo, flat_rank

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """One write from a ctx rank into a gen rank: fragment i copies sizes[i] bytes."""

    src_ptrs: np.ndarray  # uint64 absolute addresses on the ctx rank
    dst_ptrs: np.ndarray  # uint64 absolute addresses on the gen rank
    sizes: np.ndarray  # uint64 bytes

    def __post_init__(self) -> None:
        for name in ("src_ptrs", "dst_ptrs", "sizes"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != np.uint64 or a.ndim != 1:
                raise ValueError(f"TransferPlan.{name} must be a 1-D uint64 array")
        if not self.src_ptrs.size == self.dst_ptrs.size == self.sizes.size:
            raise ValueError("TransferPlan arrays differ in length")

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64))

    def __len__(self) -> int:
        return int(self.sizes.size)


@dataclass(frozen=True, eq=False)
class ViewPair:
    """A matched (ctx view, gen view) pair that the ctx rank is elected to write."""

    ctx_group_id: int
    gen_group_id: int
    ctx_pool: PhysicalPool
    gen_pool: PhysicalPool
    role: frozenset[str]
    layers: tuple[int, ...]  # common global layer ids
    mapper: RegionMapper
    units: tuple[tuple[int, int, int, int], ...] = ()  # SECTIONED: (buffer, section, lo, hi) units written

    @property
    def recurrent(self) -> bool:
        return self.mapper.geom.kind == MapperKind.SECTIONED


def overlapping_ranks(info: RankInfo, peer: RankInfo) -> list[int]:
    """Peer ranks (CP-minor flat numbering) whose layers and heads overlap ``info``'s.

    PP: layer ranges intersect. TP: head ranges intersect, in every peer DP group. CP: all.
    Ownership election is not applied; see ``writers_for``.
    """
    lo, hi = info.layer_range
    first = np.cumsum((0,) + peer.layers_per_pp_stage)
    pps = [p for p in range(peer.pp_size) if lo < first[p + 1] and hi > first[p]]
    h_lo, h_hi = info.head_range
    tps = []
    for tp in range(peer.tp_size):
        p_lo = (tp % peer.tp_per_dp) * peer.total_kv_heads // peer.tp_per_dp
        if h_lo < p_lo + peer.kv_heads_per_rank and h_hi > p_lo:
            tps.append(tp)
    return [flat_rank(p, t, c, peer.tp_size, peer.cp_size) for p in pps for t in tps for c in range(peer.cp_size)]


def _check_same_kv_encoding(ctx: RankInfo, gen: RankInfo) -> None:
    """Equal element sizes are not enough: bf16 bytes read as fp16, or FP8 bytes under other scales, are
    plausible wrong values."""
    if ctx.kv_dtype != gen.kv_dtype:
        raise AlignmentError(f"KV cache dtype differs: ctx {ctx.key} stores {ctx.kv_dtype}, gen {gen.key} stores "
                             f"{gen.kv_dtype}; set the same kv_cache_dtype on both instances")
    if ctx.kv_scale_scheme != gen.kv_scale_scheme:
        raise AlignmentError(f"KV scale scheme differs: ctx {ctx.key} has {ctx.kv_scale_scheme}, gen {gen.key} has "
                             f"{gen.kv_scale_scheme}; both instances must run the same pdserve and kv_cache_dtype")
    theirs = {layer: (k, v) for layer, k, v in gen.kv_scales}
    for layer, k, v in ctx.kv_scales:
        if layer in theirs and theirs[layer] != (k, v):
            raise AlignmentError(f"KV scales of layer {layer} differ: ctx {ctx.key} has k_scale={k}, v_scale={v}, gen "
                                 f"{gen.key} has k_scale={theirs[layer][0]}, v_scale={theirs[layer][1]}; both "
                                 "instances must load the same checkpoint")


def _check_same_model(ctx: RankInfo, gen: RankInfo) -> None:
    _check_same_kv_encoding(ctx, gen)
    for name in ("num_layers", "total_kv_heads", "head_dim", "element_bytes"):
        if getattr(ctx, name) != getattr(gen, name):
            raise AlignmentError(
                f"{name} differs: ctx {ctx.key} has {getattr(ctx, name)}, gen {gen.key} has "
                f"{getattr(gen, name)}; both instances must serve the same model and KV dtype"
            )


def _check_tokens_per_block(kind: MapperKind, ctx: RankInfo, gen: RankInfo, label: str) -> None:
    tc, tg = ctx.tokens_per_block, gen.tokens_per_block
    if tc == tg or kind == MapperKind.SECTIONED:  # a recurrent state has no token axis
        return
    if kind in (MapperKind.NHD, MapperKind.REPLICATED):
        raise AlignmentError(
            f"{label}: {kind.name} pools address bytes inside a block, so tokens_per_block must be "
            f"equal, got ctx {tc} and gen {tg}"
        )
    if max(tc, tg) % min(tc, tg):
        raise AlignmentError(f"{label}: tokens_per_block ctx {tc} and gen {tg}: one must divide the other")
    logger.warning(
        "%s: tokens_per_block differs (ctx %d, gen %d); KV transfer proceeds in %d-token sub-blocks",
        label, tc, tg, min(tc, tg),
    )


def _match_views(ctx_table: PageTable, gen_table: PageTable) -> list[tuple[LayerGroup, PoolView, LayerGroup, PoolView]]:
    """Pair every ctx view with its unique gen view (see the module docstring, step 1)."""
    gen_group_of = {layer: g for g in gen_table.layer_groups for layer in g.global_layer_ids}
    pairs = []
    for cg in ctx_table.layer_groups:
        hits = {gen_group_of[layer].group_id: gen_group_of[layer]
                for layer in cg.global_layer_ids if layer in gen_group_of}
        if len(hits) > 1:
            raise AlignmentError(
                f"ctx layer group {cg.group_id} (layers {list(cg.global_layer_ids)}) hits gen layer groups "
                f"{sorted(hits)}; the instances group layers differently, which cannot be aligned"
            )
        if not hits:
            continue
        (gg,) = hits.values()
        if cg.sliding_window != gg.sliding_window:
            raise AlignmentError(
                f"layer group ctx {cg.group_id} / gen {gg.group_id}: sliding_window differs "
                f"(ctx {cg.sliding_window}, gen {gg.sliding_window})"
            )
        for side, (own_g, own_t), (other_g, other_t) in (
            ("ctx", (cg, ctx_table), (gg, gen_table)),
            ("gen", (gg, gen_table), (cg, ctx_table)),
        ):
            for ov in own_g.views:
                layers = set(own_g.view_global_layers(ov)) & set(other_g.global_layer_ids)
                if not layers:
                    continue
                cands = [v for v in other_g.views if v.role == ov.role and layers & set(other_g.view_global_layers(v))]
                if len(cands) != 1:
                    raise AlignmentError(
                        f"{side} layer group {own_g.group_id} pool role {sorted(ov.role)} (layers {sorted(layers)}) "
                        f"matches {len(cands)} pools of the peer's layer group {other_g.group_id} "
                        f"(peer roles: {[sorted(v.role) for v in other_g.views]}); exactly one must match"
                    )
                if own_t.kind_of(ov) != other_t.kind_of(cands[0]):
                    raise AlignmentError(
                        f"pool role {sorted(ov.role)}: mapper kind differs, {side} {own_t.kind_of(ov).name} vs "
                        f"peer {other_t.kind_of(cands[0]).name}; configure the same KV layout on both instances"
                    )
                if side == "ctx":
                    pairs.append((cg, ov, gg, cands[0]))
    return pairs


def _buffer_offsets(group: LayerGroup, view: PoolView, pool: PhysicalPool,
                    layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, buffer): bytes from the slot address and registered size; uint64 [L*B]."""
    by_layer = view.entries_by_layer()
    local = {g: i for i, g in enumerate(group.global_layer_ids)}
    stride = pool.effective_layer_stride
    entries = [(local[g], e) for g in layers for e in by_layer[local[g]]]
    offsets = np.array([layer * stride + e.offset for layer, e in entries], dtype=np.uint64)
    return offsets, np.array([e.size for _, e in entries], dtype=np.uint64)


def _elected(ctx: RankInfo, gen: RankInfo, kind: MapperKind) -> tuple[int, int] | None:
    """Global heads [lo, hi) that ctx writes into gen, or None when it is not elected."""
    if kind == MapperKind.REPLICATED:
        tc, tg = ctx.tp_per_dp, gen.tp_per_dp
        owner = gen.tp_local * tc // tg + gen.dp_rank % max(1, tc // tg)
        return (0, 1) if ctx.tp_local == owner else None
    (c_lo, c_hi), (g_lo, g_hi) = ctx.head_range, gen.head_range
    lo, hi = max(c_lo, g_lo), min(c_hi, g_hi)
    if lo >= hi:
        return None
    dup = ctx.head_duplication
    return (lo, hi) if ctx.tp_local % dup == gen.tp_rank % dup else None


def _section_runs(ctx: RankInfo, gen: RankInfo, cv: PoolView, gv: PoolView,
                  label: str) -> list[list[tuple[int, int, int, int, int, int]]]:
    """Per buffer of a layer: the section runs ctx writes into gen, as (section, lo, hi, src offset,
    dst offset, bytes) with offsets relative to the buffer. Each section is elected on its own: ctx
    writes the units of gen's share it holds, and where several ctx ranks hold a copy of a unit
    (fewer units than ctx TP ranks), the copy at ``gen.tp_rank % copies`` writes."""
    if len(cv.sections) != len(gv.sections):
        raise AlignmentError(f"{label}: {len(cv.sections)} sectioned buffers per layer on ctx, "
                             f"{len(gv.sections)} on gen")
    tc, tg = ctx.tp_per_dp, gen.tp_per_dp
    runs = []
    for b, (c_secs, g_secs) in enumerate(zip(cv.sections, gv.sections)):
        if c_secs != g_secs:
            raise AlignmentError(
                f"{label}: buffer {b} sections differ: ctx {[(x.units, x.unit_bytes) for x in c_secs]}, gen "
                f"{[(x.units, x.unit_bytes) for x in g_secs]} (units, bytes per unit); both instances must serve "
                "the same model with the same state dtype")
        out, c_at, g_at = [], 0, 0
        for i, sec in enumerate(c_secs):
            (c_lo, c_hi), (g_lo, g_hi) = sec.unit_range(tc, ctx.tp_local), sec.unit_range(tg, gen.tp_local)
            lo, hi = max(c_lo, g_lo), min(c_hi, g_hi)
            copies = max(1, tc // sec.units)
            if lo < hi and ctx.tp_local % copies == gen.tp_rank % copies:
                w = sec.unit_bytes
                out.append((i, lo, hi, c_at + (lo - c_lo) * w, g_at + (lo - g_lo) * w, (hi - lo) * w))
            c_at += (c_hi - c_lo) * sec.unit_bytes
            g_at += (g_hi - g_lo) * sec.unit_bytes
        runs.append(out)
    return runs


def _sectioned_geometry(runs: list[list[tuple]], num_layers: int) -> tuple[np.ndarray, ...]:
    """PairGeometry.sections of ``runs`` (per buffer) repeated for each of ``num_layers`` layers."""
    per = len(runs)
    rows = [(layer * per + b, src, dst, size) for layer in range(num_layers)
            for b, buffer_runs in enumerate(runs) for (_, _, _, src, dst, size) in buffer_runs]
    n, src, dst, size = (np.array(col, dtype=np.int64 if k == 0 else np.uint64) for k, col in enumerate(zip(*rows)))
    return n, src, dst, size


@functools.lru_cache(maxsize=4096)
def align(ctx: RankInfo, gen: RankInfo) -> tuple[ViewPair, ...]:
    """Everything ctx writes into gen, as mapped view pairs; empty when it writes nothing."""
    _check_same_model(ctx, gen)
    out = []
    for cg, cv, gg, gv in _match_views(ctx.page_table, gen.page_table):
        kind = ctx.page_table.kind_of(cv)
        label = f"layer group ctx {cg.group_id} -> gen {gg.group_id}, role {sorted(cv.role)}"
        _check_tokens_per_block(kind, ctx, gen, label)
        layers = tuple(sorted(set(cg.view_global_layers(cv)) & set(gg.view_global_layers(gv))))
        if cv.buffers_per_layer != gv.buffers_per_layer and layers:
            raise AlignmentError(
                f"{label}: buffers per layer differ, ctx {cv.buffers_per_layer} vs gen {gv.buffers_per_layer}"
            )
        runs = _section_runs(ctx, gen, cv, gv, label) if kind == MapperKind.SECTIONED and layers else []
        if kind == MapperKind.SECTIONED:
            heads = (0, 1) if any(runs) else None
        else:
            heads = _elected(ctx, gen, kind) if layers else None
        if heads is None:
            continue
        c_pool, g_pool = ctx.page_table.pools[cv.pool_index], gen.page_table.pools[gv.pool_index]
        src_off, src_size = _buffer_offsets(cg, cv, c_pool, layers)
        dst_off, dst_size = _buffer_offsets(gg, gv, g_pool, layers)
        whole = kind in (MapperKind.REPLICATED, MapperKind.SECTIONED)  # no KV heads to slice
        geom = PairGeometry(
            label=label, kind=kind, src_offsets=src_off, dst_offsets=dst_off, src_sizes=src_size,
            dst_sizes=dst_size, src_heads=1 if whole else ctx.kv_heads_per_rank,
            dst_heads=1 if whole else gen.kv_heads_per_rank, head_lo=heads[0], head_hi=heads[1],
            src_tokens_per_block=ctx.tokens_per_block, dst_tokens_per_block=gen.tokens_per_block,
            sections=_sectioned_geometry(runs, len(layers)) if runs else None,
        )
        units = tuple((b, i, lo, hi) for b, buffer_runs in enumerate(runs) for (i, lo, hi, *_) in buffer_runs)
        out.append(ViewPair(cg.group_id, gg.group_id, c_pool, g_pool, cv.role, layers, build_mapper(geom), units))
    return tuple(out)


def _slots(pool: PhysicalPool, ids: np.ndarray, side: str, group_id: int) -> np.ndarray:
    bad = ids[ids >= pool.num_slots]
    if bad.size:
        raise KVTransferError(f"{side} block id {int(bad[0])} of layer group {group_id} is out of range "
                              f"for {pool.num_slots} slots")
    return np.uint64(pool.base) + ids.astype(np.uint64) * np.uint64(pool.effective_slot_stride)


def _block_ids(ids_by_group: Mapping[int, np.ndarray], group_id: int, side: str) -> np.ndarray:
    if group_id not in ids_by_group:
        raise KVTransferError(f"no {side} block ids for layer group {group_id} (got groups {sorted(ids_by_group)})")
    ids = np.asarray(ids_by_group[group_id])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise KVTransferError(f"{side} block ids of layer group {group_id} must be a 1-D integer array")
    return ids.astype(np.int64)


def plan_write(
    ctx: RankInfo,
    gen: RankInfo,
    ctx_block_ids: Mapping[int, np.ndarray],
    gen_block_ids: Mapping[int, np.ndarray],
) -> TransferPlan | None:
    """Fragments ctx writes into gen; None when ctx is not one of ``writers_for(gen, ...)``.

    Block ids are per layer group, in each side's own tokens_per_block; -1 skips a block. A recurrent
    group's ids are one slot id per side (the request's state; -1: not this time).
    Tokens are cut into sub-blocks of ``m = min(T_ctx, T_gen)`` tokens: sub-block ``s`` is token
    ``s*m`` onwards, in ctx block ``s // (T_ctx/m)`` at token ``(s % (T_ctx/m)) * m`` and likewise
    on gen. Sub-blocks run while both id lists cover them and move only where both ids are >= 0,
    so an elected writer whose ids are all -1 returns an empty plan, never None.
    """
    pairs = align(ctx, gen)
    if not pairs:
        return None
    m = min(ctx.tokens_per_block, gen.tokens_per_block)
    rc, rg = ctx.tokens_per_block // m, gen.tokens_per_block // m
    parts = []
    for pair in pairs:
        c_ids = _block_ids(ctx_block_ids, pair.ctx_group_id, "ctx")
        g_ids = _block_ids(gen_block_ids, pair.gen_group_id, "gen")
        if pair.recurrent:
            parts.append(_slot_write(pair, c_ids, g_ids))
            continue
        if rc == rg == 1:  # one block size: sub-block s is block s on both sides, from its token 0
            n = min(c_ids.size, g_ids.size)
            cb, gb = c_ids[:n], g_ids[:n]
            if n and min(int(cb.min()), int(gb.min())) < 0:
                keep = (cb >= 0) & (gb >= 0)
                cb, gb = cb[keep], gb[keep]
            src_tok = dst_tok = None
        else:
            s = np.arange(min(c_ids.size * rc, g_ids.size * rg))
            cb, gb = c_ids[s // rc], g_ids[s // rg]
            keep = (cb >= 0) & (gb >= 0)
            s, cb, gb = s[keep], cb[keep], gb[keep]
            src_tok = ((s % rc) * m).astype(np.uint64)
            dst_tok = ((s % rg) * m).astype(np.uint64)
        parts.append(pair.mapper.map(
            _slots(pair.ctx_pool, cb, "ctx", pair.ctx_group_id), src_tok,
            _slots(pair.gen_pool, gb, "gen", pair.gen_group_id), dst_tok,
        ))
    if len(parts) == 1:
        src, dst, sizes = (a.astype(np.uint64, copy=False) for a in parts[0])
    else:
        src, dst, sizes = (np.concatenate([p[i] for p in parts]).astype(np.uint64, copy=False) for i in range(3))
    return TransferPlan(*merge_contiguous(src, dst, sizes))


def _slot_write(pair: ViewPair, c_ids: np.ndarray, g_ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """A recurrent pair's fragments: the request's one state slot on each side, whole sections of it."""
    for side, ids, group in (("ctx", c_ids, pair.ctx_group_id), ("gen", g_ids, pair.gen_group_id)):
        if ids.size != 1:
            raise KVTransferError(f"{side} ids of recurrent layer group {group} must be one slot id (the request's "
                                  f"state), got {ids.size}")
    if c_ids[0] < 0 or g_ids[0] < 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    zero = np.zeros(1, dtype=np.uint64)
    return pair.mapper.map(_slots(pair.ctx_pool, c_ids, "ctx", pair.ctx_group_id), zero,
                           _slots(pair.gen_pool, g_ids, "gen", pair.gen_group_id), zero)


def writers_for(gen: RankInfo, ctx_ranks: Sequence[RankInfo]) -> list[int]:
    """ctx ranks that write at least one byte into ``gen`` (sorted flat ranks).

    ``ctx_ranks`` are the ranks of the ctx DP group holding the request. Raises AlignmentError
    unless every destination (layer, head) gets exactly one writer per ctx CP rank: a receive
    session is complete when exactly these ranks have reported.
    """
    return list(_writers_for(gen, tuple(ctx_ranks)))


@functools.lru_cache(maxsize=4096)
def _writers_for(gen: RankInfo, ctx_ranks: tuple[RankInfo, ...]) -> tuple[int, ...]:
    if not ctx_ranks:
        raise KVTransferError("writers_for needs the ctx instance's ranks, got none")
    if len({c.instance_name for c in ctx_ranks}) != 1 or len({c.rank for c in ctx_ranks}) != len(ctx_ranks):
        raise KVTransferError(f"ctx ranks must be distinct ranks of one instance, got {[c.key for c in ctx_ranks]}")
    if len({c.dp_rank for c in ctx_ranks}) != 1:
        raise KVTransferError(
            f"ctx ranks span DP groups {sorted({c.dp_rank for c in ctx_ranks})}; pass the ranks of the "
            "one ctx DP group that holds the request"
        )
    cover: Counter[tuple] = Counter()
    writers = []
    for c in ctx_ranks:
        pairs = align(c, gen)
        if pairs:
            writers.append(c.rank)
        for p in pairs:
            g = p.mapper.geom
            # A KV pair covers heads; a SECTIONED pair covers (buffer, section, unit) triples.
            units = ([(b, i, u) for b, i, lo, hi in p.units for u in range(lo, hi)] if p.recurrent
                     else range(g.head_lo, g.head_hi))
            for layer in p.layers:
                for h in units:
                    cover[(p.gen_group_id, p.role, layer, h, c.cp_rank)] += 1
    cp_size = ctx_ranks[0].cp_size
    for gg in gen.page_table.layer_groups:
        for v in gg.views:
            kind = gen.page_table.kind_of(v)
            if kind == MapperKind.SECTIONED:
                heads = [(b, i, u) for b, secs in enumerate(v.sections) for i, sec in enumerate(secs)
                         for u in range(*sec.unit_range(gen.tp_per_dp, gen.tp_local))]
            else:
                heads = range(0, 1) if kind == MapperKind.REPLICATED else range(*gen.head_range)
            for layer in gg.view_global_layers(v):
                for h in heads:
                    for cp in range(cp_size):
                        n = cover[(gg.group_id, v.role, layer, h, cp)]
                        if n != 1:
                            raise AlignmentError(
                                f"gen {gen.key} layer {layer} head {h} (group {gg.group_id}, role {sorted(v.role)}) "
                                f"has {n} writers among ctx cp rank {cp} of ranks {sorted(c.rank for c in ctx_ranks)}; "
                                "expected exactly one (are ctx ranks missing, or do the models differ?)"
                            )
    return tuple(sorted(writers))
