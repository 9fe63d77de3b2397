"""Descriptor counts and exact offsets of the mappers."""

from __future__ import annotations

import numpy as np
import pytest
from factories import info

from pdserve.kv_transfer import MapperKind, plan_write
from pdserve.kv_transfer.mappers import (
    HNDHeadMismatchMapper,
    IntactMapper,
    NHDHeadMismatchMapper,
    PairGeometry,
    ReplicatedMapper,
    build_mapper,
    merge_contiguous,
)
from pdserve.kv_transfer.write_plan import align
from pdserve.testing.kv_oracle import ModelShape, Topology

T, M = Topology, ModelShape
HND, NHD = MapperKind.HND, MapperKind.NHD


def _plan(ctx_topo, gen_topo, model, ctx_ids, gen_ids, ctx_rank=0, gen_rank=0):
    ctx, gen = info("ctx", ctx_topo, model, ctx_rank), info("gen", gen_topo, model, gen_rank)
    return plan_write(ctx, gen, {0: np.array(ctx_ids)}, {0: np.array(gen_ids)})


@pytest.mark.parametrize(
    "ctx_ids, gen_ids, fragments",
    [([2, 3, 4], [5, 6, 7], 1), ([2, 3, 4], [5, 6, 0], 2), ([2, 3, 7], [5, 6, 0], 2), ([4, 3, 2], [7, 6, 5], 1),
     ([0, -1, 2], [0, 1, 2], 2), ([1, 5, 3], [0, 4, 2], 3)],
)
def test_intact_block_major_one_fragment_per_contiguous_run(ctx_ids, gen_ids, fragments):
    model = M()
    plan = _plan(T(), T(), model, ctx_ids, gen_ids)
    slot = model.num_layers * 2 * model.total_kv_heads * 16 * model.head_token_bytes
    assert len(plan) == fragments
    assert plan.num_bytes == slot * sum(i >= 0 for i in ctx_ids)


def test_intact_layer_major_one_fragment_per_layer_run():
    # Separate K and V pools [layers, blocks, ...]: consecutive blocks of one layer are contiguous.
    model = M()
    plan = _plan(T(pool_kind="layer_major"), T(pool_kind="layer_major"), model, [1, 2, 3], [4, 5, 6])
    assert len(plan) == model.num_layers * 2
    plan = _plan(T(pool_kind="layer_major"), T(pool_kind="layer_major"), model, [1, 2, 3], [4, 5, 0])
    assert len(plan) == model.num_layers * 2 * 2


def test_intact_pp_split_is_one_fragment_per_block():
    # gen pp2 holds half of the layers: half of every ctx slot, not contiguous across blocks.
    plan = _plan(T(), T(pp=2), M(), [2, 3, 4], [5, 6, 7])
    assert len(plan) == 3
    assert len(_plan(T(pp=2), T(), M(), [2, 3, 4], [5, 6, 7])) == 3


def test_nhd_mismatch_is_layers_x2_x_tokens_per_peer():
    model = M(num_layers=4, total_kv_heads=4)
    for gen_rank in range(2):  # ctx tp1 -> gen tp2: each gen rank is a peer
        plan = _plan(T(layout=NHD), T(tp=2, layout=NHD), model, [0, 1, 2], [3, 4, 5], gen_rank=gen_rank)
        assert len(plan) == 4 * 2 * (3 * 16)
        assert set(plan.sizes.tolist()) == {2 * model.head_token_bytes}


def test_hnd_mismatch_is_one_fragment_per_buffer_and_block():
    model = M(num_layers=4, total_kv_heads=4)
    plan = _plan(T(), T(tp=2), model, [0, 1, 2], [3, 4, 5], gen_rank=1)
    assert len(plan) == 4 * 2 * 3
    assert set(plan.sizes.tolist()) == {2 * 16 * model.head_token_bytes}


def test_tokens_per_block_16_to_32_cuts_per_head_and_sub_block():
    model = M(num_layers=4, total_kv_heads=4)
    plan = _plan(T(tokens_per_block=16), T(tokens_per_block=32), model, [0, 2, 4], [3, 5])
    # 3 sub-blocks of 16 tokens (ctx has 48 tokens, gen 64), per layer, K/V and head.
    assert len(plan) == 4 * 2 * 4 * 3
    assert set(plan.sizes.tolist()) == {16 * model.head_token_bytes}


def _geom(kind=HND, src_heads=4, dst_heads=2, lo=2, hi=4, ts=16, td=16, row=8, n=2):
    return PairGeometry(
        label="test", kind=kind,
        src_offsets=np.arange(n, dtype=np.uint64) * np.uint64(src_heads * ts * row),
        dst_offsets=np.arange(n, dtype=np.uint64) * np.uint64(dst_heads * td * row),
        src_sizes=np.full(n, src_heads * ts * row, np.uint64), dst_sizes=np.full(n, dst_heads * td * row, np.uint64),
        src_heads=src_heads, dst_heads=dst_heads, head_lo=lo, head_hi=hi, src_tokens_per_block=ts,
        dst_tokens_per_block=td,
    )


def test_hnd_head_offsets_exact():
    # src holds heads 0..3, dst holds 2..3: one range per buffer starting at src head 2.
    m = build_mapper(_geom())
    assert isinstance(m, HNDHeadMismatchMapper)
    assert m.src_offsets.tolist() == [2 * 16 * 8, 4 * 16 * 8 + 2 * 16 * 8]
    assert m.dst_offsets.tolist() == [0, 2 * 16 * 8]
    assert m.sizes.tolist() == [2 * 16 * 8] * 2


def test_hnd_head_offsets_with_duplication():
    # gen duplicates: dst holds 1 head (global 3), src holds 4..: local index 3 % 4 = 3, dst 3 % 1 = 0.
    m = build_mapper(_geom(src_heads=4, dst_heads=1, lo=3, hi=4))
    assert m.src_offsets.tolist() == [3 * 16 * 8, 4 * 16 * 8 + 3 * 16 * 8]
    assert m.dst_offsets.tolist() == [0, 16 * 8]


def test_nhd_offsets_exact():
    m = build_mapper(_geom(kind=NHD, n=1))
    assert isinstance(m, NHDHeadMismatchMapper)
    assert m.src_offsets.tolist()[:3] == [2 * 8, 6 * 8, 10 * 8]  # token t: (t*4 + 2) rows
    assert m.dst_offsets.tolist()[:3] == [0, 2 * 8, 4 * 8]  # token t: t*2 rows
    assert m.fragments_per_subblock == 16


def test_mapper_choice():
    assert isinstance(build_mapper(_geom(src_heads=2, dst_heads=2, lo=2, hi=4)), IntactMapper)
    assert isinstance(build_mapper(_geom(kind=NHD, src_heads=2, dst_heads=2, lo=2, hi=4)), IntactMapper)
    rep = _geom(kind=MapperKind.REPLICATED, src_heads=1, dst_heads=1, lo=0, hi=1)
    assert isinstance(build_mapper(rep), ReplicatedMapper)


def test_map_expands_outer_sum():
    m = build_mapper(_geom(ts=16, td=32, src_heads=2, dst_heads=2, lo=2, hi=4))
    # per (buffer, head): 2 buffers x 2 heads fragments of 16 rows; sub-block token offsets move dst.
    src, dst, sizes = m.map(np.array([1000, 5000], np.uint64), np.array([0, 0], np.uint64),
                            np.array([9000, 9000], np.uint64), np.array([0, 16], np.uint64))
    assert len(src) == 2 * 4
    assert dst[4] - dst[0] == 16 * 8  # second sub-block lands 16 rows further along the dst row
    assert set(sizes.tolist()) == {16 * 8}


def test_merge_contiguous():
    src = np.array([100, 0, 10, 30], np.uint64)
    dst = np.array([200, 500, 510, 600], np.uint64)
    sizes = np.array([5, 10, 20, 5], np.uint64)
    s, d, n = merge_contiguous(src, dst, sizes)
    assert s.tolist() == [0, 30, 100] and d.tolist() == [500, 600, 200] and n.tolist() == [30, 5, 5]


def test_align_caches_pairs():
    ctx, gen = info("ctx", T(tp=2), M(), 1), info("gen", T(), M(), 0)
    assert align(ctx, gen) is align(ctx, gen)
