"""The kv_cache_aware router: send a request where most of its prefix is already cached.

Each instance's set of cached block hashes is kept current from that instance's KV events:

    worker  --ZeroMQ PUB  KVEventBatch (engine/kv/events.py)-->                        KvEventSubscriber
    worker  --GET /v1/kv_blocks  {"seq": S, "block_hashes": [...]}-->                  (snapshot)

A subscriber subscribes first, then takes the snapshot, then applies only events with seq > S. A gap
in seq (a dropped message, or a publisher that restarted) means the set may be wrong, so it takes a new
snapshot instead of guessing. Hashes are `pdserve.engine.block_manager.block_hashes`, the same chain
the engine computes, so `matched blocks` is exactly the prefix the instance would reuse.

A frame over MAX_EVENT_BYTES makes libzmq drop the connection before buffering it; the subscriber
then follows on a fresh socket (libzmq would not reconnect the old one) and resyncs.

score(instance) = matched leading blocks - load_weight * in-flight requests; ties go to the instance
with fewer in-flight requests, then to the one selected less often.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable, Iterable

import zmq
import zmq.asyncio

from pdserve.orchestrator.router_base import Route, RouteRequest, Router
from pdserve.engine.block_manager import KVEvent, block_hashes
from pdserve.engine.kv.events import KVEventBatch

log = logging.getLogger(__name__)

Snapshot = Callable[[], Awaitable[tuple[int, list[int]]]]
_RESYNC_BACKOFF_S = 0.2
# One message lists one event's block hashes (a msgpack uint64, <= 9 bytes each): a 1M-token prompt
# at one token per block is ~9.4 MB, a 128K-token prompt at 32 tokens per block ~37 KB.
MAX_EVENT_BYTES = 16 << 20
_monitor_ids = itertools.count()


class KvBlockIndex:
    """The block hashes one instance holds, as of event `seq` (None: not synced yet)."""

    def __init__(self):
        self.hashes: set[int] = set()
        self.seq: int | None = None

    def reset(self, seq: int, hashes: list[int]) -> None:
        self.hashes = set(hashes)
        self.seq = seq

    def apply(self, seq: int, events: Iterable[KVEvent]) -> bool:
        """Apply one message; False when it does not follow the last one (the caller resyncs)."""
        if self.seq is None or seq <= self.seq:
            return self.seq is not None  # older than the snapshot: already in it
        if seq != self.seq + 1:
            return False
        for e in events:
            if e.kind == "stored":
                self.hashes.update(e.block_hashes)
            elif e.kind == "removed":
                self.hashes.difference_update(e.block_hashes)
            elif e.kind == "cleared":
                self.hashes.clear()
            else:
                raise ValueError(f"unknown KV event kind {e.kind!r} (expected stored, removed or cleared)")
        self.seq = seq
        return True

    def matched_blocks(self, hashes: list[int]) -> int:
        """Leading blocks present: the chain makes a later block useless once one is missing."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


class KvEventSubscriber:
    """Keeps one KvBlockIndex current from one instance's PUB socket; runs as an asyncio task."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, index: KvBlockIndex, snapshot: Snapshot):
        self.endpoint, self.index, self.snapshot = endpoint, index, snapshot
        self._ctx = ctx
        self.sock, self._dropped = self._open()
        self.resyncs = 0
        self.reopens = 0
        self.task: asyncio.Task | None = None
        self._resync_requested = asyncio.Event()

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """A SUB socket following the endpoint, and a monitor that reports its connection dropping."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        # pyzmq's default monitor address is named after the socket's fd, which the closed socket
        # this one replaces may have held, its monitor's address not yet free.
        dropped = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED,
                                          addr=f"inproc://pdserve-kv-events-{next(_monitor_ids)}")
        sock.connect(self.endpoint)
        sock.subscribe(b"")
        return sock, dropped

    def _close_socket(self) -> None:
        self.sock.disable_monitor()  # frees the monitor's inproc address for a later socket
        self._dropped.close()
        self.sock.close()

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    def request_resync(self) -> None:
        self._resync_requested.set()

    async def _resync(self) -> None:
        while True:
            try:
                seq, hashes = await self.snapshot()
                self.index.reset(seq, hashes)
                self.resyncs += 1
                return
            except Exception as e:  # the instance may be restarting: keep trying, matched = 0 meanwhile
                log.warning("KV snapshot from %s failed (%s: %s); retrying", self.endpoint, type(e).__name__, e)
                self.index.seq = None
                await asyncio.sleep(_RESYNC_BACKOFF_S)

    async def _run(self) -> None:
        await self._resync()
        recv = asyncio.ensure_future(self.sock.recv_multipart())
        dropped = asyncio.ensure_future(self._dropped.recv_multipart())
        try:
            while True:
                wanted = asyncio.ensure_future(self._resync_requested.wait())
                await asyncio.wait({recv, wanted, dropped}, return_when=asyncio.FIRST_COMPLETED)
                if dropped.done():
                    # libzmq does not reconnect after a protocol error (a frame over MAX_EVENT_BYTES):
                    # follow on a fresh socket, and resync over whatever was missed meanwhile.
                    wanted.cancel()
                    recv.cancel()
                    log.info("KV events from %s: connection dropped; reconnecting", self.endpoint)
                    self._close_socket()
                    self.sock, self._dropped = self._open()
                    self.reopens += 1
                    self._resync_requested.clear()
                    await self._resync()
                    recv = asyncio.ensure_future(self.sock.recv_multipart())
                    dropped = asyncio.ensure_future(self._dropped.recv_multipart())
                    continue
                if wanted.done():
                    self._resync_requested.clear()
                    await self._resync()
                else:
                    wanted.cancel()
                if not recv.done():
                    continue
                frames = recv.result()
                recv = asyncio.ensure_future(self.sock.recv_multipart())
                try:
                    batch = KVEventBatch.from_bytes(frames[-1])
                    in_order = self.index.apply(batch.seq, batch.events)
                except ValueError as e:  # a KVEventError, or an event the index cannot apply
                    log.warning("ignoring a malformed KV event from %s: %s", self.endpoint, e)
                    continue
                if not in_order:
                    await self._resync()
        finally:
            recv.cancel()
            dropped.cancel()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self._close_socket()


async def fetch_kv_blocks(http, url: str) -> tuple[int, list[int]]:
    r = await http.get(url + "/v1/kv_blocks", timeout=10)
    r.raise_for_status()
    data = r.json()
    return int(data["seq"]), [int(h) for h in data["block_hashes"]]


class KvCacheAwareRouter(Router):
    kind = "kv_cache_aware"

    def __init__(self, urls, config):
        super().__init__(urls, config)
        self.indexes: dict[str, KvBlockIndex] = {}
        self.tokens_per_block: dict[str, int] = {}
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._http = None

    @property
    def needs_tokens(self) -> bool:
        return True

    async def start(self, http) -> None:
        self._http = http

    def attach_events(self, url: str, endpoint: str | None, tokens_per_block: int,
                      snapshot: Snapshot | None = None) -> None:
        """Follow `url`'s KV events (called once its /v1/disagg_info is known). Without an endpoint
        the instance is still routable but never counts as holding a prefix."""
        first_time = url not in self.tokens_per_block
        self.tokens_per_block[url] = tokens_per_block
        if endpoint is None or url in self.subscribers:
            if endpoint is None and first_time:
                log.warning("%s publishes no KV events (no kv_events_port): kv_cache_aware sees no cache there", url)
            return
        if snapshot is None:
            assert self._http is not None, "start() before attach_events without a snapshot"
            snapshot = lambda: fetch_kv_blocks(self._http, url)  # noqa: E731
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        index = self.indexes.setdefault(url, KvBlockIndex())
        sub = KvEventSubscriber(self._zmq, endpoint, index, snapshot)
        self.subscribers[url] = sub
        sub.start()

    def set_ready(self, url, ready):
        came_back = ready and url not in self.ready
        super().set_ready(url, ready)
        if came_back and url in self.subscribers:
            self.subscribers[url].request_resync()  # a restarted worker starts its seq over

    async def remove(self, url):
        await super().remove(url)
        self.indexes.pop(url, None)
        self.tokens_per_block.pop(url, None)
        sub = self.subscribers.pop(url, None)
        if sub is not None:
            await sub.close()

    def matched_blocks(self, url: str, token_ids: list[int] | None) -> int:
        index, tpb = self.indexes.get(url), self.tokens_per_block.get(url)
        if not token_ids or index is None or tpb is None:
            return 0
        return index.matched_blocks(block_hashes(token_ids, tpb))

    def _pick(self, req: RouteRequest) -> Route:
        weight = self.config.option("load_weight")
        scored = []
        for u in self._candidates():
            matched = self.matched_blocks(u, req.token_ids)
            scored.append((-(matched - weight * self.load[u].requests), self.load[u].requests, self.selected[u],
                           u, matched))
        *_, url, matched = min(scored)
        return Route(url, matched, self.tokens_per_block.get(url))

    def snapshot(self):
        out = super().snapshot()
        for inst in out["instances"]:
            index = self.indexes.get(inst["url"])
            inst["cached_blocks"] = len(index.hashes) if index else 0
            inst["kv_events_seq"] = index.seq if index else None
        return out

    async def close(self) -> None:
        for sub in self.subscribers.values():
            await sub.close()
        if self._zmq is not None:
            self._zmq.term()
