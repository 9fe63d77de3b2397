"""Publish KV cache events so a router can tell which instance holds which prefix.

A ZeroMQ PUB socket sends one `KVEventBatch` per frame: msgpack
`{"v": EVENTS_VERSION, "seq": seq, "events": [[kind, [block_hash, ...], parent_hash], ...]}` with
`kind` in "stored" | "removed" | "cleared". A subscriber that joins late takes `snapshot()` once
(exposed by the server as GET /v1/kv_blocks) and applies batches with a larger `seq` on top of it.

The socket only ever receives subscriptions (a few bytes), so a peer sending a frame over
`MAX_INBOUND_BYTES` is disconnected by libzmq before the frame is buffered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgpack
import zmq

from pdserve.engine.block_manager import KVEvent

MAX_INBOUND_BYTES = 64 << 10
EVENTS_VERSION = 1  # bumped with any change of the frame's fields
EVENT_KINDS = ("stored", "removed", "cleared")


class KVEventError(ValueError):
    """A KV event frame that is malformed, of an unknown kind, or of another version."""


@dataclass(frozen=True)
class KVEventBatch:
    """One published frame: the events of one change to the instance's cached blocks."""

    seq: int  # 1, 2, 3, ... per publisher; a gap means a frame was missed
    events: tuple[KVEvent, ...]

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": EVENTS_VERSION, "seq": self.seq,
                              "events": [[e.kind, list(e.block_hashes), e.parent_hash] for e in self.events]})

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVEventBatch":
        try:
            w = msgpack.unpackb(data)
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise KVEventError(f"not msgpack: {e!r}") from None
        if not isinstance(w, dict) or w.keys() != {"v", "seq", "events"}:
            raise KVEventError(f"a KV event frame is a map with keys ['events', 'seq', 'v']; got {w!r:.200}")
        if w["v"] != EVENTS_VERSION:
            raise KVEventError(f"KV event frame version {w['v']!r}, this side reads {EVENTS_VERSION}: run the "
                               "same pdserve version on the workers and the orchestrator")
        try:
            events = tuple(KVEvent(str(kind), [int(h) for h in hashes], None if parent is None else int(parent))
                           for kind, hashes, parent in w["events"])
            seq = int(w["seq"])
        except (TypeError, ValueError) as e:
            raise KVEventError(f"malformed KV event frame: {e!r}") from None
        unknown = {e.kind for e in events} - set(EVENT_KINDS)
        if unknown:
            raise KVEventError(f"unknown KV event kind {sorted(unknown)} (expected one of {list(EVENT_KINDS)})")
        return cls(seq, events)


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
            self._sock.send(KVEventBatch(self._seq, (event,)).to_bytes())

    def snapshot(self) -> tuple[int, list[int]]:
        with self._lock:
            return self._seq, sorted(self._cached)

    def close(self) -> None:
        self._sock.close()
