"""The KV events sockets bound the frames they take (MAXMSGSIZE): the worker's PUB (which only ever
receives subscriptions) and the kv_cache_aware router's SUB. A peer announcing a bigger frame is
disconnected before libzmq buffers it; the SUB then follows on a fresh socket and resyncs. See
hostile_peer.py for how memory is measured."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from hostile_peer import FRAME, MAX_GROWTH, PeakRss, run_peer, start_peer, stop_peer
from pdserve.orchestrator.kv_cache_aware import MAX_EVENT_BYTES, KvBlockIndex, KvEventSubscriber
from pdserve.engine.block_manager import KVEvent
from pdserve.engine.kv.events import EVENTS_VERSION, KVEventBatch, KVEventPublisher


def test_kv_events_publisher_disconnects_an_oversized_subscription():
    pub = KVEventPublisher("127.0.0.1", 0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with PeakRss() as rss:
            run_peer(f"""
import time, zmq
s = zmq.Context().socket(zmq.XSUB)
s.connect({pub.endpoint!r})
s.send(b"\\x02" + bytes({FRAME}))  # not a subscription: the PUB reads it whole, then drops it
time.sleep(1.0)
s.close(linger=0)
""")
        assert rss.growth < MAX_GROWTH, f"the publisher buffered the frame: RSS grew by {rss.growth >> 20} MiB"
        sub.connect(pub.endpoint)
        sub.subscribe(b"")
        deadline = time.monotonic() + 10
        while not sub.poll(50) and time.monotonic() < deadline:  # a late joiner misses events: repeat
            pub(KVEvent("stored", [7], None))
        batch = KVEventBatch.from_bytes(sub.recv())
        assert batch.events == (KVEvent("stored", [7], None),)
    finally:
        sub.close()
        pub.close()


def test_kv_events_subscriber_disconnects_an_oversized_event_and_keeps_following():
    # The publisher waits for a subscription, sends one oversized frame, then a valid event every 50 ms.
    proc, endpoint = start_peer(f"""
import time, msgpack, zmq
s = zmq.Context().socket(zmq.XPUB)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{{port}}", flush=True)
s.recv()
s.send(bytes({FRAME}))
for _ in range(400):
    s.send(msgpack.packb({{"v": {EVENTS_VERSION}, "seq": 1, "events": [["stored", [42], None]]}}))
    time.sleep(0.05)
""")
    assert FRAME > MAX_EVENT_BYTES

    async def follow() -> tuple[bool, bool, int]:
        ctx = zmq.asyncio.Context()
        index = KvBlockIndex()

        async def snapshot():
            return 0, []

        sub = KvEventSubscriber(ctx, endpoint, index, snapshot)
        sub.start()
        try:
            deadline = time.monotonic() + 10
            while 42 not in index.hashes and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return 42 in index.hashes, not sub.task.done(), sub.reopens
        finally:
            await sub.close()
            ctx.term()

    try:
        with PeakRss() as rss:
            followed, alive, reopens = asyncio.run(asyncio.wait_for(follow(), 20))
        assert rss.growth < MAX_GROWTH, f"the subscriber buffered the frame: RSS grew by {rss.growth >> 20} MiB"
        assert followed and alive, "the subscriber stopped following the events after the oversized frame"
        assert reopens >= 1  # the oversized frame dropped the connection; libzmq would not reconnect it
    finally:
        stop_peer(proc)
