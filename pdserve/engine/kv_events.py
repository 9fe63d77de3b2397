"""Publish KV cache events so a router can tell which instance holds which prefix.

A ZeroMQ PUB socket sends msgpack frames `[seq, [[kind, [block_hash, ...], parent_hash], ...]]` with
`kind` in "stored" | "removed". A subscriber that joins late takes `snapshot()` once (exposed by the
server as GET /v1/kv_blocks) and applies events with a larger `seq` on top of it.

The socket only ever receives subscriptions (a few bytes), so a peer sending a frame over
`MAX_INBOUND_BYTES` is disconnected by libzmq before the frame is buffered.
"""

from __future__ import annotations

import threading

import msgpack
import zmq

from pdserve.engine.block_manager import KVEvent

MAX_INBOUND_BYTES = 64 << 10


class KVEventPublisher:
    def __init__(self, host: str, port: int):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.endpoint = f"tcp://{host}:{port}"
        else:
            bound = self._sock.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{bound}"
        self._lock = threading.Lock()
        self._seq = 0
        self._cached: set[int] = set()

    def __call__(self, event: KVEvent) -> None:
        """BlockManager's on_event hook (engine thread)."""
        with self._lock:
            self._seq += 1
            if event.kind == "stored":
                self._cached.update(event.block_hashes)
            else:
                self._cached.difference_update(event.block_hashes)
            frame = msgpack.packb([self._seq, [[event.kind, event.block_hashes, event.parent_hash]]])
            self._sock.send(frame)

    def snapshot(self) -> tuple[int, list[int]]:
        with self._lock:
            return self._seq, sorted(self._cached)

    def close(self) -> None:
        self._sock.close()
