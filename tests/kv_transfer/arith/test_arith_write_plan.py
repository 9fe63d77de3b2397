"""Exact tests of pairing, overlap and ownership election, and every fail-loud case."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from factories import info, instance, replicated_instance, with_table

from pdserve.kv_transfer import (
    AlignmentError,
    BufferEntry,
    KVTransferError,
    LayerGroup,
    MapperKind,
    PageTable,
    PoolView,
    flat_rank,
    overlapping_ranks,
    page_table_for_block_major_pool,
    plan_write,
    writers_for,
)
from pdserve.testing.kv_oracle import ModelShape, Topology

T = Topology
M = ModelShape


def test_flat_rank_is_cp_minor():
    # tp=4, cp=2: (pp, tp, cp) -> pp*8 + tp*2 + cp; a TP-minor formula would give pp*8 + cp*4 + tp.
    assert [flat_rank(0, t, c, 4, 2) for t in range(4) for c in range(2)] == list(range(8))
    assert flat_rank(1, 3, 1, 4, 2) == 15
    assert flat_rank(0, 1, 0, 4, 2) == 2


def test_writers_cp_minor_owner_ranks():
    """ctx tp4 pp2 cp2 (8 heads, 2 per rank) -> gen tp2: gen rank 1 holds heads 4..7."""
    model = M(total_kv_heads=8)
    ctx = instance("ctx", T(tp=4, pp=2, cp=2), model)
    gen = instance("gen", T(tp=2), model)
    assert writers_for(gen[1], ctx) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert writers_for(gen[0], ctx) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert overlapping_ranks(gen[1], ctx[0]) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert overlapping_ranks(ctx[5], gen[0]) == [1]  # ctx rank 5 = pp0 tp2 cp1 holds heads 4..5


@pytest.mark.parametrize(
    "heads, ctx_tp, gen_topo, expected",
    [
        # ctx holds each head on 2 ranks; the replica at index gen.tp_rank % 2 writes.
        (2, 4, T(), {0: [0, 2]}),
        (2, 4, T(tp=2), {0: [0], 1: [3]}),
        (1, 4, T(tp=4), {0: [0], 1: [1], 2: [2], 3: [3]}),
        (1, 2, T(tp=4), {0: [0], 1: [1], 2: [0], 3: [1]}),
        # attention DP on gen: every gen rank is its own DP group holding the one head.
        (1, 4, T(tp=4, dp=4), {0: [0], 1: [1], 2: [2], 3: [3]}),
        # gen duplicates (gen tp4, 2 heads): each gen rank gets its head from one ctx rank.
        (2, 1, T(tp=4), {0: [0], 1: [0], 2: [0], 3: [0]}),
        (2, 2, T(tp=4), {0: [0], 1: [0], 2: [1], 3: [1]}),
        # no duplication, ctx tp4 (1 head each) -> gen pp2: both stages read all ctx ranks.
        (4, 4, T(pp=2), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}),
    ],
)
def test_head_duplication_owners(heads, ctx_tp, gen_topo, expected):
    model = M(total_kv_heads=heads)
    ctx = instance("ctx", T(tp=ctx_tp), model)
    gen = instance("gen", gen_topo, model)
    assert {g.rank: writers_for(g, ctx) for g in gen} == expected


@pytest.mark.parametrize(
    "ctx_tp, gen_tp, gen_dp, expected",
    [(4, 2, 1, [[0], [2]]), (4, 2, 2, [[0], [1]]), (4, 4, 4, [[0], [1], [2], [3]]), (2, 4, 1, [[0], [0], [1], [1]]),
     (1, 4, 1, [[0]] * 4), (4, 1, 1, [[0]])],
)
def test_replicated_fan_in_owners(ctx_tp, gen_tp, gen_dp, expected):
    ctx = replicated_instance("ctx", ctx_tp)
    gen = replicated_instance("gen", gen_tp, dp=gen_dp)
    assert [writers_for(g, ctx) for g in gen] == expected
    for g, owners in zip(gen, expected):
        for c in ctx:
            assert (plan_write(c, g, {0: np.arange(2)}, {0: np.arange(2)}) is not None) == (c.rank in owners)


def test_elected_writer_with_no_blocks_gets_empty_plan_not_none():
    model = M()
    ctx, gen = instance("ctx", T(), model), instance("gen", T(), model)
    plan = plan_write(ctx[0], gen[0], {0: np.array([-1, -1])}, {0: np.array([0, 1])})
    assert plan is not None and len(plan) == 0 and plan.num_bytes == 0


# ---- fail-loud cases ----------------------------------------------------------------------


def _two_groups(ri):
    """Same storage, but layers split into groups (0, 2) and (1, 3)."""
    v = ri.page_table.layer_groups[0].views[0]
    by = v.entries_by_layer()
    groups = tuple(
        LayerGroup(g, (g, g + 2), None,
                   (PoolView(0, v.role, tuple(BufferEntry(i, e.offset, e.size)
                                              for i, layer in enumerate((g, g + 2)) for e in by[layer])),))
        for g in (0, 1)
    )
    return with_table(ri, replace(ri.page_table, layer_groups=groups))


def test_group_hitting_two_peer_groups_fails():
    model = M()
    ctx, gen = info("ctx", T(), model, 0), _two_groups(info("gen", T(), model, 0))
    with pytest.raises(AlignmentError, match=r"ctx layer group 0 .* hits gen layer groups \[0, 1\]"):
        writers_for(gen, [ctx])


def test_mapper_kind_mismatch_fails():
    model = M()
    ctx, gen = info("ctx", T(layout=MapperKind.HND), model, 0), info("gen", T(layout=MapperKind.NHD), model, 0)
    with pytest.raises(AlignmentError, match="mapper kind differs, ctx HND vs peer NHD"):
        plan_write(ctx, gen, {0: np.arange(2)}, {0: np.arange(2)})


def test_missing_role_fails():
    model = M()
    ctx, gen = info("ctx", T(), model, 0), info("gen", T(pool_kind="layer_major"), model, 0)
    with pytest.raises(AlignmentError, match=r"role \['kv'\] .* matches 0 pools .*\(peer roles: \[\['k'\], \['v'\]\]"):
        writers_for(gen, [ctx])


def test_ambiguous_role_fails():
    model = M()
    ctx, gen = info("ctx", T(), model, 0), info("gen", T(), model, 0)
    g = gen.page_table.layer_groups[0]
    doubled = replace(g, views=(g.views[0], g.views[0]))
    gen = with_table(gen, replace(gen.page_table, layer_groups=(doubled,)))
    with pytest.raises(AlignmentError, match="matches 2 pools"):
        writers_for(gen, [ctx])


@pytest.mark.parametrize("layout", [MapperKind.NHD])
def test_tokens_per_block_must_match_for_nhd(layout):
    model = M()
    ctx = info("ctx", T(layout=layout, tokens_per_block=16), model, 0)
    gen = info("gen", T(layout=layout, tokens_per_block=32), model, 0)
    with pytest.raises(AlignmentError, match="NHD pools address bytes inside a block.*ctx 16 and gen 32"):
        writers_for(gen, [ctx])


def test_tokens_per_block_must_match_for_replicated():
    ctx = replicated_instance("ctx", 1, tpb=16)
    gen = replicated_instance("gen", 1, tpb=32)
    with pytest.raises(AlignmentError, match="REPLICATED pools address bytes inside a block"):
        writers_for(gen[0], ctx)


def test_tokens_per_block_must_divide():
    model = M()
    ctx, gen = info("ctx", T(tokens_per_block=16), model, 0), info("gen", T(tokens_per_block=24), model, 0)
    with pytest.raises(AlignmentError, match="ctx 16 and gen 24: one must divide the other"):
        writers_for(gen, [ctx])


def test_tokens_per_block_divisible_warns(caplog):
    model = M(num_layers=3)  # a model not used elsewhere: the alignment cache must miss
    ctx, gen = info("ctx", T(tokens_per_block=16), model, 0), info("gen", T(tokens_per_block=32), model, 0)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.write_plan"):
        assert writers_for(gen, [ctx]) == [0]
    assert "tokens_per_block differs (ctx 16, gen 32)" in caplog.text


@pytest.mark.parametrize("field, gen_model", [("num_layers", M(num_layers=6)), ("total_kv_heads", M(total_kv_heads=8)),
                                              ("head_dim", M(head_dim=8)), ("element_bytes", M(element_bytes=4))])
def test_model_mismatch_fails(field, gen_model):
    ctx, gen = info("ctx", T(), M(), 0), info("gen", T(), gen_model, 0)
    with pytest.raises(AlignmentError, match=f"{field} differs"):
        writers_for(gen, [ctx])


def test_sliding_window_mismatch_fails():
    ctx = info("ctx", T(), M(num_layer_groups=2, sliding_window=32), 0)
    gen = info("gen", T(), M(num_layer_groups=2, sliding_window=64), 0)
    with pytest.raises(AlignmentError, match=r"sliding_window differs \(ctx 32, gen 64\)"):
        writers_for(gen, [ctx])


def test_buffers_per_layer_mismatch_fails():
    model = M()
    ctx, gen = info("ctx", T(), model, 0), info("gen", T(), model, 0)
    g = gen.page_table.layer_groups[0]
    (v,) = g.views
    one_per_layer = replace(v, entries=tuple(e for e in v.entries if e.offset % (2 * e.size) == 0))
    gen = with_table(gen, replace(gen.page_table, layer_groups=(replace(g, views=(one_per_layer,)),)))
    with pytest.raises(AlignmentError, match="buffers per layer differ, ctx 2 vs gen 1"):
        writers_for(gen, [ctx])


def test_bytes_per_head_token_mismatch_fails():
    model = M(total_kv_heads=4, head_dim=4, element_bytes=2)
    ctx, gen = info("ctx", T(tp=2), model, 0), info("gen", T(), model, 0)
    # gen registers buffers twice as large per (head, token) as the model claims.
    table = page_table_for_block_major_pool(1 << 40, 8, 4, 4, 16, 8, 2, MapperKind.HND, range(4))
    gen = with_table(gen, table)
    with pytest.raises(AlignmentError, match=r"bytes per \(head, token\) differ: source 8, destination 16"):
        plan_write(ctx, gen, {0: np.arange(2)}, {0: np.arange(2)})


def test_head_slicing_not_byte_aligned_fails():
    model = M(total_kv_heads=4)
    ctx, gen = info("ctx", T(tp=2), model, 0), info("gen", T(), model, 0)
    v = ctx.page_table.layer_groups[0].views[0]
    odd = replace(v, entries=tuple(BufferEntry(e.local_layer_id, e.offset, e.size - 1) for e in v.entries))
    g = replace(ctx.page_table.layer_groups[0], views=(odd,))
    ctx = with_table(ctx, replace(ctx.page_table, layer_groups=(g,)))
    with pytest.raises(AlignmentError, match=r"source buffer of 255 bytes does not split into 2 heads x 16 tokens"):
        plan_write(ctx, gen, {0: np.arange(2)}, {0: np.arange(2)})


def test_missing_ctx_rank_means_no_writer():
    model = M()
    ctx, gen = instance("ctx", T(tp=2), model), instance("gen", T(), model)
    with pytest.raises(AlignmentError, match=r"gen \('gen', 0\) layer 0 head 2 .* has 0 writers"):
        writers_for(gen[0], ctx[:1])


def test_ctx_ranks_from_two_dp_groups_fail():
    model = M()
    ctx, gen = instance("ctx", T(tp=2, dp=2), model), instance("gen", T(), model)
    with pytest.raises(KVTransferError, match=r"span DP groups \[0, 1\]"):
        writers_for(gen[0], ctx)


def test_block_id_out_of_range_fails():
    model = M()
    ctx, gen = info("ctx", T(num_blocks=8), model, 0), info("gen", T(num_blocks=8), model, 0)
    with pytest.raises(KVTransferError, match="gen block id 8 of layer group 0 is out of range for 8 slots"):
        plan_write(ctx, gen, {0: np.arange(2)}, {0: np.array([7, 8])})


def test_missing_group_block_ids_fail():
    model = M(num_layer_groups=2)
    ctx, gen = info("ctx", T(), model, 0), info("gen", T(), model, 0)
    with pytest.raises(KVTransferError, match=r"no ctx block ids for layer group 1 \(got groups \[0\]\)"):
        plan_write(ctx, gen, {0: np.arange(2)}, {0: np.arange(2), 1: np.arange(2)})


def test_replicated_size_mismatch_fails():
    ctx = replicated_instance("ctx", 1, row=8)
    gen = replicated_instance("gen", 1, row=8)
    v = gen[0].page_table.layer_groups[0].views[0]
    small = replace(v, entries=tuple(BufferEntry(e.local_layer_id, 0, e.size // 2) for e in v.entries))
    table = replace(gen[0].page_table, layer_groups=(replace(gen[0].page_table.layer_groups[0], views=(small,)),))
    with pytest.raises(AlignmentError, match="replicated buffer sizes differ: source 128 bytes, destination 64 bytes"):
        writers_for(with_table(gen[0], table), ctx)


def test_page_table_kind_override_per_view():
    table = page_table_for_block_major_pool(1 << 40, 8, 1, 1, 16, 4, 1, MapperKind.HND, [0])
    view = PoolView(0, frozenset({"x"}), table.layer_groups[0].views[0].entries, MapperKind.REPLICATED)
    assert table.kind_of(view) == MapperKind.REPLICATED
    assert table.kind_of(table.layer_groups[0].views[0]) == MapperKind.HND
    assert isinstance(table, PageTable)
