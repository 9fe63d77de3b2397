"""Recurrent state in the exchange: SECTIONED buffers, per-slot extraction, 64-bit offsets.

A hybrid model's recurrent layers (Mamba2, Gated DeltaNet) keep one state slot per sequence. Each
state buffer is [Sec0 | Sec1 | ...], every section cut over TP on its own (a Mamba2 conv state
[x | B | C]: x by heads, B and C by groups, copied when groups < TP). The oracle checks every gen byte
against the logical state re-cut to its layout, written exactly once.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import (
    AlignmentError,
    BufferEntry,
    KVTransferError,
    LayerGroup,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
    RankInfo,
    Section,
)
from pdserve.kv_transfer.write_plan import plan_write, writers_for
from pdserve.testing.kv_oracle import ModelShape, Topology, make_instance, simulate_transfer

from factories import instance, with_table

T = Topology
GiB = 1 << 30
# A Mamba2-like state: conv [x: 8 heads x 6 B | B: 2 groups x 4 B | C: 2 groups x 4 B], ssm [4 heads x 16 B]
MAMBA = ModelShape(num_layers=8, recurrent_every=4)
ONE_GROUP = ModelShape(num_layers=8, recurrent_every=4, state_buffers=(((8, 6), (1, 4), (1, 4)), ((4, 16),)))
ALL_RECURRENT = ModelShape(num_layers=3, recurrent_every=4)  # no attention layer on any rank


def _ids(topo: Topology, model: ModelShape, num_tokens: int, seed: int, slot_sent: bool = True):
    """Block ids per attention group (a random permutation) and one random state slot."""
    rng = np.random.default_rng(seed)
    n = -(-num_tokens // topo.tokens_per_block)
    ids = {g: rng.permutation(topo.num_blocks)[:n] for g in range(model.num_layer_groups)}
    ids[model.num_layer_groups] = np.array([rng.integers(topo.num_state_slots) if slot_sent else -1])
    return lambda info: ids


CASES = {
    "tp1->tp2": (T(), T(tp=2), MAMBA),
    "tp2->tp1": (T(tp=2), T(), MAMBA),
    "tp2->pp2": (T(tp=2), T(pp=2), MAMBA),
    "pp2->tp2": (T(pp=2), T(tp=2), MAMBA),
    "tp4->tp2": (T(tp=4), T(tp=2), MAMBA),
    "tp2->tp4 (groups copied on gen)": (T(tp=2), T(tp=4), MAMBA),
    "tp4->tp1 (groups copied on ctx)": (T(tp=4), T(), MAMBA),
    "one group tp2->tp1": (T(tp=2), T(), ONE_GROUP),
    "one group tp1->tp4": (T(), T(tp=4), ONE_GROUP),
    "one group tp4->tp2pp2": (T(tp=4), T(tp=2, pp=2), ONE_GROUP),
    "slot-major -> layer-major tp2->tp1": (T(tp=2, state_pool="slot_major"), T(), MAMBA),
    "layer-major -> slot-major tp1->tp2 nhd": (T(layout=MapperKind.NHD), T(tp=2, state_pool="slot_major",
                                                                          layout=MapperKind.NHD), MAMBA),
    "uneven pp (7,1)->(2,6)": (T(pp=2, layers_per_pp_stage=(7, 1)), T(pp=2, layers_per_pp_stage=(2, 6)), MAMBA),
    "dp2 tp4->tp2": (T(tp=4, dp=2), T(tp=2), MAMBA),
    "state only tp1->tp2": (T(), T(tp=2), ALL_RECURRENT),
}


@pytest.mark.parametrize("name", list(CASES))
def test_state_and_kv_move_byte_exact(name):
    ctx_topo, gen_topo, model = CASES[name]
    ctx = make_instance("ctx", ctx_topo, model)
    gen = make_instance("gen", gen_topo, model, fill=0xAB)
    dp_ranks = [c for c in ctx if c.info.dp_rank == 0]
    simulate_transfer(dp_ranks, gen, model, 40, _ids(ctx_topo, model, 40, 1), _ids(gen_topo, model, 40, 2))


def test_a_state_slot_of_minus_one_moves_no_state():
    """-1 for the recurrent group ("not this time", e.g. a pipelined chunk before the last): the KV
    goes, the gen state slot keeps its bytes."""
    ctx = make_instance("ctx", T(tp=2), MAMBA)
    gen = make_instance("gen", T(), MAMBA, fill=0xAB)
    simulate_transfer(ctx, gen, MAMBA, 40, _ids(T(tp=2), MAMBA, 40, 1, slot_sent=False),
                      _ids(T(), MAMBA, 40, 2))


def _conv_table(tp: int, base: int, x_units: int = 8, groups: int = 2) -> PageTable:
    """One recurrent layer whose only buffer is a conv state [x | B | C] in a 4-slot pool."""
    sections = (Section(x_units, 6), Section(groups, 4), Section(groups, 4))
    size = sum(s.local_units(tp) * s.unit_bytes for s in sections)
    view = PoolView(0, frozenset({"conv"}), (BufferEntry(0, 0, size),), MapperKind.SECTIONED, (sections,))
    return PageTable((PhysicalPool(base, size, 4),), (LayerGroup(0, (0,), None, (view,), recurrent=True),),
                     MapperKind.HND, 16)


def _conv_instance(name: str, tp: int, **table) -> list[RankInfo]:
    ranks = instance(name, T(tp=tp), ModelShape(num_layers=1))
    return [with_table(r, _conv_table(tp, (1 + 64 * r.rank) * GiB, **table)) for r in ranks]


def test_tp1_to_tp2_fragments_are_each_sections_share():
    """ctx TP1 holds x 0..7 (48 B), B g0 g1 (8 B), C g0 g1 (8 B); gen TP2 rank 1 holds x 4..7 (24 B), B g1,
    C g1: three fragments, from x+24, B+4, C+4 into x+0, B+0, C+0 of the gen slot."""
    (ctx,), gen = _conv_instance("ctx", 1), _conv_instance("gen", 2)
    plan = plan_write(ctx, gen[1], {0: np.array([2])}, {0: np.array([3])})
    src_slot, dst_slot = ctx.page_table.pools[0].base + 2 * 64, gen[1].page_table.pools[0].base + 3 * 32
    assert plan.src_ptrs.tolist() == [src_slot + 24, src_slot + 52, src_slot + 60]
    assert plan.dst_ptrs.tolist() == [dst_slot + 0, dst_slot + 24, dst_slot + 28]
    assert plan.sizes.tolist() == [24, 4, 4]
    assert writers_for(gen[1], [ctx]) == [0]


def test_a_copied_group_has_one_writer():
    """One group over TP2: both ctx ranks hold B and C; gen TP1 takes x from both, B and C from one only."""
    ctx, (gen,) = _conv_instance("ctx", 2, groups=1), _conv_instance("gen", 1, groups=1)
    plans = [plan_write(c, gen, {0: np.array([0])}, {0: np.array([1])}) for c in ctx]
    assert [p.num_bytes for p in plans] == [24 + 4 + 4, 24]
    assert writers_for(gen, ctx) == [0, 1]


def test_state_offsets_past_4_gib_are_exact():
    """A layer-major state pool of 4096 slots of 1 MiB puts layer 5 at 20 GiB past its base: 64-bit
    offsets keep the address exact."""
    slot = 1 << 20
    sections = ((Section(1, slot),),)
    layers = 6
    pool = PhysicalPool(GiB, slot, 4096)  # layer_stride = 4096 * 1 MiB = 4 GiB
    view = PoolView(0, frozenset({"ssm"}), tuple(BufferEntry(i, 0, slot) for i in range(layers)),
                    MapperKind.SECTIONED, sections)
    table = PageTable((pool,), (LayerGroup(0, tuple(range(layers)), None, (view,), recurrent=True),),
                      MapperKind.HND, 16)
    ctx, gen = (with_table(r, table) for r in (*instance("ctx", T(), ModelShape(num_layers=layers)),
                                              *instance("gen", T(), ModelShape(num_layers=layers))))
    plan = plan_write(ctx, gen, {0: np.array([4095])}, {0: np.array([7])})
    assert plan.src_ptrs.tolist() == [GiB + layer * 4 * GiB + 4095 * slot for layer in range(layers)]
    assert plan.dst_ptrs.tolist() == [GiB + layer * 4 * GiB + 7 * slot for layer in range(layers)]
    assert plan.src_ptrs[-1] > 1 << 34


def test_different_sections_are_refused_by_name():
    (ctx,), (gen,) = _conv_instance("ctx", 1), _conv_instance("gen", 1, x_units=16)
    with pytest.raises(AlignmentError, match=r"buffer 0 sections differ: ctx \[\(8, 6\).*gen \[\(16, 6\)"):
        plan_write(ctx, gen, {0: np.array([0])}, {0: np.array([0])})


def test_a_recurrent_group_takes_one_slot_id():
    (ctx,), (gen,) = _conv_instance("ctx", 1), _conv_instance("gen", 1)
    with pytest.raises(KVTransferError, match="recurrent layer group 0 must be one slot id"):
        plan_write(ctx, gen, {0: np.array([0, 1])}, {0: np.array([0])})
    with pytest.raises(KVTransferError, match="out of range for 4 slots"):
        plan_write(ctx, gen, {0: np.array([4])}, {0: np.array([0])})


def test_a_buffer_that_is_not_its_sections_share_is_refused():
    (ctx,) = _conv_instance("ctx", 1)
    with pytest.raises(ValueError, match=r"buffer 0 has 64 bytes, but its sections .* give 32"):
        with_table(instance("ctx", T(tp=2), ModelShape(num_layers=1))[0], ctx.page_table)


def test_recurrent_groups_and_sectioned_views_go_together():
    sections = ((Section(2, 4),),)
    with pytest.raises(ValueError, match="recurrent group's views are SECTIONED"):
        PageTable((PhysicalPool(GiB, 8, 2),),
                  (LayerGroup(0, (0,), None, (PoolView(0, frozenset({"s"}), (BufferEntry(0, 0, 8),)),),
                              recurrent=True),), MapperKind.HND, 16)
    with pytest.raises(ValueError, match="recurrent group's views are SECTIONED"):
        PageTable((PhysicalPool(GiB, 8, 2),),
                  (LayerGroup(0, (0,), None, (PoolView(0, frozenset({"s"}), (BufferEntry(0, 0, 8),),
                                                       MapperKind.SECTIONED, sections),)),), MapperKind.HND, 16)


def test_context_parallel_ranks_cannot_hold_a_recurrent_state():
    with pytest.raises(ValueError, match="cannot be split over context-parallel ranks"):
        make_instance("ctx", T(cp=2), MAMBA)


def test_sections_survive_the_wire():
    (ctx,) = _conv_instance("ctx", 1)
    back = RankInfo.from_bytes(ctx.to_bytes())
    assert back.page_table == ctx.page_table
    assert back.page_table.layer_groups[0].recurrent
    assert back.page_table.layer_groups[0].views[0].sections[0][1] == Section(2, 4)


@st.composite
def _hybrids(draw):
    """A random hybrid model (sections whose unit counts split or copy over every TP used) and two
    random topologies of it."""
    tp_c, tp_g = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    buffers = tuple(tuple((draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 7)))
                          for _ in range(draw(st.integers(1, 3)))) for _ in range(draw(st.integers(1, 2))))
    model = ModelShape(num_layers=draw(st.integers(2, 6)), recurrent_every=draw(st.sampled_from([2, 3, 4])),
                       state_buffers=buffers, total_kv_heads=4)
    pp_c = draw(st.sampled_from([1, 2])) if model.num_layers >= 2 else 1
    pp_g = draw(st.sampled_from([1, 2]))

    def topo(tp, pp):
        return T(tp=tp, pp=pp, state_pool=draw(st.sampled_from(["layer_major", "slot_major"])),
                 layout=draw(st.sampled_from([MapperKind.HND, MapperKind.NHD])))

    return model, topo(tp_c, pp_c), topo(tp_g, pp_g)


@settings(max_examples=60, deadline=None)
@given(_hybrids(), st.integers(0, 2**16))
def test_random_hybrid_layouts_move_byte_exact(case, seed):
    model, ctx_topo, gen_topo = case
    gen_topo = replace(gen_topo, layout=ctx_topo.layout)  # the KV layout must match; the state pools need not
    ctx = make_instance("ctx", ctx_topo, model)
    gen = make_instance("gen", gen_topo, model, fill=0xAB)
    simulate_transfer(ctx, gen, model, 21, _ids(ctx_topo, model, 21, seed), _ids(gen_topo, model, 21, seed + 1))
