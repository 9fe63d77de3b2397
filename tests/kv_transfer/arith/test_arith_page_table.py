"""Page table and RankInfo: validation on construction and msgpack round trips."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
from factories import info

from pdserve.kv_transfer import (
    BufferEntry,
    LayerGroup,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
    RankInfo,
    SchemaError,
    page_table_for_block_major_pool,
)
from pdserve.testing.kv_oracle import ModelShape, Topology


def test_block_major_builder_geometry():
    t = page_table_for_block_major_pool(4096, 10, 3, 2, 16, 8, 2, MapperKind.NHD, [5, 6, 7])
    (pool,) = t.pools
    buffer = 2 * 16 * 8 * 2
    assert (pool.base, pool.slot_bytes, pool.num_slots) == (4096, 3 * 2 * buffer, 10)
    assert pool.effective_slot_stride == pool.slot_bytes and pool.effective_layer_stride == 0
    (g,) = t.layer_groups
    assert g.global_layer_ids == (5, 6, 7)
    assert [(e.local_layer_id, e.offset, e.size) for e in g.views[0].entries[:3]] == [
        (0, 0, buffer), (0, buffer, buffer), (1, 2 * buffer, buffer)]
    assert t.mapper_kind == MapperKind.NHD and t.tokens_per_block == 16


def test_pool_default_strides_are_dense_layer_major():
    p = PhysicalPool(0, 100, 7)
    assert p.effective_slot_stride == 100 and p.effective_layer_stride == 700


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: BufferEntry(-1, 0, 1), "local_layer_id"),
        (lambda: BufferEntry(0, 1 << 64, 1), "offset"),
        (lambda: BufferEntry(0, 0, 1 << 32), "size"),
        (lambda: PhysicalPool(0, 100, 4, slot_stride=50), "slot_stride"),
        (lambda: PoolView(0, frozenset({"kv"}), ()), "no entries"),
        (lambda: PoolView(0, frozenset({"kv"}), (BufferEntry(0, 0, 8), BufferEntry(1, 0, 8), BufferEntry(1, 8, 8),
                                                  BufferEntry(1, 16, 8))), "not evenly distributed per layer"),
        (lambda: LayerGroup(0, (1, 1), None, ()), "unique"),
        (lambda: LayerGroup(0, (1,), None, (PoolView(0, frozenset(), (BufferEntry(1, 0, 8),)),)), "local_layer_id 1"),
        (lambda: PageTable((PhysicalPool(0, 8, 1),),
                           (LayerGroup(0, (0,), None, (PoolView(1, frozenset(), (BufferEntry(0, 0, 8),)),)),),
                           MapperKind.HND, 16), "pool_index 1 out of range"),
        (lambda: PageTable((PhysicalPool(0, 8, 1),),
                           (LayerGroup(0, (0,), None, (PoolView(0, frozenset(), (BufferEntry(0, 0, 8),)),)),
                            LayerGroup(1, (0,), None, (PoolView(0, frozenset(), (BufferEntry(0, 0, 8),)),))),
                           MapperKind.HND, 16), "global layer 0 is in layer groups 0 and 1"),
    ],
)
def test_invalid_page_tables_fail(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_page_table_dict_round_trip():
    ri = info("ctx", Topology(pool_kind="layer_major"), ModelShape(num_layer_groups=2, sliding_window=8,
                                                                  replicated_bytes_per_token=4), 0)
    t = ri.page_table
    assert PageTable.from_dict(msgpack.unpackb(msgpack.packb(t.to_dict()))) == t


def test_page_table_from_dict_rejects_unknown_fields():
    d = info("ctx", Topology(), ModelShape(), 0).page_table.to_dict()
    d["layer_groups"][0]["extra"] = 1
    with pytest.raises(SchemaError, match=r"LayerGroup fields .* differ"):
        PageTable.from_dict(d)


def test_rank_info_bytes_round_trip():
    ri = replace(info("ctx", Topology(tp=2, pp=2, cp=2), ModelShape(), 5), agent_descriptor=b"\x00nixl\xff")
    back = RankInfo.from_bytes(ri.to_bytes())
    assert back == ri and back.key == ("ctx", 5)
    assert (back.pp_rank, back.tp_rank, back.cp_rank) == (1, 0, 1)  # 5 = pp*(2*2) + tp*2 + cp


def test_rank_info_version_mismatch_fails():
    ri = info("ctx", Topology(), ModelShape(), 0)
    msg = msgpack.unpackb(ri.to_bytes())
    msg["version"] = RankInfo.VERSION + 1
    with pytest.raises(SchemaError,
                       match=f"version {RankInfo.VERSION + 1} differs from this build's {RankInfo.VERSION}"):
        RankInfo.from_bytes(msgpack.packb(msg))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("head_dim"), r"missing \['head_dim'\]"),
    (lambda d: d.update(extra=1), r"unexpected \['extra'\]"),
    (lambda d: d.update(rank=7), "CP-minor"),
    (lambda d: d.update(instance_name=3), "instance_name must be str"),
])
def test_rank_info_schema_mismatch_fails(edit, match):
    msg = msgpack.unpackb(info("ctx", Topology(), ModelShape(), 0).to_bytes())
    edit(msg["rank_info"])
    with pytest.raises(SchemaError, match=match):
        RankInfo.from_bytes(msgpack.packb(msg))


def test_rank_info_rejects_garbage():
    with pytest.raises(SchemaError):
        RankInfo.from_bytes(b"\xc1\xc1")
    with pytest.raises(SchemaError, match="exactly 'version' and 'rank_info'"):
        RankInfo.from_bytes(msgpack.packb([1, 2]))


@pytest.mark.parametrize("changes, match", [
    ({"rank": 1}, "CP-minor numbering"),
    ({"kv_heads_per_rank": 2}, "kv_heads_per_rank=2 but total_kv_heads=4 over tp_per_dp=1 gives 4"),
    ({"total_kv_heads": 3, "kv_heads_per_rank": 3, "tp_size": 2, "dp_size": 1}, "one must divide the other"),
    ({"dp_rank": 1, "dp_size": 2}, "tp_size=1 is not a multiple of dp_size=2"),
    ({"layers_per_pp_stage": (2, 2)}, "needs pp_size=1"),
    ({"tokens_per_block": 32}, "tokens_per_block=32 but the page table says 16"),
    ({"layers_per_pp_stage": (3,)}, r"page table layers \[3\] lie outside PP stage 0's layers \[0, 3\)"),
])
def test_rank_info_validation(changes, match):
    ri = info("ctx", Topology(), ModelShape(), 0)
    with pytest.raises(ValueError, match=match):
        replace(ri, **changes)


def test_head_ranges():
    model = ModelShape(total_kv_heads=2)
    # tp4 over 2 heads: each head on 2 ranks.
    assert [info("c", Topology(tp=4), model, r).head_range for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert info("c", Topology(tp=4), model, 3).head_duplication == 2
    # attention DP: tp4 dp2 -> 2 ranks per DP group, each holds one of the 2 heads.
    assert [info("c", Topology(tp=4, dp=2), model, r).head_range for r in range(4)] == [(0, 1), (1, 2), (0, 1), (1, 2)]
