"""Property tests over random geometries.

Mapper level: every byte a fragment copies is decoded independently on both sides into
(buffer, global head, global token, byte in row); the two must agree, and the destination bytes
must be exactly the shared heads x transferred tokens, each once.
System level: random ctx/gen topologies through the byte-exact numpy oracle.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import MapperKind
from pdserve.kv_transfer.mappers import PairGeometry, build_mapper
from pdserve.testing.kv_oracle import ModelShape, Topology, make_instance, simulate_transfer

HND, NHD = MapperKind.HND, MapperKind.NHD


@st.composite
def _geometries(draw):
    k = draw(st.sampled_from([1, 2, 4, 8]))
    tp_c, tp_g = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    hc, hg = max(1, k // tp_c), max(1, k // tp_g)
    i = draw(st.integers(0, tp_c - 1))
    c0 = i * k // tp_c
    g_ranks = [j for j in range(tp_g) if j * k // tp_g < c0 + hc and j * k // tp_g + hg > c0]
    g0 = draw(st.sampled_from(g_ranks)) * k // tp_g
    kind = draw(st.sampled_from([HND, NHD]))
    tc, tg = draw(st.sampled_from([(16, 16), (4, 4), (1, 1)] if kind == NHD
                                  else [(16, 16), (16, 32), (32, 16), (8, 2), (2, 8)]))
    row = draw(st.sampled_from([1, 3, 8]))  # odd rows: byte geometry must stay exact
    n = draw(st.integers(1, 4))
    gaps = draw(st.lists(st.integers(0, 5), min_size=2 * n, max_size=2 * n))

    def offsets(size, gap):
        return np.cumsum([0] + [size + g for g in gap[: n - 1]]).astype(np.uint64), size * n + sum(gap)

    src_off, src_slot = offsets(hc * tc * row, gaps[:n])
    dst_off, dst_slot = offsets(hg * tg * row, gaps[n:])
    geom = PairGeometry(
        label="prop", kind=kind, src_offsets=src_off, dst_offsets=dst_off,
        src_sizes=np.full(n, hc * tc * row, np.uint64), dst_sizes=np.full(n, hg * tg * row, np.uint64),
        src_heads=hc, dst_heads=hg, head_lo=max(c0, g0), head_hi=min(c0 + hc, g0 + hg),
        src_tokens_per_block=tc, dst_tokens_per_block=tg,
    )
    blocks_c, blocks_g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    perm_c = draw(st.permutations(range(6)))[:blocks_c]
    perm_g = draw(st.permutations(range(6)))[:blocks_g]
    return geom, (c0, src_slot, perm_c), (g0, dst_slot, perm_g), row


def _decode(addr, side, geom, head0, slot_bytes, slots, row, tpb, heads):
    offsets = geom.src_offsets if side == "src" else geom.dst_offsets
    size = int((geom.src_sizes if side == "src" else geom.dst_sizes)[0])
    slot_of = {s: b for b, s in enumerate(slots)}
    slot, off = np.divmod(addr, np.uint64(slot_bytes))
    block = np.array([slot_of[int(s)] for s in slot])
    n = np.searchsorted(offsets, off, side="right") - 1
    r = (off - offsets[n]).astype(np.int64)
    assert (r < size).all(), "a byte lands in a gap between buffers"
    if geom.kind == HND:
        h, rest = np.divmod(r, tpb * row)
        t, byte = np.divmod(rest, row)
    else:
        t, rest = np.divmod(r, heads * row)
        h, byte = np.divmod(rest, row)
    return np.stack([n, head0 + h, block * tpb + t, byte])


@settings(max_examples=100, deadline=None)
@given(_geometries())
def test_mapper_bytes_land_on_the_same_logical_element(case):
    geom, (c0, c_slot, c_ids), (g0, g_slot, g_ids), row = case
    tc, tg = geom.src_tokens_per_block, geom.dst_tokens_per_block
    m = min(tc, tg)
    tokens = min(len(c_ids) * tc, len(g_ids) * tg)
    first = np.arange(0, tokens, m)  # first token of each sub-block
    to_u64 = lambda a: np.asarray(a, dtype=np.uint64)  # noqa: E731
    mapper = build_mapper(geom)
    src, dst, sizes = mapper.map(
        to_u64(np.array(c_ids)[first // tc]) * np.uint64(c_slot), to_u64(first % tc),
        to_u64(np.array(g_ids)[first // tg]) * np.uint64(g_slot), to_u64(first % tg),
    )
    sizes = sizes.astype(np.int64)
    within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    src_b = np.repeat(src, sizes) + within.astype(np.uint64)
    dst_b = np.repeat(dst, sizes) + within.astype(np.uint64)
    s = _decode(src_b, "src", geom, c0, c_slot, c_ids, row, tc, geom.src_heads)
    d = _decode(dst_b, "dst", geom, g0, g_slot, g_ids, row, tg, geom.dst_heads)
    np.testing.assert_array_equal(s, d)
    assert np.unique(dst_b).size == dst_b.size, "a destination byte is written twice"
    assert np.unique(src_b).size == src_b.size
    n_buffers = geom.src_offsets.size
    assert dst_b.size == n_buffers * geom.shared_heads * tokens * row
    assert set(np.unique(s[1]).tolist()) == set(range(geom.head_lo, geom.head_hi))


@st.composite
def _topology_pairs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.sampled_from([2, 4]))
    layout = draw(st.sampled_from([HND, NHD]))
    pool_kind = draw(st.sampled_from(["block_major", "layer_major"]))
    replicated = draw(st.sampled_from([0, 4]))
    exact_tpb = layout == NHD or replicated > 0  # NHD and REPLICATED need equal tokens_per_block

    def topo():
        tp = draw(st.sampled_from([1, 2, 4]))
        pp = draw(st.sampled_from([p for p in (1, 2) if p <= layers]))
        tpb = 16 if exact_tpb else draw(st.sampled_from([16, 32]))
        return Topology(tp=tp, pp=pp, cp=draw(st.sampled_from([1, 2])), layout=layout, tokens_per_block=tpb,
                        pool_kind=pool_kind, num_blocks=6)

    model = ModelShape(num_layers=layers, total_kv_heads=heads, head_dim=draw(st.sampled_from([1, 3])),
                       element_bytes=2, num_layer_groups=draw(st.sampled_from([1, 2])),
                       replicated_bytes_per_token=replicated)
    return topo(), topo(), model, draw(st.integers(1, 90)), draw(st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(_topology_pairs())
def test_random_topologies_are_byte_exact(case):
    ctx_topo, gen_topo, model, num_tokens, seed = case
    rng = np.random.default_rng(seed)

    def ids(topo):
        n = -(-num_tokens // topo.tokens_per_block)
        base = {g: rng.permutation(topo.num_blocks)[:n] for g in range(model.num_layer_groups)}
        return lambda info: {g: np.where(np.arange(n) % info.cp_size == info.cp_rank, b, -1) for g, b in base.items()}

    ctx = make_instance("ctx", ctx_topo, model)
    gen = make_instance("gen", gen_topo, model, fill=0xEE)
    simulate_transfer(ctx, gen, model, num_tokens, ids(ctx_topo), ids(gen_topo), seed)
