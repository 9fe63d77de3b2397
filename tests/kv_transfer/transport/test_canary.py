"""First-contact canary (canary.py): before a generation rank takes KV from a context instance it has
not seen, a pattern goes through the real mapping and is checked byte by byte on the receiver. A
mapper that misplaces bytes, or a transport that corrupts them, fails first contact with the first
wrong coordinate, and no request reads KV from that pair; a later contact checks again."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvt_instance import (Topology, build_instance, ctx_block_ids, fill, mismatches, offer_and_ask, pump_until,
                          shutdown)
from pdserve.kv_transfer import canary
from pdserve.kv_transfer.agents.faults import FaultPlan
from pdserve.kv_transfer.write_plan import TransferPlan
from pdserve.kv_transfer.transceiver import sender as transceiver

pytestmark = pytest.mark.faults
SLOTS = {"canary_slots": canary.CANARY_SLOTS}


def _settle(ranks, timeout_s: float = 10) -> None:
    """Poll both sides until neither holds a session (the canary's included)."""
    deadline = time.monotonic() + timeout_s
    while any(r.tx.has_inflight_transfer() for r in ranks) and time.monotonic() < deadline:
        for r in ranks:
            r.tx.check_context_transfer_status()
            r.tx.check_gen_transfer_status()
        time.sleep(0.001)
    assert not any(r.tx.has_inflight_transfer() for r in ranks), "sessions left"


@pytest.mark.parametrize("ctx_topo, gen_topo", [
    (Topology("ctx"), Topology("gen")),
    (Topology("ctx", tp=2, layout="NHD"), Topology("gen", pp=2, layout="NHD")),
    (Topology("ctx", tokens_per_block=8), Topology("gen", tp=2, tokens_per_block=4)),
    (Topology("ctx", pp=2, heads=4), Topology("gen", tp=4, heads=4)),
])
def test_the_canary_passes_and_the_held_request_follows_byte_exact(pair, caplog, ctx_topo, gen_topo):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer.transceiver")
    ctx, gen = pair(ctx_topo, gen_topo, ctx_options=SLOTS, gen_options=SLOTS)
    ids_g = offer_and_ask(ctx, gen, 1, 21)
    results = pump_until(gen, "gen", 1, 10, also=ctx)
    assert all(done == [1] and not failed for done, failed in results.values()), results
    assert [mismatches(r, ids_g, 21) for r in gen] == [0] * len(gen)
    passed = [m for m in caplog.messages if "first-contact canary with" in m and "passed" in m]
    assert len(passed) == len(gen), caplog.messages
    tokens = canary.canary_tokens(ctx[0].info, gen[0].info)
    for r in gen:  # the pattern really landed: every byte the gen rank holds of it
        assert canary.check(r.info, canary.canary_block_ids(r.info, tokens), tokens) is None
    # The second request of the pair is not held: no second canary.
    _settle(ctx + gen)
    offer_and_ask(ctx, gen, 2, 9)
    pump_until(gen, "gen", 1, 10, also=ctx)
    assert len([m for m in caplog.messages if "first-contact canary with" in m]) == len(gen)
    _settle(ctx + gen)


def _misplacing(real):
    """plan_write with every fragment landing where the next one should: a mapper bug."""
    def plan(*args, **kwargs):
        p = real(*args, **kwargs)
        return None if p is None else TransferPlan(p.src_ptrs, np.roll(p.dst_ptrs, 1), p.sizes)
    return plan


def test_a_mapper_that_misplaces_bytes_fails_first_contact_and_no_kv_is_taken(pair, monkeypatch):
    ctx, gen = pair(Topology("ctx", heads=4), Topology("gen", tp=2, heads=4), ctx_options=SLOTS, gen_options=SLOTS)
    monkeypatch.setattr(transceiver, "plan_write", _misplacing(transceiver.plan_write))
    ids_g = offer_and_ask(ctx, gen, 3, 16)
    results = pump_until(gen, "gen", 1, 10, also=ctx)
    for done, failed in results.values():
        assert done == [] and "the first-contact canary with the context instance at" in failed[3], failed
        assert "canary bytes differ in layer" in failed[3] and "first at KV head" in failed[3]
    for r in gen:  # the request's own blocks were never written
        assert not r.kv()[ids_g].any()
    _settle(ctx + gen)  # the context side got a CANCEL: its send session of request 3 ended too
    monkeypatch.undo()  # the mapper fixed (a restarted instance, say): the next contact checks again
    ids_g = offer_and_ask(ctx, gen, 4, 16)
    results = pump_until(gen, "gen", 1, 10, also=ctx)
    assert all(done == [4] for done, _ in results.values()), results
    assert [mismatches(r, ids_g, 16) for r in gen] == [0, 0]
    _settle(ctx + gen)


def test_a_corrupted_canary_fails_first_contact_and_the_next_contact_passes(pair):
    ctx, gen = pair(ctx_options={**SLOTS, "faults": FaultPlan(corrupt_rate=1.0, seed=5)}, gen_options=SLOTS)
    offer_and_ask(ctx, gen, 5, 12)
    results = pump_until(gen, "gen", 1, 10, also=ctx)
    assert "first-contact canary" in results[0][1][5] and "1 of " in results[0][1][5], results
    assert ctx[0].tx.agent.injected["corrupted_writes"] == 1  # only the canary was written
    _settle(ctx + gen)
    ctx[0].tx.agent.plan = FaultPlan()
    ids_g = offer_and_ask(ctx, gen, 6, 12)
    assert pump_until(gen, "gen", 1, 10, also=ctx)[0] == ([6], {})
    assert mismatches(gen[0], ids_g, 12) == 0
    _settle(ctx + gen)


def test_a_request_cancelled_while_held_ends_at_once_on_both_sides(pair):
    ctx, gen = pair(ctx_options=SLOTS, gen_options=SLOTS)
    offer_and_ask(ctx, gen, 7, 12)
    assert gen[0].tx.recv_sessions[7].held  # still behind the canary
    assert gen[0].tx.cancel_request(7) is True
    assert 7 not in gen[0].tx.recv_sessions
    results = pump_until(ctx, "ctx", 1, 10, also=gen)  # the context side hears the CANCEL
    assert 7 in results[0][1] and "cancelled" in results[0][1][7]
    _settle(ctx + gen)  # and the canary itself finished


def test_a_silent_context_instance_times_the_held_request_out_naming_the_canary(pair):
    ctx, gen = pair(timeout_ms=300, ctx_options=SLOTS, gen_options=SLOTS)
    offer_and_ask(ctx, gen, 8, 12)
    results = pump_until(gen, "gen", 1, 10)  # the context side is never polled: nothing is written
    assert "first-contact canary" in results[0][1][8], results


@pytest.mark.parametrize("rid", [2**63 + 5, 2**64 + 1, canary.canary_disagg_id("gen", "tcp://127.0.0.1:1")])
def test_an_offered_request_in_the_canary_id_range_is_reported_like_any_other(pair, rid):
    """A canary is known by how its send began (a canary REQUEST_DATA), not by its id: an offer nobody
    pulls fails at kv_transfer_timeout_ms and is reported, whatever its id, so the engine frees its KV
    (an id of 2**64 + 1 held its blocks until the process died). And a pulled one is reported done."""
    ctx, gen = pair(timeout_ms=300, ctx_options=SLOTS, gen_options=SLOTS)
    ids_c = ctx_block_ids(Topology("ctx", tokens_per_block=ctx[0].info.tokens_per_block), 12)
    ctx[0].tx.respond_and_send_async(rid, {0: ids_c})
    failed = pump_until(ctx, "ctx", 1, 5)[0][1]
    assert "timed out" in failed[rid], failed
    _settle(ctx + gen)
    ctx, gen = pair(ctx_options=SLOTS, gen_options=SLOTS)
    if rid < 2**64:  # (the control plane's ids are msgpack's: at most 2**64 - 1)
        offer_and_ask(ctx, gen, rid, 12)
        assert pump_until(ctx, "ctx", 1, 10, also=gen)[0] == ([rid], {})
        _settle(ctx + gen)


def test_canaries_with_two_context_instances_run_one_at_a_time(pair):
    ctx_a, gen = pair(ctx_options=SLOTS, gen_options=SLOTS)
    ctx_b = build_instance(Topology("ctx-b", tokens_per_block=8), "fake", canary_slots=canary.CANARY_SLOTS)
    try:
        ids_a = offer_and_ask(ctx_a, gen, 9, 12)
        ids_b = np.array([1, 2], np.int64)  # gen blocks not used by request 9
        fill(ctx_b[0], ctx_block_ids(Topology("ctx-b", tokens_per_block=8), 12))
        ctx_b[0].tx.respond_and_send_async(10, {0: ctx_block_ids(Topology("ctx-b", tokens_per_block=8), 12)})
        gen[0].tx.request_and_receive_async(10, ctx_b[0].tx.endpoint, {0: np.r_[ids_b, 3]})
        started = [g for g in gen[0].tx.canary_gates.values() if g.started]
        assert len(gen[0].tx.canary_gates) == 2 and len(started) == 1
        results = pump_until(gen, "gen", 2, 10, also=ctx_a + ctx_b)
        assert sorted(results[0][0]) == [9, 10] and not results[0][1], results
        assert mismatches(gen[0], ids_a, 12) == 0 and mismatches(gen[0], np.r_[ids_b, 3], 12) == 0
        _settle(ctx_a + ctx_b + gen)
    finally:
        shutdown(ctx_b)


def test_a_pair_without_canary_blocks_is_served_unchecked(pair, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer.transceiver")
    ctx, gen = pair(ctx_options={"canary_slots": 0}, gen_options=SLOTS)  # the context side reserved none
    ids_g = offer_and_ask(ctx, gen, 11, 12)
    assert pump_until(gen, "gen", 1, 10, also=ctx)[0] == ([11], {})
    assert mismatches(gen[0], ids_g, 12) == 0
    assert any("not checked by a first-contact canary" in m for m in caplog.messages)


def test_the_pattern_depends_on_every_coordinate():
    p = canary.pattern(3, 4, 8, 16)
    assert p.shape == (3, 2, 4, 8, 16) and p.dtype == np.uint8
    for axis in range(5):  # moving one step along any axis changes most bytes
        a, b = np.take(p, 0, axis=axis), np.take(p, 1, axis=axis)
        assert (a != b).mean() > 0.9
    assert canary.canary_disagg_id("gen", "tcp://a:1") != canary.canary_disagg_id("gen", "tcp://a:2")
    assert canary.is_canary(canary.canary_disagg_id("gen", "tcp://a:1")) and not canary.is_canary((1 << 63) - 1)
