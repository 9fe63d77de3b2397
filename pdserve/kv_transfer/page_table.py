"""Page table: one rank's KV storage, described independently of the cache manager.

A rank's storage is a set of physical pools. The payload of (layer, slot) in a pool lives at

    base + layer * layer_stride + slot * slot_stride            (one slot = one KV block)

and a layer group's pool view lists buffer entries ``(local_layer_id, offset, size)``: the bytes
of one buffer (say the K of one layer) start ``offset`` bytes after that payload address.
``local_layer_id`` indexes the layer group's ``global_layer_ids`` and is also the pool's layer
axis. Defaults describe dense layer-major storage (``slot_stride = slot_bytes``,
``layer_stride = num_slots * slot_stride``); a block-major pool (every layer of a block in one
slot) sets ``layer_stride = 0`` and puts the layer into the entry offset.

A *recurrent* layer group (Mamba2, Gated DeltaNet state) has no blocks: a sequence holds one slot of
it, the state after exactly the tokens it has seen, so a request names one slot id per recurrent group
instead of a run of block ids. Its views are SECTIONED: each buffer (say one layer's conv state) is
``[Sec0 | Sec1 | ...]``, each section a run of ``units`` (heads, groups or channels) that TP shards on
its own (``Section``).

Roles are opaque labels compared only by equality: the transfer code knows no role names.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from pdserve.kv_transfer.errors import SchemaError

U32 = 1 << 32
U64 = 1 << 64


class MapperKind(enum.Enum):
    """Byte semantics of a pool's buffers."""

    HND = "hnd"  # each buffer is [kv_heads, tokens_per_block, head_bytes] (head-major)
    NHD = "nhd"  # each buffer is [tokens_per_block, kv_heads, head_bytes] (token-major)
    REPLICATED = "replicated"  # identical bytes on every TP rank; no head slicing
    SECTIONED = "sectioned"  # each buffer [Sec0 | Sec1 | ...], every section TP-sharded on its own (Section)


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < hi:
        raise ValueError(f"{name}={value!r} must be an int in [{lo}, {hi})")


@dataclass(frozen=True)
class BufferEntry:
    """One buffer of one layer inside a slot: ``size`` bytes at ``offset`` (u32, u64, u32)."""

    local_layer_id: int
    offset: int
    size: int

    def __post_init__(self) -> None:
        _check_range("BufferEntry.local_layer_id", self.local_layer_id, 0, U32)
        _check_range("BufferEntry.offset", self.offset, 0, U64)
        _check_range("BufferEntry.size", self.size, 1, U32)


@dataclass(frozen=True)
class Section:
    """One section of a SECTIONED buffer: ``units`` units in the whole model (heads, groups or channels),
    ``unit_bytes`` bytes each. A rank of ``T`` TP ranks (per DP group) holds units
    ``[r * units / T, (r + 1) * units / T)`` when ``units >= T``, else the one unit ``r * units // T``
    (``T / units`` ranks hold a copy), as KV heads are split; its buffer is its sections' shares laid
    end to end:

        rank 0 of 2:  [x: units 0..3 | B: group 0 | C: group 0]      (x: 8 units, B and C: 1 group each)
        rank 1 of 2:  [x: units 4..7 | B: group 0 | C: group 0]
    """

    units: int
    unit_bytes: int

    def __post_init__(self) -> None:
        _check_range("Section.units", self.units, 1, U32)
        _check_range("Section.unit_bytes", self.unit_bytes, 1, U32)

    def local_units(self, tp: int) -> int:
        """Units a rank of ``tp`` TP ranks holds."""
        if self.units >= tp and self.units % tp:
            raise ValueError(f"a section of {self.units} units cannot be split over {tp} TP ranks")
        if self.units < tp and tp % self.units:
            raise ValueError(f"a section of {self.units} units cannot be copied evenly over {tp} TP ranks")
        return max(1, self.units // tp)

    def unit_range(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """The global units [lo, hi) TP rank ``tp_rank`` of ``tp`` holds."""
        if self.units >= tp:
            n = self.units // tp
            return tp_rank * n, (tp_rank + 1) * n
        lo = tp_rank * self.units // tp
        return lo, lo + 1


def sectioned_bytes(sections: tuple[Section, ...], tp: int) -> int:
    """Bytes of one SECTIONED buffer on a rank of ``tp`` TP ranks."""
    return sum(s.local_units(tp) * s.unit_bytes for s in sections)


@dataclass(frozen=True)
class PhysicalPool:
    """Affine view of one allocation over (layer, slot); see the module docstring."""

    base: int
    slot_bytes: int
    num_slots: int
    slot_stride: int | None = None
    layer_stride: int | None = None

    def __post_init__(self) -> None:
        _check_range("PhysicalPool.base", self.base, 0, U64)
        _check_range("PhysicalPool.slot_bytes", self.slot_bytes, 1, U64)
        _check_range("PhysicalPool.num_slots", self.num_slots, 1, U64)
        if self.slot_stride is not None:
            _check_range("PhysicalPool.slot_stride", self.slot_stride, self.slot_bytes, U64)
        if self.layer_stride is not None:
            _check_range("PhysicalPool.layer_stride", self.layer_stride, 0, U64)

    @property
    def effective_slot_stride(self) -> int:
        return self.slot_bytes if self.slot_stride is None else self.slot_stride

    @property
    def effective_layer_stride(self) -> int:
        if self.layer_stride is None:
            return self.num_slots * self.effective_slot_stride
        return self.layer_stride


@dataclass(frozen=True)
class PoolView:
    """A layer group's buffers inside one physical pool.

    ``mapper_kind`` overrides the page table's kind for this view (e.g. a REPLICATED side
    cache next to HND K/V pools); ``None`` inherits it.
    """

    pool_index: int
    role: frozenset[str]
    entries: tuple[BufferEntry, ...]
    mapper_kind: MapperKind | None = None
    # SECTIONED views: the sections of each of a layer's buffers, in buffer order (sections[b] for buffer b)
    sections: tuple[tuple[Section, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", frozenset(self.role))
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "sections", tuple(tuple(b) for b in self.sections))
        _check_range("PoolView.pool_index", self.pool_index, 0, U32)
        if not self.entries:
            raise ValueError(f"PoolView of pool {self.pool_index} role {sorted(self.role)} has no entries")
        if not all(isinstance(r, str) for r in self.role):
            raise ValueError(f"PoolView.role must hold strings, got {sorted(map(repr, self.role))}")
        # Checked per layer, not total % layers: 1 + 3 entries over two layers divides evenly
        # yet would make head-slicing mappers cut every layer at the wrong offsets.
        counts = Counter(e.local_layer_id for e in self.entries)
        if len(set(counts.values())) != 1:
            raise ValueError(
                f"PoolView of pool {self.pool_index} role {sorted(self.role)}: buffer entries are not "
                f"evenly distributed per layer (entries per local layer: {dict(sorted(counts.items()))}); "
                "register the same number of buffers for every layer"
            )

    @property
    def buffers_per_layer(self) -> int:
        return len(self.entries) // len({e.local_layer_id for e in self.entries})

    def entries_by_layer(self) -> dict[int, list[BufferEntry]]:
        """local layer id -> that layer's entries, in registration order (the buffer index)."""
        by_layer: dict[int, list[BufferEntry]] = {}
        for e in self.entries:
            by_layer.setdefault(e.local_layer_id, []).append(e)
        return by_layer


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one block table (e.g. all full-attention layers, or all SWA layers)."""

    group_id: int
    global_layer_ids: tuple[int, ...]
    sliding_window: int | None
    views: tuple[PoolView, ...]
    recurrent: bool = False  # one slot per sequence (its state), not blocks: see the module docstring

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_layer_ids", tuple(self.global_layer_ids))
        object.__setattr__(self, "views", tuple(self.views))
        _check_range("LayerGroup.group_id", self.group_id, 0, U32)
        if not self.global_layer_ids or len(set(self.global_layer_ids)) != len(self.global_layer_ids):
            raise ValueError(
                f"LayerGroup {self.group_id}: global_layer_ids {self.global_layer_ids} must be non-empty and unique"
            )
        for g in self.global_layer_ids:
            _check_range(f"LayerGroup {self.group_id} global layer id", g, 0, U32)
        if self.sliding_window is not None:
            _check_range(f"LayerGroup {self.group_id} sliding_window", self.sliding_window, 1, U64)
            if self.recurrent:
                raise ValueError(f"LayerGroup {self.group_id}: a recurrent group has no sliding window")
        if not self.views:
            raise ValueError(f"LayerGroup {self.group_id} has no pool views")
        for v in self.views:
            bad = [e.local_layer_id for e in v.entries if e.local_layer_id >= len(self.global_layer_ids)]
            if bad:
                raise ValueError(
                    f"LayerGroup {self.group_id}: local_layer_id {bad[0]} is out of range for "
                    f"{len(self.global_layer_ids)} layers"
                )

    def view_global_layers(self, view: PoolView) -> list[int]:
        return sorted({self.global_layer_ids[e.local_layer_id] for e in view.entries})


@dataclass(frozen=True)
class PageTable:
    """Everything a peer needs to address this rank's KV bytes."""

    pools: tuple[PhysicalPool, ...]
    layer_groups: tuple[LayerGroup, ...]
    mapper_kind: MapperKind
    tokens_per_block: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        if not isinstance(self.mapper_kind, MapperKind):
            raise ValueError(f"PageTable.mapper_kind must be a MapperKind, got {self.mapper_kind!r}")
        _check_range("PageTable.tokens_per_block", self.tokens_per_block, 1, U32)
        if not self.pools or not self.layer_groups:
            raise ValueError("PageTable needs at least one pool and one layer group")
        ids = [g.group_id for g in self.layer_groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"PageTable: duplicate layer group ids {ids}")
        seen: dict[int, int] = {}
        for g in self.layer_groups:
            for layer in g.global_layer_ids:
                if layer in seen:
                    raise ValueError(f"PageTable: global layer {layer} is in layer groups "
                                     f"{seen[layer]} and {g.group_id}")
                seen[layer] = g.group_id
            for v in g.views:
                if v.pool_index >= len(self.pools):
                    raise ValueError(
                        f"LayerGroup {g.group_id}: pool_index {v.pool_index} out of range for {len(self.pools)} pools"
                    )
                sectioned = self.kind_of(v) == MapperKind.SECTIONED
                if sectioned != g.recurrent or sectioned != bool(v.sections):
                    raise ValueError(
                        f"LayerGroup {g.group_id} role {sorted(v.role)}: a recurrent group's views are SECTIONED "
                        f"with sections, and only theirs (recurrent={g.recurrent}, "
                        f"kind {self.kind_of(v).name}, {len(v.sections)} section lists)"
                    )

    def group(self, group_id: int) -> LayerGroup:
        for g in self.layer_groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"no layer group {group_id}; this page table has {[g.group_id for g in self.layer_groups]}")

    def kind_of(self, view: PoolView) -> MapperKind:
        return self.mapper_kind if view.mapper_kind is None else view.mapper_kind

    @property
    def global_layer_ids(self) -> list[int]:
        return sorted(layer for g in self.layer_groups for layer in g.global_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pools": [[p.base, p.slot_bytes, p.num_slots, p.slot_stride, p.layer_stride] for p in self.pools],
            "layer_groups": [
                {
                    "group_id": g.group_id,
                    "global_layer_ids": list(g.global_layer_ids),
                    "sliding_window": g.sliding_window,
                    "recurrent": g.recurrent,
                    "views": [
                        {
                            "pool_index": v.pool_index,
                            "role": sorted(v.role),
                            "mapper_kind": None if v.mapper_kind is None else v.mapper_kind.value,
                            "entries": [[e.local_layer_id, e.offset, e.size] for e in v.entries],
                            "sections": [[[s.units, s.unit_bytes] for s in b] for b in v.sections],
                        }
                        for v in g.views
                    ],
                }
                for g in self.layer_groups
            ],
            "mapper_kind": self.mapper_kind.value,
            "tokens_per_block": self.tokens_per_block,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PageTable:
        try:
            _require_keys(d, {"pools", "layer_groups", "mapper_kind", "tokens_per_block"}, "PageTable")
            groups = []
            for gd in d["layer_groups"]:
                _require_keys(gd, {"group_id", "global_layer_ids", "sliding_window", "recurrent", "views"},
                              "LayerGroup")
                views = []
                for vd in gd["views"]:
                    _require_keys(vd, {"pool_index", "role", "mapper_kind", "entries", "sections"}, "PoolView")
                    kind = None if vd["mapper_kind"] is None else MapperKind(vd["mapper_kind"])
                    entries = tuple(BufferEntry(*e) for e in vd["entries"])
                    sections = tuple(tuple(Section(*s) for s in b) for b in vd["sections"])
                    views.append(PoolView(vd["pool_index"], frozenset(vd["role"]), entries, kind, sections))
                if not isinstance(gd["recurrent"], bool):
                    raise ValueError(f"LayerGroup.recurrent must be a bool, got {gd['recurrent']!r}")
                groups.append(LayerGroup(gd["group_id"], tuple(gd["global_layer_ids"]), gd["sliding_window"],
                                         tuple(views), gd["recurrent"]))
            pools = tuple(PhysicalPool(*p) for p in d["pools"])
            return cls(pools, tuple(groups), MapperKind(d["mapper_kind"]), d["tokens_per_block"])
        except (TypeError, ValueError, KeyError) as exc:
            raise SchemaError(f"malformed page table: {exc}") from exc


def _require_keys(d: Any, keys: set[str], what: str) -> None:
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise SchemaError(f"{what} fields {got} differ from the expected {sorted(keys)}")


def kv_buffer_index(view: PoolView, buffer: int) -> int:
    """0 (K) or 1 (V) for buffer `buffer` of a layer in `view`, by the convention of the builders below: a
    view whose role is exactly {"k"} or {"v"} holds only that; any other lists K then V per layer. For
    code that reads KV by its meaning (the canary, test oracles); the transfer itself never needs it."""
    if view.role == frozenset({"v"}):
        return 1
    return 0 if view.role == frozenset({"k"}) else buffer


def page_table_for_block_major_pool(
    base: int,
    num_blocks: int,
    num_layers: int,
    kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
    element_bytes: int,
    layout: MapperKind,
    global_layer_ids: Iterable[int],
    role: frozenset[str] = frozenset({"kv"}),
    sliding_window: int | None = None,
    group_id: int = 0,
) -> PageTable:
    """Page table of the engine's single block-major pool.

    pool: [num_blocks, num_layers, 2 (K,V), kv_heads, tokens_per_block, head_dim]  (HND)
          [num_blocks, num_layers, 2 (K,V), tokens_per_block, kv_heads, head_dim]  (NHD)
    One slot is one block holding every local layer's K and V, so the layer lives in the
    entry offset (layer_stride = 0) and entry ``2*l + kv`` is layer ``l``'s K (kv=0) or V (kv=1).
    """
    if layout not in (MapperKind.HND, MapperKind.NHD):
        raise ValueError(f"layout must be MapperKind.HND or MapperKind.NHD, got {layout!r}")
    layers = tuple(global_layer_ids)
    if len(layers) != num_layers:
        raise ValueError(f"global_layer_ids has {len(layers)} ids but num_layers={num_layers}")
    buffer_bytes = kv_heads * tokens_per_block * head_dim * element_bytes
    slot_bytes = num_layers * 2 * buffer_bytes
    entries = tuple(BufferEntry(layer, (2 * layer + kv) * buffer_bytes, buffer_bytes)
                    for layer in range(num_layers) for kv in (0, 1))
    pool = PhysicalPool(base, slot_bytes, num_blocks, slot_stride=slot_bytes, layer_stride=0)
    group = LayerGroup(group_id, layers, sliding_window, (PoolView(0, role, entries),))
    return PageTable((pool,), (group,), layout, tokens_per_block)


def page_table_for_layer_major_pools(
    k_base: int,
    v_base: int,
    num_blocks: int,
    num_layers: int,
    kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
    element_bytes: int,
    layout: MapperKind,
    global_layer_ids: Iterable[int],
    sliding_window: int | None = None,
    group_id: int = 0,
) -> PageTable:
    """Page table of separate layer-major K and V pools (roles {"k"} and {"v"}).

    each pool: [num_layers, num_blocks, kv_heads, tokens_per_block, head_dim]  (HND; NHD swaps H/T)
    """
    layers = tuple(global_layer_ids)
    if len(layers) != num_layers:
        raise ValueError(f"global_layer_ids has {len(layers)} ids but num_layers={num_layers}")
    buffer_bytes = kv_heads * tokens_per_block * head_dim * element_bytes
    entries = tuple(BufferEntry(layer, 0, buffer_bytes) for layer in range(num_layers))
    pools = (PhysicalPool(k_base, buffer_bytes, num_blocks), PhysicalPool(v_base, buffer_bytes, num_blocks))
    views = (PoolView(0, frozenset({"k"}), entries), PoolView(1, frozenset({"v"}), entries))
    return PageTable(pools, (LayerGroup(group_id, layers, sliding_window, views),), layout, tokens_per_block)


def page_table_for_latent_pool(
    base: int,
    num_blocks: int,
    num_layers: int,
    tokens_per_block: int,
    latent_bytes: int,
    global_layer_ids: Iterable[int],
    role: frozenset[str] = frozenset({"latent"}),
    group_id: int = 0,
) -> PageTable:
    """Page table of the engine's block-major pool of MLA latents (models/mla.py), REPLICATED: every TP rank
    keeps the same bytes, so a destination takes them whole from one elected source rank.

    pool: [num_blocks, num_layers, tokens_per_block, latent_bytes]
    One slot is one block; entry ``l`` is layer ``l``'s latents, ``[tokens_per_block, latent_bytes]``.
    """
    layers = tuple(global_layer_ids)
    if len(layers) != num_layers:
        raise ValueError(f"global_layer_ids has {len(layers)} ids but num_layers={num_layers}")
    buffer_bytes = tokens_per_block * latent_bytes
    entries = tuple(BufferEntry(layer, layer * buffer_bytes, buffer_bytes) for layer in range(num_layers))
    pool = PhysicalPool(base, num_layers * buffer_bytes, num_blocks, slot_stride=num_layers * buffer_bytes,
                        layer_stride=0)
    view = PoolView(0, role, entries, MapperKind.REPLICATED)
    return PageTable((pool,), (LayerGroup(group_id, layers, None, (view,)),), MapperKind.REPLICATED, tokens_per_block)
