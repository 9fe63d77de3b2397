"""A transfer's completion wakes whoever waits for it: the agents call their waker (set_waker) on a
finished write and on an arriving notification, and KVTransceiver.wait ends on either, so no executor
sleeps out a polling interval for KV that already landed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvt_instance import Topology, ctx_block_ids, fill, gen_block_ids, mismatches
from pdserve.kv_transfer.agents import MemoryRegion, TransferState, make_agent
from pdserve.kv_transfer.agents.shm import allocate_shared

WAIT_S = 10.0  # a bound, never reached when the wake-up works: each wait returns at the event


@pytest.mark.parametrize("backend", ["fake", "shm"])
def test_an_agent_wakes_the_target_on_a_notification_and_the_initiator_on_its_write(backend):
    a, b = make_agent(backend), make_agent(backend)
    src, dst = allocate_shared(1 << 16), allocate_shared(1 << 16)
    src.numpy()[:] = np.arange(1 << 16) % 251
    woke_a, woke_b = threading.Event(), threading.Event()
    try:
        a.register_memory(src.region)
        b.register_memory(dst.region)
        a.set_waker(woke_a.set)
        b.set_waker(woke_b.set)
        peer = a.load_remote(b.local_descriptor())
        handle = a.submit_write(peer, [src.ptr], [dst.ptr], [src.nbytes], b"landed")
        assert woke_b.wait(WAIT_S), "the notification did not wake the target's waiter"
        assert b.get_notifications() == [(a.name, b"landed")]
        assert np.array_equal(dst.numpy(), src.numpy())
        assert woke_a.wait(WAIT_S), "the finished write did not wake the initiator's waiter"
        assert a.poll(handle) is TransferState.DONE
        a.release(handle)
    finally:
        a.shutdown()
        b.shutdown()


def test_waiting_transceivers_wake_when_the_kv_lands(pair):
    """Both sides sleep in wait() with a write held in flight; releasing it wakes the receiver (its KV
    landed) and the sender (its write finished) before any timeout."""
    (ctx,), (gen,) = pair()
    ids_c, ids_g = ctx_block_ids(Topology("ctx"), 12), gen_block_ids(Topology("gen"), 12)
    fill(ctx, ids_c)
    ctx.tx.agent.pause()
    gen.tx.request_and_receive_async(1, ctx.tx.endpoint, {0: ids_g})
    ctx.tx.respond_and_send_async(1, {0: ids_c})
    while not ctx.tx.send_sessions[1].writes:
        assert ctx.tx.wait(WAIT_S), "REQUEST_DATA did not wake the context side"
        ctx.tx.check_context_transfer_status()
    assert gen.tx.check_gen_transfer_status().completed == []
    gen.tx.wait(0)  # nothing pending any more: the next wait can only end on the write
    ctx.tx.wait(0)
    release = threading.Timer(0.05, ctx.tx.agent.resume)  # the write lands on another thread
    release.start()
    try:
        assert gen.tx.wait(WAIT_S), "the KV's notification did not wake the receiver"
        assert gen.tx.check_gen_transfer_status().completed == [1]
        assert mismatches(gen, ids_g, 12) == 0
        assert ctx.tx.wait(WAIT_S), "the finished write did not wake the sender"
        assert ctx.tx.check_context_transfer_status().completed == [1]
    finally:
        release.join()


def test_wait_polls_an_agent_that_cannot_signal(pair):
    """An agent without completion events (NIXL; here a fake whose writes start late, which only a poll
    starts) is polled inside wait() while a transfer is in flight, so the write goes out and wakes the
    sender without any status call."""
    from pdserve.kv_transfer.agents.faults import FaultPlan

    (ctx,), (gen,) = pair(ctx_options={"faults": FaultPlan(delay_ms=20)})
    assert ctx.tx.agent.completion_poll_s is not None
    ids_c, ids_g = ctx_block_ids(Topology("ctx"), 12), gen_block_ids(Topology("gen"), 12)
    fill(ctx, ids_c)
    gen.tx.request_and_receive_async(1, ctx.tx.endpoint, {0: ids_g})
    ctx.tx.respond_and_send_async(1, {0: ids_c})
    while not ctx.tx.send_sessions[1].writes:
        assert ctx.tx.wait(WAIT_S), "REQUEST_DATA did not wake the context side"
        ctx.tx.check_context_transfer_status()
    assert ctx.tx.wait(WAIT_S), "the delayed write was never polled out"
    assert gen.tx.wait(WAIT_S) and gen.tx.check_gen_transfer_status().completed == [1]
    assert mismatches(gen, ids_g, 12) == 0
