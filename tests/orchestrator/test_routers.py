"""Routers in isolation; kv_cache_aware fed by real ZeroMQ PUB sockets in this process."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from pdserve.orchestrator.config import RouterConfig
from pdserve.orchestrator.kv_cache_aware import KvBlockIndex, KvCacheAwareRouter
from pdserve.orchestrator.routers import NoReadyInstance, RouteRequest, make_router, session_key
from pdserve.engine.block_manager import KVEvent, block_hashes
from pdserve.engine.kv.events import KVEventBatch

URLS = ["http://a:1", "http://b:2", "http://c:3"]
TPB = 4


def router(kind: str, urls=URLS, **options):
    r = make_router(urls, RouterConfig(type=kind, options=options))
    for u in urls:
        r.set_ready(u, True)
    return r


def test_round_robin_cycles_and_skips_instances_that_are_not_ready():
    r = router("round_robin")
    assert [r.select(RouteRequest()).url for _ in range(4)] == [URLS[0], URLS[1], URLS[2], URLS[0]]
    r.set_ready(URLS[1], False)
    assert [r.select(RouteRequest()).url for _ in range(3)] == [URLS[2], URLS[0], URLS[2]]
    for u in URLS:
        r.set_ready(u, False)
    with pytest.raises(NoReadyInstance, match="no ready instance"):
        r.select(RouteRequest())


def test_load_balancing_by_requests_and_by_tokens():
    r = router("load_balancing")
    first = [r.select(RouteRequest(num_tokens=10)) for _ in range(3)]
    assert sorted(x.url for x in first) == URLS  # one each
    r.finish(URLS[1], RouteRequest(num_tokens=10))
    assert r.select(RouteRequest()).url == URLS[1]

    t = router("load_balancing", metric="tokens")
    big = RouteRequest(num_tokens=1000)
    assert t.select(big).url == URLS[0]
    picks = [t.select(RouteRequest(num_tokens=10)).url for _ in range(4)]
    assert URLS[0] not in picks  # 40 small tokens elsewhere < 1000 on a
    t.finish(URLS[0], big)
    assert t.snapshot()["instances"][0]["in_flight_tokens"] == 0


def test_conversation_affinity_moves_only_when_its_instance_goes_away():
    r = router("conversation", max_sessions=2)
    cfg = r.config
    chat1 = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "one"}]}
    chat1_later = {"messages": chat1["messages"] + [{"role": "assistant", "content": "x"},
                                                    {"role": "user", "content": "two"}]}
    k1 = session_key(chat1, None, cfg)
    assert k1 == session_key(chat1_later, None, cfg)  # same first two messages: same conversation
    assert session_key(chat1, "conv-9", cfg) == "id:conv-9"
    assert session_key({"prompt": "p", "conversation_id": "z"}, None, cfg) == "id:z"
    home = r.select(RouteRequest(session_key=k1)).url
    for _ in range(3):
        r.select(RouteRequest(session_key="other" + str(_)))  # load elsewhere
        assert r.select(RouteRequest(session_key=k1)).url == home
    r.set_ready(home, False)
    moved = r.select(RouteRequest(session_key=k1)).url
    assert moved != home
    r.set_ready(home, True)
    assert r.select(RouteRequest(session_key=k1)).url == moved  # sticks to its new home
    assert len(r.sessions) == 2  # LRU-bounded


def test_kv_block_index_orders_by_seq_and_asks_for_resync_on_gaps():
    idx = KvBlockIndex()
    assert not idx.apply(1, [KVEvent("stored", [1], None)])  # not synced yet
    idx.reset(5, [10, 11])
    assert idx.apply(4, [KVEvent("removed", [10], None)]) and 10 in idx.hashes  # older than the snapshot
    assert idx.apply(6, [KVEvent("stored", [12], 11)]) and idx.hashes == {10, 11, 12}
    assert not idx.apply(8, [KVEvent("stored", [13], None)]) and 13 not in idx.hashes  # gap: resync
    assert idx.apply(7, [KVEvent("cleared", [], None)]) and idx.hashes == set()
    with pytest.raises(ValueError, match="unknown KV event kind"):
        idx.apply(8, [KVEvent("moved", [1], None)])
    idx.reset(0, [1, 2, 3])
    assert idx.matched_blocks([1, 2, 9, 3]) == 2  # a chain: nothing after the first miss counts


class FakeWorkerEvents:
    """The publishing half of a worker: a real PUB socket, the snapshot it would serve at /v1/kv_blocks,
    and the option to drop a message (as a slow-joining subscriber would miss it)."""

    def __init__(self, ctx: zmq.asyncio.Context):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.hashes: set[int] = set()
        self.snapshots = 0

    async def publish(self, events: list, drop: bool = False) -> None:
        self.seq += 1
        for kind, hashes, _ in events:
            if kind == "stored":
                self.hashes.update(hashes)
            elif kind == "removed":
                self.hashes.difference_update(hashes)
        if not drop:
            await self.sock.send(KVEventBatch(self.seq, tuple(KVEvent(*e) for e in events)).to_bytes())

    async def snapshot(self) -> tuple[int, list[int]]:
        self.snapshots += 1
        return self.seq, sorted(self.hashes)


async def _until(cond, timeout=5.0, tick=None):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        if tick is not None:
            await tick()
        await asyncio.sleep(0.02)


def test_kv_cache_aware_routes_a_prefix_to_the_instance_that_holds_it():
    asyncio.run(_kv_cache_aware_scenario())


async def _kv_cache_aware_scenario():
    ctx = zmq.asyncio.Context()
    pubs = [FakeWorkerEvents(ctx) for _ in URLS]
    r = KvCacheAwareRouter(URLS, RouterConfig(type="kv_cache_aware", options={"load_weight": 1.0}))
    try:
        for u, pub in zip(URLS, pubs):
            r.set_ready(u, True)
            r.attach_events(u, pub.endpoint, TPB, snapshot=pub.snapshot)
        await _until(lambda: all(i.seq == 0 for i in r.indexes.values()))
        prompt = list(range(100, 124))  # 6 full blocks
        hashes = block_hashes(prompt, TPB)
        # b caches the whole prompt. Empty heartbeats follow: if the subscriber joined late and missed
        # the 'stored' message, the next one shows a seq gap and it resyncs from the snapshot.
        await pubs[1].publish([["stored", hashes, None]])
        await _until(lambda: r.matched_blocks(URLS[1], prompt) == 6, tick=lambda: pubs[1].publish([]))
        route = r.select(RouteRequest(num_tokens=24, token_ids=prompt))
        assert (route.url, route.matched_blocks, route.tokens_per_block) == (URLS[1], 6, TPB)
        # c holds only the first 2 blocks; with b busy (1 in flight) b still wins 6-1 > 2-0.
        await pubs[2].publish([["stored", hashes[:2], None]])
        await _until(lambda: r.matched_blocks(URLS[2], prompt) == 2, tick=lambda: pubs[2].publish([]))
        assert r.select(RouteRequest(token_ids=prompt)).url == URLS[1]
        # A different prompt matches nothing: the least-loaded instance wins.
        assert r.select(RouteRequest(token_ids=list(range(500, 524)))).url == URLS[0]
        # b evicts its blocks from the third on, and a message to b is lost: the gap forces a resync.
        resyncs = r.subscribers[URLS[1]].resyncs
        await pubs[1].publish([["removed", hashes[2:], hashes[1]]], drop=True)
        await pubs[1].publish([])
        await _until(lambda: r.matched_blocks(URLS[1], prompt) == 2)
        assert r.subscribers[URLS[1]].resyncs == resyncs + 1
        r.finish(URLS[1], RouteRequest())
        assert r.select(RouteRequest(token_ids=prompt)).url == URLS[2]  # equal prefixes: b has 1 in flight, c none
        info = r.snapshot()["instances"]
        assert [i["cached_blocks"] for i in info] == [0, 2, 2]
    finally:
        await r.close()
        for pub in pubs:
            pub.sock.close()
        ctx.term()
