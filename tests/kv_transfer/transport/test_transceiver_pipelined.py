"""Pipelined (chunked) sends through the transceiver: the sender ships each prefill chunk as it is
computed, the receiver posts one whole slice and completes only with the last chunk. In-process
over the fake agent for the protocol, and between processes over shm and NIXL for the bytes."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from kvt_instance import (
    Topology,
    build_instance,
    ctx_block_ids,
    expected,
    fill,
    gen_block_ids,
    mismatches,
    pump_until,
    shutdown,
)
from pdserve.kv_transfer.chunking import chunk_blocks
from pdserve.kv_transfer.errors import KVTransferError

TIMEOUT_S = 40
STATE = b"first-token:42"


def chunks_of(topo: Topology, num_tokens: int, chunk_tokens: int, reused: int = 0):
    """The chunks a context rank ships for a prompt prefilled `chunk_tokens` at a time after a
    reused prefix of `reused` tokens (skipping chunks with nothing to ship, as an engine does)."""
    ids = {0: ctx_block_ids(topo, num_tokens)}
    out = []
    for start in range(reused, num_tokens, chunk_tokens):
        chunk = chunk_blocks(ids, {0: None}, tokens_per_block=topo.tokens_per_block, chunk_start=start,
                             chunk_end=min(start + chunk_tokens, num_tokens), prompt_len=num_tokens,
                             reused_len=reused)
        if chunk.should_send:
            out.append(chunk)
    return out


def offer(rank, rid: int, chunk) -> None:
    rank.tx.respond_and_send_async(rid, chunk.block_ids, token_range=(chunk.token_start, chunk.token_end),
                                   last=chunk.is_last, state=STATE if chunk.is_last else b"")


def _poll(gen_ranks, ctx_ranks, rounds: int = 20):
    """A few polling rounds on both sides; returns the generation side's merged results."""
    from pdserve.kv_transfer.sessions import TransferResults

    out = TransferResults()
    for _ in range(rounds):
        for c in ctx_ranks:
            c.tx.check_context_transfer_status()
        for g in gen_ranks:
            out.merge(g.tx.check_gen_transfer_status())
        time.sleep(0.002)
    return out


def test_receiver_completes_only_with_the_last_chunk_and_gets_exact_tokens_and_state(pair):
    ctx_ranks, gen_ranks = pair(Topology("ctx", tp=2), Topology("gen", pp=2))
    n = 23  # 5 full blocks of 4 and a partial one
    ids_g = gen_block_ids(Topology("gen"), n)
    chunks = chunks_of(Topology("ctx"), n, chunk_tokens=6, reused=5)
    assert len(chunks) == 3 and chunks[0].token_start == 0 and chunks[-1].token_end == n
    for r in ctx_ranks:
        fill(r, ctx_block_ids(Topology("ctx"), n))
    # Generation first: the receiver asks before the context side has computed anything.
    for g in gen_ranks:
        g.tx.request_and_receive_async(1, ctx_ranks[0].tx.endpoint, {0: ids_g}, (0, n))
    for chunk in chunks[:-1]:
        for r in ctx_ranks:
            offer(r, 1, chunk)
        assert len(_poll(gen_ranks, ctx_ranks, rounds=5)) == 0  # not done before the last chunk
    for r in ctx_ranks:
        offer(r, 1, chunks[-1])
    res = pump_until(gen_ranks, "gen", 1, 5, also=ctx_ranks)
    assert all(c == [1] and not f for c, f in res.values()), res
    assert [mismatches(g, ids_g, n) for g in gen_ranks] == [0, 0]
    assert all(r.tx.stats["direct_writes"] == 2 * len(chunks) for r in ctx_ranks)  # per chunk, per gen rank
    _poll(gen_ranks, ctx_ranks, rounds=5)  # the context side's sessions end once its writes are polled
    assert not any(r.tx.has_inflight_transfer() for r in ctx_ranks + gen_ranks)


def test_results_carry_the_delivered_token_count_and_the_state(pair):
    (ctx,), (gen,) = pair()
    n = 10
    ids_g = gen_block_ids(Topology("gen"), n)
    fill(ctx, ctx_block_ids(Topology("ctx"), n))
    gen.tx.request_and_receive_async(2, ctx.tx.endpoint, {0: ids_g}, (0, n))
    for chunk in chunks_of(Topology("ctx"), n, chunk_tokens=4):
        offer(ctx, 2, chunk)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ctx.tx.check_context_transfer_status()
        res = gen.tx.check_gen_transfer_status()
        if res.completed:
            break
    assert res.completed == [2] and res.tokens == {2: n} and res.states == {2: STATE}
    assert mismatches(gen, ids_g, n) == 0


def test_request_arriving_mid_prefill_gets_the_chunks_so_far_at_once(pair):
    (ctx,), (gen,) = pair()
    n = 16
    ids_g = gen_block_ids(Topology("gen"), n)
    fill(ctx, ctx_block_ids(Topology("ctx"), n))
    chunks = chunks_of(Topology("ctx"), n, chunk_tokens=4)
    for chunk in chunks[:2]:
        offer(ctx, 3, chunk)
    gen.tx.request_and_receive_async(3, ctx.tx.endpoint, {0: ids_g}, (0, n))
    deadline = time.monotonic() + 5  # the request crosses a socket: under load 5 polling rounds were too few
    while ctx.tx.stats["direct_writes"] < 2 and time.monotonic() < deadline:
        _poll([gen], [ctx], rounds=1)
    assert ctx.tx.stats["direct_writes"] == 2  # the two chunks offered before the request, no more
    for chunk in chunks[2:]:
        offer(ctx, 3, chunk)
    with pytest.raises(KVTransferError, match="already being sent"):
        offer(ctx, 3, chunks[-1])
    pump_until([gen], "gen", 1, 5, also=[ctx])
    assert mismatches(gen, ids_g, n) == 0 and ctx.tx.stats["direct_writes"] == len(chunks)


def test_cancel_mid_pipeline_drops_later_chunks_and_leaves_nothing(pair):
    (ctx,), (gen,) = pair()
    n = 16
    ids_g = gen_block_ids(Topology("gen"), n)
    chunks = chunks_of(Topology("ctx"), n, chunk_tokens=4)
    regions = [r.tx.agent.registered_regions for r in (ctx, gen)]
    gen.tx.request_and_receive_async(4, ctx.tx.endpoint, {0: ids_g}, (0, n))
    offer(ctx, 4, chunks[0])
    _poll([gen], [ctx], rounds=5)
    deadline = time.monotonic() + 5
    failed = {}
    while not gen.tx.cancel_request(4):
        failed.update(ctx.tx.check_context_transfer_status().failed)
        assert time.monotonic() < deadline, "the receiver never settled after its cancel"
    failed.update(ctx.tx.check_context_transfer_status(at_least=1).failed)
    assert "cancelled" in failed[4]
    offer(ctx, 4, chunks[1])  # a prefill still running: a chunk of an ended send is dropped, not parked
    assert ctx.tx.stats["direct_writes"] == 1 and not ctx.tx.send_sessions
    assert not ctx.tx.has_inflight_transfer() and not gen.tx.has_inflight_transfer()
    assert [r.tx.agent.registered_regions for r in (ctx, gen)] == regions


def test_receiver_cancel_with_a_chunk_in_flight_settles_only_after_it_landed(pair):
    (ctx,), (gen,) = pair()
    n = 16
    ids_g = gen_block_ids(Topology("gen"), n)
    chunks = chunks_of(Topology("ctx"), n, chunk_tokens=8)
    fill(ctx, ctx_block_ids(Topology("ctx"), n))
    gen.tx.request_and_receive_async(5, ctx.tx.endpoint, {0: ids_g}, (0, n))
    ctx.tx.agent.pause()
    offer(ctx, 5, chunks[0])
    deadline = time.monotonic() + 5
    while not ctx.tx.send_sessions[5].writes and time.monotonic() < deadline:
        ctx.tx.check_context_transfer_status()
    assert ctx.tx.send_sessions[5].writes, "the first chunk's write was never submitted"
    assert gen.tx.cancel_request(5) is False
    _poll([gen], [ctx], rounds=10)
    assert gen.tx.cancel_request(5) is False  # the paused write may still land: blocks stay reserved
    ctx.tx.agent.resume()
    deadline = time.monotonic() + 5
    while not gen.tx.cancel_request(5):
        ctx.tx.check_context_transfer_status()
        assert time.monotonic() < deadline, "the receiver never settled after the write landed"
    got = gen.kv()[ids_g[:2]]
    assert np.array_equal(got, expected(gen, 2))  # the landed chunk is whole; nothing after it came


# -- between processes ------------------------------------------------------------------------------

def fill_computed(rank, block_ids: np.ndarray, num_tokens: int) -> None:
    """The oracle KV of the first `num_tokens` tokens, zeros after: what prefill has computed so far.
    A block shipped before all its tokens were computed would reach the receiver with zeros."""
    tpb = rank.info.tokens_per_block
    token_axis = 4 if rank.info.page_table.mapper_kind.name == "HND" else 3
    shape = [len(block_ids), 1, 1, 1, 1, 1]
    shape[token_axis] = tpb
    computed = (np.arange(len(block_ids))[:, None] * tpb + np.arange(tpb)[None, :] < num_tokens).reshape(shape)
    rank.kv()[block_ids] = np.where(computed, expected(rank, len(block_ids)), 0)


def run_pipelined_ctx(topo: Topology, backend: str, num_tokens: int, chunk_tokens: int, outbox, inbox) -> None:
    """Child process: a context instance that prefills chunk by chunk after the receiver asked,
    offering each chunk right after computing it."""
    ranks = build_instance(topo, backend)
    outbox.put(ranks[0].tx.endpoint)
    inbox.get(timeout=TIMEOUT_S)  # the receiver has posted its request: prefill starts now
    ids = ctx_block_ids(topo, num_tokens)
    results = {r.info.rank: ([], {}) for r in ranks}

    def check(r) -> None:
        res = r.tx.check_context_transfer_status()
        results[r.info.rank][0].extend(res.completed)
        results[r.info.rank][1].update(res.failed)

    for start in range(0, num_tokens, chunk_tokens):
        end = min(start + chunk_tokens, num_tokens)
        chunk = chunk_blocks({0: ids}, {0: None}, tokens_per_block=topo.tokens_per_block, chunk_start=start,
                             chunk_end=end, prompt_len=num_tokens)
        for r in ranks:
            fill_computed(r, ids, end)
            if chunk.should_send:
                offer(r, 7, chunk)
            check(r)
        time.sleep(0.01)  # the next prefill step
    deadline = time.monotonic() + TIMEOUT_S
    while not all(c or f for c, f in results.values()) and time.monotonic() < deadline:
        for r in ranks:
            check(r)
        time.sleep(0.001)
    leftovers = sum(len(r.tx.send_sessions) + len(r.tx.parked_requests) for r in ranks)
    outbox.put((results, leftovers, [r.tx.stats["direct_writes"] for r in ranks]))
    inbox.get(timeout=TIMEOUT_S)
    shutdown(ranks)


@pytest.mark.parametrize("backend", ["shm", "nixl"])
@pytest.mark.parametrize("ctx_topo, gen_topo", [(Topology("ctx", tp=2), Topology("gen", tp=1)),
                                                (Topology("ctx", tp=1), Topology("gen", pp=2))],
                         ids=["tp2-tp1", "tp1-pp2"])
def test_pipelined_transfer_between_processes_is_byte_exact(backend, ctx_topo, gen_topo):
    n, chunk_tokens = 27, 8
    spawn = mp.get_context("spawn")
    outbox, inbox = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=run_pipelined_ctx, args=(ctx_topo, backend, n, chunk_tokens, outbox, inbox),
                         daemon=True)
    proc.start()
    gen = []
    try:
        endpoint = outbox.get(timeout=TIMEOUT_S)
        gen = build_instance(gen_topo, backend)
        ids = gen_block_ids(gen_topo, n)
        for r in gen:
            r.tx.request_and_receive_async(7, endpoint, {0: ids}, (0, n))
        inbox.put("prefill")
        res = pump_until(gen, "gen", 1, TIMEOUT_S)
        assert all(c == [7] and not f for c, f in res.values()), res
        ctx_results, leftovers, writes = outbox.get(timeout=TIMEOUT_S)
        assert all(c == [7] and not f for c, f in ctx_results.values()), ctx_results
        assert leftovers == 0 and not any(r.tx.recv_sessions for r in gen)
        assert writes == [len(chunks_of(ctx_topo, n, chunk_tokens)) * len(gen)] * ctx_topo.tp * ctx_topo.pp
        assert {r.info.rank: mismatches(r, ids, n) for r in gen} == {r.info.rank: 0 for r in gen}
        inbox.put("bye")
    finally:
        shutdown(gen, proc, TIMEOUT_S)


def test_context_side_cancel_mid_pipeline_tells_the_waiting_receiver(pair):
    (ctx,), (gen,) = pair()
    n = 16
    gen.tx.request_and_receive_async(6, ctx.tx.endpoint, {0: gen_block_ids(Topology("gen"), n)}, (0, n))
    offer(ctx, 6, chunks_of(Topology("ctx"), n, chunk_tokens=4)[0])
    _poll([gen], [ctx], rounds=5)
    assert ctx.tx.cancel_request(6) is True  # the first chunk landed: nothing in flight
    res = gen.tx.check_gen_transfer_status(at_least=1)
    assert "context side cancelled" in res.failed[6]  # told at once, not at its timeout
    assert not gen.tx.has_inflight_transfer() and not ctx.tx.has_inflight_transfer()
