"""Transceiver end to end: a context instance in a spawned process writes into this process's
generation instance over shm or NIXL; every received int32 is checked against the oracle."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from kvt_instance import Topology, build_instance, gen_block_ids, mismatches, pump_until, run_ctx_instance, shutdown

TIMEOUT_S = 40

CASES = [
    # (ctx topology, gen topology, num_tokens)
    (Topology("ctx", tp=1), Topology("gen", tp=1), 13),
    (Topology("ctx", tp=2), Topology("gen", tp=1), 16),
    (Topology("ctx", tp=1), Topology("gen", tp=2), 9),
    (Topology("ctx", pp=2), Topology("gen", tp=2), 16),
    (Topology("ctx", tp=2), Topology("gen", pp=2), 11),
    (Topology("ctx", tp=2, layout="NHD"), Topology("gen", tp=1, layout="NHD"), 16),
    (Topology("ctx", tp=1, heads=1), Topology("gen", tp=2, heads=1), 8),  # head duplication on gen
]


def _run(ctx_topo, gen_topo, num_tokens, backend, respond_delay_s=0.0, requests=(7,), ctx_bounce=None,
         gen_bounce=None, stats=None):
    spawn = mp.get_context("spawn")
    outbox, inbox = spawn.Queue(), spawn.Queue()
    reqs = {rid: num_tokens for rid in requests}
    proc = spawn.Process(target=run_ctx_instance,
                         args=(ctx_topo, backend, reqs, outbox, inbox, respond_delay_s, 30.0, ctx_bounce), daemon=True)
    proc.start()
    gen = []
    try:
        endpoint = outbox.get(timeout=TIMEOUT_S)
        gen = build_instance(gen_topo, backend, bounce=gen_bounce)
        ids = gen_block_ids(gen_topo, num_tokens)
        for rid in requests:
            for r in gen:
                r.tx.request_and_receive_async(rid, endpoint, {0: ids}, (0, num_tokens))
        gen_results = pump_until(gen, "gen", len(requests), TIMEOUT_S)
        ctx_results, ctx_leftovers, ctx_stats = outbox.get(timeout=TIMEOUT_S)
        if stats is not None:
            stats.extend(ctx_stats)
        wrong = {r.info.rank: mismatches(r, ids, num_tokens) for r in gen}
        leftovers = sum(len(r.tx.recv_sessions) for r in gen)
        leased = [r.tx.staging.free_bytes == r.tx.staging.nbytes for r in gen if r.tx.staging is not None]
        assert all(leased), "a receive session kept its bounce staging lease"
        inbox.put("bye")
        return gen_results, ctx_results, wrong, leftovers + ctx_leftovers
    finally:
        shutdown(gen, proc, TIMEOUT_S)


@pytest.mark.parametrize("ctx_topo, gen_topo, num_tokens", CASES[:3], ids=lambda x: getattr(x, "tp", x))
@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_byte_exact_kv_between_processes(backend, ctx_topo, gen_topo, num_tokens):
    gen_results, ctx_results, wrong, leftovers = _run(ctx_topo, gen_topo, num_tokens, backend)
    assert all(c == [7] and not f for c, f in gen_results.values()), gen_results
    assert all(c == [7] and not f for c, f in ctx_results.values()), ctx_results
    assert wrong == {r: 0 for r in wrong}
    assert leftovers == 0


@pytest.mark.slow
@pytest.mark.parametrize("ctx_topo, gen_topo, num_tokens", CASES[3:],
                         ids=["pp2-tp2", "tp2-pp2", "nhd-tp2-tp1", "dup-tp1-tp2"])
def test_byte_exact_kv_more_topologies_shm(ctx_topo, gen_topo, num_tokens):
    gen_results, ctx_results, wrong, leftovers = _run(ctx_topo, gen_topo, num_tokens, "shm")
    assert all(c == [7] and not f for c, f in gen_results.values()), gen_results
    assert wrong == {r: 0 for r in wrong} and leftovers == 0


def test_generation_first_and_several_requests_nixl():
    """REQUEST_DATA arrives before the context side responds (parked, then served)."""
    gen_results, ctx_results, wrong, leftovers = _run(
        Topology("ctx", pp=2), Topology("gen", tp=2), 16, "nixl", respond_delay_s=0.5, requests=(3, 4))
    assert all(sorted(c) == [3, 4] and not f for c, f in gen_results.values()), gen_results
    assert wrong == {r: 0 for r in wrong} and leftovers == 0


BOUNCE = dict(staging_bytes=8 << 20)
NHD_CTX = Topology("ctx", tp=1, layout="NHD", num_blocks=224)
NHD_GEN = Topology("gen", tp=2, layout="NHD", num_blocks=224)


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_bounce_nhd_head_mismatch_is_byte_exact_with_one_write(backend):
    from pdserve.kv_transfer.bounce import BounceConfig

    stats = []
    gen_results, ctx_results, wrong, leftovers = _run(
        NHD_CTX, NHD_GEN, 96 * 4 + 3, backend, ctx_bounce=BounceConfig(**BOUNCE), gen_bounce=BounceConfig(**BOUNCE),
        stats=stats)
    assert all(c == [7] and not f for c, f in gen_results.values()), gen_results
    assert wrong == {0: 0, 1: 0} and leftovers == 0
    assert stats == [{"direct_writes": 0, "bounced_writes": 2, "fragments_written": 2,
                      "bytes_written": stats[0]["bytes_written"]}]


def test_bounce_parameter_mismatch_falls_back_to_direct(caplog):
    from pdserve.kv_transfer.bounce import BounceConfig

    stats = []
    gen_results, _, wrong, leftovers = _run(
        NHD_CTX, NHD_GEN, 96 * 4, "shm", ctx_bounce=BounceConfig(min_fragments=512, **BOUNCE),
        gen_bounce=BounceConfig(**BOUNCE), stats=stats)
    assert all(c == [7] for c, _ in gen_results.values()) and wrong == {0: 0, 1: 0} and leftovers == 0
    assert stats[0]["bounced_writes"] == 0 and stats[0]["direct_writes"] == 2
    assert stats[0]["fragments_written"] == 2 * 4 * 2 * 96 * 4  # per gen rank: layers x K/V x tokens


SIM_CASES = [
    # (ctx topology, gen topology, model), built with arith's pdserve.testing.kv_oracle
    ("tp4->tp2pp2", dict(tp=4), dict(tp=2, pp=2), dict(num_layers=4, total_kv_heads=4)),
    ("tp2pp2->tp4 tpb16->32", dict(tp=2, pp=2), dict(tp=4, tokens_per_block=32, num_blocks=4),
     dict(num_layers=4, total_kv_heads=4)),
    ("layer-major 2 groups, heads<tp on ctx", dict(tp=4, pool_kind="layer_major"),
     dict(tp=1, pool_kind="layer_major"), dict(num_layers=4, total_kv_heads=2, num_layer_groups=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ctx_kw, gen_kw, model_kw", SIM_CASES, ids=[c[0] for c in SIM_CASES])
def test_byte_exact_kv_arith_topologies_shm(name, ctx_kw, gen_kw, model_kw):
    from pdserve.testing import kv_oracle as sim

    import kvt_sim_instance as kvs

    model, ctx_topo, gen_topo = sim.ModelShape(**model_kw), sim.Topology(**ctx_kw), sim.Topology(**gen_kw)
    num_tokens = 40
    spawn = mp.get_context("spawn")
    outbox, inbox = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=kvs.run_ctx, args=(ctx_topo, model, "shm", num_tokens, outbox, inbox), daemon=True)
    proc.start()
    gen = []
    try:
        endpoint = outbox.get(timeout=TIMEOUT_S)
        gen = kvs.build("gen", gen_topo, model, "shm")
        ids = kvs.block_ids(gen_topo, model, num_tokens, reverse=True)
        for _, tx, _ in gen:
            tx.request_and_receive_async(1, endpoint, ids, (0, num_tokens))
        assert kvs.pump([tx for _, tx, _ in gen], False, 1, TIMEOUT_S) == [[1]] * len(gen)
        assert outbox.get(timeout=TIMEOUT_S) == [[1]] * ctx_topo.world_size
        kv = sim.logical_kv(model, num_tokens)
        for s, _, _ in gen:
            got = sim.gather_logical_kv(s, ids, num_tokens, model)
            assert np.array_equal(got, kvs.held(s, kv)), f"gen rank {s.info.rank} differs"
        inbox.put("bye")
    finally:
        for _, tx, _ in gen:
            tx.close()
            tx.agent.shutdown()
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
