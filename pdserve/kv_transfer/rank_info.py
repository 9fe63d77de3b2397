"""RankInfo: what one rank tells its peers about itself (topology, geometry, page table).

Ranks inside an instance are numbered CP-minor: ``rank = pp*(tp*cp) + tp_rank*cp + cp_rank``
(a TP-minor formula mis-routes when tp > 1 and cp > 1). Attention data parallelism splits the
``tp_size`` ranks of a stage into ``dp_size`` groups of ``tp_size // dp_size`` ranks;
``dp_rank = tp_rank // (tp_size // dp_size)`` and KV heads are sharded within a DP group.

Heads: with ``K = total_kv_heads`` and ``T = tp_per_dp``, a rank holds ``K // T`` heads when
``K >= T`` and one head otherwise (then ``T // K`` ranks hold a copy of the same head).

Serialized with msgpack (never pickle) with a version field; a version or schema mismatch raises
SchemaError.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from pdserve.kv_transfer.errors import SchemaError
from pdserve.kv_transfer.page_table import PageTable, sectioned_bytes


def flat_rank(pp_rank: int, tp_rank: int, cp_rank: int, tp_size: int, cp_size: int) -> int:
    """CP-minor flat rank, the numbering shared by the engine and the transceiver."""
    return pp_rank * (tp_size * cp_size) + tp_rank * cp_size + cp_rank


@dataclass(frozen=True)
class RankInfo:
    instance_name: str
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    layers_per_pp_stage: tuple[int, ...]  # layer counts per PP stage; sums to the model's layers
    total_kv_heads: int  # the model's unique KV heads
    kv_heads_per_rank: int
    head_dim: int
    element_bytes: int
    tokens_per_block: int
    page_table: PageTable
    agent_descriptor: bytes  # opaque, from the transfer agent
    control_endpoint: str  # "tcp://host:port" of this rank's ZeroMQ listener
    canary_slots: int = 0  # the last slots of every block pool, kept free for the first-contact canary (canary.py)
    # What a KV byte means; both sides must agree (write_plan refuses a mismatch at first contact).
    kv_dtype: str = "unspecified"  # the KV pools' torch dtype name: "bfloat16", "float8_e4m3fn", ...
    kv_scale_scheme: str = "none"  # "none", or "per_tensor_static" (an FP8 pool: kernels/kv_quant.py)
    kv_scales: tuple[tuple[int, float, float], ...] = ()  # (global layer, k_scale, v_scale) per scaled KV layer

    VERSION: ClassVar[int] = 4  # bumped with any change of fields: from_bytes refuses another version

    def __hash__(self) -> int:
        # RankInfos key the write plan's caches on every request, and hashing the whole page table
        # on every lookup is slow, so the (immutable) hash is computed once. It is not pickled
        # (__getstate__): string hashes differ between processes.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers_per_pp_stage", tuple(self.layers_per_pp_stage))
        try:
            scales = tuple((int(layer), float(k), float(v)) for layer, k, v in self.kv_scales)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"RankInfo.kv_scales must be (layer, k_scale, v_scale) triples: {exc}") from None
        object.__setattr__(self, "kv_scales", scales)
        for f in fields(self):
            want = {"str": str, "int": int, "bytes": bytes, "PageTable": PageTable}.get(f.type)
            value = getattr(self, f.name)
            if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
                raise ValueError(f"RankInfo.{f.name} must be {f.type}, got {type(value).__name__}")
        for name, size, rank in (("tp", self.tp_size, self.tp_rank), ("pp", self.pp_size, self.pp_rank),
                                 ("cp", self.cp_size, self.cp_rank), ("dp", self.dp_size, self.dp_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"RankInfo {self.instance_name}: {name}_rank={rank} "
                                 f"out of range for {name}_size={size}")
        expected = flat_rank(self.pp_rank, self.tp_rank, self.cp_rank, self.tp_size, self.cp_size)
        if self.rank != expected:
            raise ValueError(
                f"RankInfo {self.instance_name}: rank={self.rank} but CP-minor numbering "
                f"pp*(tp*cp)+tp*cp+cp gives {expected} for pp={self.pp_rank} tp={self.tp_rank} cp={self.cp_rank}"
            )
        if self.tp_size % self.dp_size:
            raise ValueError(f"RankInfo {self.instance_name}: tp_size={self.tp_size} "
                             f"is not a multiple of dp_size={self.dp_size}")
        if self.dp_rank != self.tp_rank // self.tp_per_dp:
            raise ValueError(
                f"RankInfo {self.instance_name}: dp_rank={self.dp_rank} but tp_rank={self.tp_rank} "
                f"belongs to DP group {self.tp_rank // self.tp_per_dp} (tp_per_dp={self.tp_per_dp})"
            )
        if len(self.layers_per_pp_stage) != self.pp_size or min(self.layers_per_pp_stage) < 1:
            raise ValueError(
                f"RankInfo {self.instance_name}: layers_per_pp_stage={self.layers_per_pp_stage} needs "
                f"pp_size={self.pp_size} positive counts"
            )
        k, t = self.total_kv_heads, self.tp_per_dp
        if k < 1 or (k % t if k >= t else t % k):
            raise ValueError(
                f"RankInfo {self.instance_name}: total_kv_heads={k} and tp_per_dp={t}: one must divide the other"
            )
        if self.kv_heads_per_rank != max(1, k // t):
            raise ValueError(
                f"RankInfo {self.instance_name}: kv_heads_per_rank={self.kv_heads_per_rank} but "
                f"total_kv_heads={k} over tp_per_dp={t} gives {max(1, k // t)}"
            )
        if self.head_dim < 1 or self.element_bytes < 1:
            raise ValueError(f"RankInfo {self.instance_name}: head_dim and element_bytes must be positive")
        if self.tokens_per_block != self.page_table.tokens_per_block:
            raise ValueError(
                f"RankInfo {self.instance_name}: tokens_per_block={self.tokens_per_block} but the page table "
                f"says {self.page_table.tokens_per_block}"
            )
        pt = self.page_table  # the canary uses block pools only; a recurrent group's state pools keep none
        smallest = min((pt.pools[v.pool_index].num_slots for g in pt.layer_groups if not g.recurrent for v in g.views),
                       default=None)
        if smallest is not None and not 0 <= self.canary_slots < smallest:
            raise ValueError(f"RankInfo {self.instance_name}: canary_slots={self.canary_slots} must be in "
                             f"[0, {smallest}) (the smallest block pool's slots)")
        self._check_sections()
        lo, hi = self.layer_range
        outside = [layer for layer in self.page_table.global_layer_ids if not lo <= layer < hi]
        if outside:
            raise ValueError(
                f"RankInfo {self.instance_name} rank {self.rank}: page table layers {outside} lie outside "
                f"PP stage {self.pp_rank}'s layers [{lo}, {hi})"
            )

    def _check_sections(self) -> None:
        """Every SECTIONED buffer holds exactly this rank's share of its sections (Section.local_units)."""
        for g in self.page_table.layer_groups:
            if g.recurrent and self.cp_size > 1:
                raise ValueError(f"RankInfo {self.instance_name}: recurrent layer group {g.group_id} with "
                                 f"cp_size={self.cp_size}; a recurrent state cannot be split over context-parallel "
                                 "ranks")
            for v in g.views:
                for layer, entries in v.entries_by_layer().items() if v.sections else ():
                    for b, (e, sections) in enumerate(zip(entries, v.sections)):
                        want = sectioned_bytes(sections, self.tp_per_dp)
                        if e.size != want:
                            raise ValueError(
                                f"RankInfo {self.instance_name} rank {self.rank}: layer group {g.group_id} role "
                                f"{sorted(v.role)} local layer {layer} buffer {b} has {e.size} bytes, but its "
                                f"sections {[(s.units, s.unit_bytes) for s in sections]} over "
                                f"tp_per_dp={self.tp_per_dp} give {want}")

    @property
    def key(self) -> tuple[str, int]:
        return (self.instance_name, self.rank)

    @property
    def tp_per_dp(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def tp_local(self) -> int:
        """TP index inside this rank's DP group (the index heads are sharded by)."""
        return self.tp_rank % self.tp_per_dp

    @property
    def head_duplication(self) -> int:
        """How many ranks of a DP group hold a copy of each head (1 = no duplication)."""
        return max(1, self.tp_per_dp // self.total_kv_heads)

    @property
    def head_range(self) -> tuple[int, int]:
        """[first, end) of the model's global KV heads this rank holds."""
        first = self.tp_local * self.total_kv_heads // self.tp_per_dp
        return first, first + self.kv_heads_per_rank

    @property
    def layer_range(self) -> tuple[int, int]:
        """[first, end) global layers of this rank's PP stage."""
        first = sum(self.layers_per_pp_stage[: self.pp_rank])
        return first, first + self.layers_per_pp_stage[self.pp_rank]

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_pp_stage)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["layers_per_pp_stage"] = list(self.layers_per_pp_stage)
        d["page_table"] = self.page_table.to_dict()
        return d

    def to_bytes(self) -> bytes:
        return msgpack.packb({"version": self.VERSION, "rank_info": self.to_dict()}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> RankInfo:
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise SchemaError(f"RankInfo bytes are not valid msgpack: {exc}") from exc
        if not isinstance(msg, dict) or set(msg) != {"version", "rank_info"}:
            raise SchemaError("RankInfo message must be a map with exactly 'version' and 'rank_info'")
        if msg["version"] != cls.VERSION:
            raise SchemaError(
                f"RankInfo version {msg['version']!r} differs from this build's {cls.VERSION}; "
                "run the same pdserve version on both instances"
            )
        d = msg["rank_info"]
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            got = set(d) if isinstance(d, dict) else set()
            raise SchemaError(
                f"RankInfo schema mismatch: missing {sorted(names - got)}, unexpected {sorted(got - names)}"
            )
        d = dict(d, page_table=PageTable.from_dict(d["page_table"]),
                 layers_per_pp_stage=tuple(d["layers_per_pp_stage"]))
        try:
            return cls(**d)
        except (TypeError, ValueError) as exc:
            raise SchemaError(f"RankInfo fields are invalid: {exc}") from exc
