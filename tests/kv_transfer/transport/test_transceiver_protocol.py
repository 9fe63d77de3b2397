"""Transceiver protocol against the in-process fake agent: cancellation, timeouts, cleanup, polling."""

from __future__ import annotations

import time

import pytest

from kvt_instance import Topology, ctx_block_ids, fill, gen_block_ids, mismatches, pump_until
from pdserve.kv_transfer.errors import KVTransferError


def _eventually(cond, timeout_s=5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.002)
    return False


def _regions(ranks):
    return [r.tx.agent.registered_regions for r in ranks]


def test_cancel_while_write_in_flight_is_false_then_true(pair):
    (ctx,), (gen,) = pair()
    ids_c, ids_g = ctx_block_ids(Topology("ctx"), 12), gen_block_ids(Topology("gen"), 12)
    fill(ctx, ids_c)
    regions_before = _regions([ctx, gen])
    ctx.tx.agent.pause()
    gen.tx.request_and_receive_async(1, ctx.tx.endpoint, {0: ids_g})
    ctx.tx.respond_and_send_async(1, {0: ids_c})
    deadline = time.monotonic() + 5
    while not ctx.tx.send_sessions[1].writes and time.monotonic() < deadline:
        ctx.tx.check_context_transfer_status()
    assert ctx.tx.send_sessions[1].writes, "the write was never submitted"
    assert ctx.tx.cancel_request(1) is False  # bytes may still land: the caller must keep the KV
    assert ctx.tx.cancel_request(1) is False
    ctx.tx.agent.resume()
    assert ctx.tx.cancel_request(1) is True
    assert not ctx.tx.send_sessions and not ctx.tx.has_inflight_transfer()
    res = pump_until([gen], "gen", 1, 5)
    assert res[0][0] == [1] and mismatches(gen, ids_g, 12) == 0
    assert _regions([ctx, gen]) == regions_before


def test_gen_cancel_before_ctx_responds_settles_and_leaves_nothing(pair):
    (ctx,), (gen,) = pair()
    gen.tx.request_and_receive_async(5, ctx.tx.endpoint, {0: gen_block_ids(Topology("gen"), 8)})
    assert gen.tx.cancel_request(5) is False  # the ctx rank has not confirmed it will not write
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ctx.tx.check_context_transfer_status()
        if gen.tx.cancel_request(5):
            break
    assert not gen.tx.recv_sessions and not ctx.tx.parked_requests
    # A late respond for a request nobody wants any more does not hang: it times out cleanly.
    assert not ctx.tx.has_inflight_transfer() and not gen.tx.has_inflight_transfer()


def test_timeout_errors_out_and_releases_everything(pair):
    (ctx,), (gen,) = pair(timeout_ms=200)
    regions_before = _regions([ctx, gen])
    ctx.tx.respond_and_send_async(9, {0: ctx_block_ids(Topology("ctx"), 8)})  # nobody asks
    t0 = time.monotonic()
    res = ctx.tx.check_context_transfer_status(at_least=1)
    assert time.monotonic() - t0 < 2
    assert res.completed == [] and "timed out" in res.failed[9]
    assert not ctx.tx.send_sessions and _regions([ctx, gen]) == regions_before


def test_gen_timeout_when_context_never_responds(pair):
    (ctx,), (gen,) = pair(timeout_ms=200)
    gen.tx.request_and_receive_async(4, ctx.tx.endpoint, {0: gen_block_ids(Topology("gen"), 8)})
    res = gen.tx.check_gen_transfer_status(at_least=1)
    assert "timed out waiting for context ranks ctx rank 0" in res.failed[4]
    assert not gen.tx.recv_sessions
    # The abandoned request is cancelled on the context side too (CANCEL arrives asynchronously).
    assert _eventually(lambda: ctx.tx.check_context_transfer_status() is not None and not ctx.tx.parked_requests)


def test_at_least_is_clamped_to_sessions_in_flight(pair):
    (ctx,), (gen,) = pair()
    t0 = time.monotonic()
    assert len(gen.tx.check_gen_transfer_status(at_least=5)) == 0
    assert len(ctx.tx.check_context_transfer_status(at_least=5)) == 0
    assert time.monotonic() - t0 < 0.5


def test_full_round_trip_and_duplicate_ids_rejected(pair):
    ctx_ranks, gen_ranks = pair(Topology("ctx", tp=2), Topology("gen", pp=2))
    ids_c, ids_g = ctx_block_ids(Topology("ctx"), 10), gen_block_ids(Topology("gen"), 10)
    for r in ctx_ranks:
        fill(r, ids_c)
        r.tx.respond_and_send_async(2, {0: ids_c})
    with pytest.raises(KVTransferError, match="already being sent"):
        ctx_ranks[0].tx.respond_and_send_async(2, {0: ids_c})
    for r in gen_ranks:
        r.tx.request_and_receive_async(2, ctx_ranks[0].tx.endpoint, {0: ids_g})
    pump_until(gen_ranks, "gen", 1, 5, also=ctx_ranks)
    assert [mismatches(r, ids_g, 10) for r in gen_ranks] == [0, 0]
    assert _eventually(lambda: [r.tx.check_context_transfer_status() for r in ctx_ranks]
                       and not any(r.tx.send_sessions for r in ctx_ranks))
    assert not any(r.tx.has_inflight_transfer() for r in ctx_ranks + gen_ranks)


def test_unknown_context_endpoint_fails_fast_and_registers_nothing(pair):
    from pdserve.kv_transfer.control.messenger import Messenger

    (ctx,), (gen,) = pair()
    silent = Messenger(lambda m: None)
    object.__setattr__(gen.tx.config, "rank_info_timeout_s", 0.2)  # frozen config; test-only override
    try:
        with pytest.raises(TimeoutError, match=silent.endpoint):
            gen.tx.request_and_receive_async(1, silent.endpoint, {0: gen_block_ids(Topology("gen"), 8)})
        assert not gen.tx.recv_sessions
    finally:
        silent.close()
