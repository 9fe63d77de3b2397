"""Global request ids (snowflake), minted without coordination by every orchestrator process.

    bit 63      62 .. 24              23 .. 16     15 .. 10       9 .. 0
      [ 0 | ms since EPOCH (39 bits) | node (8) | process (6) | counter (10) ]   = raw, in [0, 2^63)

`raw` is rotated into [2^40, 2^63) (`GLOBAL_ID_MIN + raw mod (2^63 - 2^40)`), so a global id can never
equal a worker's local id (local ids, warm-up included, stay below 2^40). Two generators give disjoint
ids as long as their (node, process) pairs differ; within one generator the counter gives 1024 ids per
millisecond and the clock then waits for the next millisecond. The clock is monotonic: it is anchored to
the wall clock once, so a wall-clock step backwards cannot repeat an id.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

GLOBAL_ID_MIN = 1 << 40  # local ids are below this
GLOBAL_ID_LIMIT = 1 << 63  # exclusive
TIMESTAMP_BITS, NODE_BITS, PROCESS_BITS, COUNTER_BITS = 39, 8, 6, 10
EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z; 2^39 ms after it is in 2041


def default_node_id() -> int:
    """A stable per-machine node id: a hash of the MAC address mod 256."""
    mac = uuid.getnode().to_bytes(8, "little")
    return hashlib.sha256(mac).digest()[0]


def rotate(raw: int) -> int:
    return GLOBAL_ID_MIN + raw % (GLOBAL_ID_LIMIT - GLOBAL_ID_MIN)


def is_global_id(request_id: int) -> bool:
    return GLOBAL_ID_MIN <= request_id < GLOBAL_ID_LIMIT


class RequestIdGenerator:
    """Thread-safe snowflake generator for one (node, process) pair."""

    def __init__(self, node_id: int | None = None, process_id: int = 0):
        node_id = default_node_id() if node_id is None else node_id
        if not 0 <= node_id < 1 << NODE_BITS:
            raise ValueError(f"node_id must be in [0, {1 << NODE_BITS}), got {node_id}")
        if not 0 <= process_id < 1 << PROCESS_BITS:
            raise ValueError(f"process_id must be in [0, {1 << PROCESS_BITS}) (at most 64 fleet workers), "
                             f"got {process_id}")
        self.node_id, self.process_id = node_id, process_id
        self._anchor_ms = time.time_ns() // 1_000_000 - EPOCH_MS
        self._anchor_mono = time.monotonic_ns()
        self._last_ms = -1
        self._counter = 0
        self._lock = threading.Lock()

    def _now_ms(self) -> int:
        return self._anchor_ms + (time.monotonic_ns() - self._anchor_mono) // 1_000_000

    def next_id(self) -> int:
        with self._lock:
            now = self._now_ms()
            if now == self._last_ms:
                self._counter += 1
                if self._counter >> COUNTER_BITS:  # 1024 ids this ms already: wait for the next one
                    while now <= self._last_ms:
                        time.sleep(0.0001)
                        now = self._now_ms()
                    self._counter = 0
            else:
                self._counter = 0
            self._last_ms = now
            raw = (((now % (1 << TIMESTAMP_BITS)) << (NODE_BITS + PROCESS_BITS + COUNTER_BITS))
                   | (self.node_id << (PROCESS_BITS + COUNTER_BITS))
                   | (self.process_id << COUNTER_BITS)
                   | self._counter)
            return rotate(raw)


def unrotate(request_id: int) -> dict[str, int]:
    """The fields of an id minted by `RequestIdGenerator` (for logs and tests)."""
    if not is_global_id(request_id):
        raise ValueError(f"{request_id} is not a global request id (must be in [2^40, 2^63))")
    raw = request_id - GLOBAL_ID_MIN
    return {"timestamp_ms": raw >> (NODE_BITS + PROCESS_BITS + COUNTER_BITS),
            "node_id": (raw >> (PROCESS_BITS + COUNTER_BITS)) & ((1 << NODE_BITS) - 1),
            "process_id": (raw >> COUNTER_BITS) & ((1 << PROCESS_BITS) - 1),
            "counter": raw & ((1 << COUNTER_BITS) - 1)}
