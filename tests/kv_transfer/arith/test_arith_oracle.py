"""Byte-exact oracle: scatter logical KV into ctx pools, plan + memmove, compare gen pools.

Every case checks the whole gen pool byte for byte (transferred span = logical KV re-cut to the
gen layout, everything else untouched) and that each destination byte is written exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer import MapperKind
from pdserve.testing.kv_oracle import (
    ModelShape,
    Topology,
    make_instance,
    simulate_transfer,
)
from pdserve.testing import kv_oracle as testing
from pdserve.kv_transfer.write_plan import TransferPlan, plan_write

HND, NHD = MapperKind.HND, MapperKind.NHD
T = Topology


def _ids(topo: Topology, model: ModelShape, num_tokens: int, seed: int):
    """Per-rank block ids: a random permutation per layer group; CP ranks own blocks i % cp."""
    rng = np.random.default_rng(seed)
    n = -(-num_tokens // topo.tokens_per_block)
    base = {g: rng.permutation(topo.num_blocks)[:n] for g in range(model.num_layer_groups)}

    def for_rank(info):
        own = (np.arange(n) % info.cp_size) == info.cp_rank
        return {g: np.where(own, ids, -1) for g, ids in base.items()}

    return for_rank


CASES = {
    "tp1->tp1": (T(), T(), ModelShape()),
    "tp2->tp1": (T(tp=2), T(), ModelShape()),
    "tp1->tp2": (T(), T(tp=2), ModelShape()),
    "tp2->pp2": (T(tp=2), T(pp=2), ModelShape()),
    "pp2->tp2": (T(pp=2), T(tp=2), ModelShape()),
    "tp4->tp2pp2": (T(tp=4), T(tp=2, pp=2), ModelShape()),
    "tp2pp2->tp4": (T(tp=2, pp=2), T(tp=4), ModelShape()),
    "nhd tp4->tp2pp2": (T(tp=4, layout=NHD), T(tp=2, pp=2, layout=NHD), ModelShape()),
    "nhd tp1->tp4": (T(layout=NHD), T(tp=4, layout=NHD), ModelShape()),
    "nhd tp2pp2->tp1": (T(tp=2, pp=2, layout=NHD), T(layout=NHD), ModelShape()),
    "dup ctx tp4->tp1 (2 heads)": (T(tp=4), T(), ModelShape(total_kv_heads=2)),
    "dup gen tp1->tp4 (2 heads)": (T(), T(tp=4), ModelShape(total_kv_heads=2)),
    "dup both tp4->tp2 (1 head)": (T(tp=4), T(tp=2), ModelShape(total_kv_heads=1)),
    "dup both tp4->tp4 (2 heads)": (T(tp=4), T(tp=4), ModelShape(total_kv_heads=2)),
    "dup nhd tp4->tp2pp2 (2 heads)": (T(tp=4, layout=NHD), T(tp=2, pp=2, layout=NHD), ModelShape(total_kv_heads=2)),
    "tpb 16->32 tp1->tp1": (T(tokens_per_block=16), T(tokens_per_block=32), ModelShape()),
    "tpb 32->16 tp2->tp1": (T(tp=2, tokens_per_block=32), T(tokens_per_block=16), ModelShape()),
    "tpb 16->32 tp1->tp2pp2": (T(tokens_per_block=16), T(tp=2, pp=2, tokens_per_block=32), ModelShape()),
    "tpb 32->16 dup tp4->tp2": (T(tp=4, tokens_per_block=32), T(tp=2, tokens_per_block=16),
                                ModelShape(total_kv_heads=2)),
    "layer-major tp2->pp2": (T(tp=2, pool_kind="layer_major"), T(pp=2, pool_kind="layer_major"), ModelShape()),
    "layer-major nhd tp1->tp2": (T(pool_kind="layer_major", layout=NHD), T(tp=2, pool_kind="layer_major", layout=NHD),
                                 ModelShape()),
    "layer-major tpb 16->32 tp2->tp1": (T(tp=2, pool_kind="layer_major"),
                                        T(pool_kind="layer_major", tokens_per_block=32), ModelShape()),
    "uneven pp (3,1)->(1,3)": (T(pp=2, layers_per_pp_stage=(3, 1)), T(pp=2, layers_per_pp_stage=(1, 3)), ModelShape()),
    "2 layer groups + swa tp2->pp2": (T(tp=2), T(pp=2), ModelShape(num_layer_groups=2, sliding_window=32)),
    "replicated pools tp4->tp2pp2": (T(tp=4), T(tp=2, pp=2), ModelShape(replicated_bytes_per_token=8)),
    "replicated pools tp1->tp4 nhd": (T(layout=NHD), T(tp=4, layout=NHD), ModelShape(replicated_bytes_per_token=8)),
    "replicated + groups tp2->tp4": (T(tp=2), T(tp=4),
                                     ModelShape(total_kv_heads=2, num_layer_groups=2, replicated_bytes_per_token=4)),
    "cp ctx tp2cp2->tp2": (T(tp=2, cp=2), T(tp=2), ModelShape()),
    "cp gen tp1->tp2cp2": (T(), T(tp=2, cp=2), ModelShape()),
    "cp both tp2cp2pp2->tp4cp2": (T(tp=2, cp=2, pp=2), T(tp=4, cp=2), ModelShape()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_oracle_byte_exact(name):
    ctx_topo, gen_topo, model = CASES[name]
    num_tokens = 40  # a partial last block for every block size used
    ctx = make_instance("ctx", ctx_topo, model)
    gen = make_instance("gen", gen_topo, model, fill=0xEE)
    report = simulate_transfer(
        ctx, gen, model, num_tokens, _ids(ctx_topo, model, num_tokens, 1), _ids(gen_topo, model, num_tokens, 2)
    )
    assert set(report.writers) == {g.info.rank for g in gen}


def test_oracle_attention_dp_groups():
    """ctx tp4 split in 2 DP groups (2 ranks each) -> gen tp4 in 4 DP groups: one group each side."""
    model = ModelShape(total_kv_heads=2)
    ctx = [r for r in make_instance("ctx", T(tp=4, dp=2), model) if r.info.dp_rank == 1]
    gen_all = make_instance("gen", T(tp=4, dp=4), model, fill=0xEE)
    for d in range(4):
        gen = [r for r in gen_all if r.info.dp_rank == d]
        report = simulate_transfer(ctx, gen, model, 40, _ids(T(), model, 40, 1), _ids(T(), model, 40, 2))
        # gen ranks hold both heads (tp_per_dp=1): ctx ranks 2 and 3 hold one head each.
        assert report.writers == {d: [2, 3]}


def _sabotaged(how):
    def wrapped(*args):
        plan = plan_write(*args)
        if plan is None or len(plan) == 0:
            return plan
        src, dst, sizes = plan.src_ptrs.copy(), plan.dst_ptrs.copy(), plan.sizes.copy()
        if how == "duplicate":
            src, dst, sizes = (np.concatenate([a, a[:1]]) for a in (src, dst, sizes))
        elif how == "drop":
            src, dst, sizes = src[1:], dst[1:], sizes[1:]
        elif how == "shift_src":
            src[0] += np.uint64(sizes[0] // 2)
        return TransferPlan(src, dst, sizes)

    return wrapped


@pytest.mark.parametrize("how", ["duplicate", "drop", "shift_src"])
def test_oracle_catches_a_wrong_plan(monkeypatch, how):
    """The oracle is not vacuous: a duplicated, missing or misaddressed fragment fails it."""
    model, ctx_topo, gen_topo = ModelShape(), T(tp=2), T(pp=2)
    monkeypatch.setattr(testing, "plan_write", _sabotaged(how))
    ctx, gen = make_instance("ctx", ctx_topo, model), make_instance("gen", gen_topo, model, fill=0xEE)
    with pytest.raises(AssertionError, match="written|differ"):
        simulate_transfer(ctx, gen, model, 40, _ids(ctx_topo, model, 40, 1), _ids(gen_topo, model, 40, 2))
