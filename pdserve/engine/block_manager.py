"""KV block allocator with reference counts and prefix reuse by chained block hashes.

A full block's hash is `H(parent_hash, its token ids)`, so equal hashes mean equal prefixes. A block
whose reference count drops to zero keeps its hash and contents and becomes *evictable*: a later request
with the same prefix revives it; allocation evicts the least recently freed first and publishes a
`removed` event for its hash.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import msgpack


def hash_block(parent: int | None, token_ids: Seq[int]) -> int:
    """Chained 63-bit block hash, stable across processes and machines (routers recompute it)."""
    payload = msgpack.packb([parent if parent is not None else -1, list(token_ids)])
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 1


def block_hashes(token_ids: Seq[int], tokens_per_block: int) -> list[int]:
    """Hashes of every full block of `token_ids`, in order."""
    out: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = hash_block(parent, token_ids[start:start + tokens_per_block])
        out.append(parent)
    return out


@dataclass
class KVEvent:
    kind: str  # "stored" | "removed"
    block_hashes: list[int]
    parent_hash: int | None = None


@dataclass
class BlockManager:
    num_blocks: int
    tokens_per_block: int
    enable_prefix_caching: bool = True
    on_event: Callable[[KVEvent], None] | None = None
    # Recurrent-state slots (hybrid models: models/gated_deltanet.RecurrentState), one per running sequence;
    # 0 for a model without recurrent layers, whose sequences then hold slot -1.
    num_state_slots: int = 0
    ref_counts: list[int] = field(init=False)
    block_hash: list[int | None] = field(init=False)

    def __post_init__(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self._free_states = list(range(self.num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-used plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_states)

    @property
    def has_state_slot(self) -> bool:
        """Whether a sequence admitted now gets its state slot (always, for a model without state)."""
        return not self.num_state_slots or bool(self._free_states)

    def allocate_state(self) -> int:
        """A free recurrent-state slot, or -1 for a model without recurrent layers."""
        if not self.num_state_slots:
            return -1
        if not self._free_states:
            raise MemoryError(f"all {self.num_state_slots} recurrent-state slots are taken")
        return self._free_states.pop()

    def free_state(self, slot: int) -> None:
        if slot >= 0:
            assert slot not in self._free_states, f"state slot {slot} freed twice"
            self._free_states.append(slot)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def match_prefix(self, hashes: Seq[int]) -> list[int]:
        """Longest run of cached blocks for these leading block hashes (no reference taken)."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, block_ids: Seq[int]) -> None:
        """Add a reference to cached blocks found by `match_prefix`."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self._cached.get(h) == b:
                    del self._cached[h]
                    evicted.append(h)
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        if evicted and self.on_event:
            self.on_event(KVEvent("removed", evicted))
        return out

    def free(self, block_ids: Seq[int]) -> None:
        # Free in reverse so a sequence's tail blocks are evicted before its shared prefix.
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def commit_full_blocks(self, block_ids: Seq[int], hashes: Seq[int], start: int) -> None:
        """Publish blocks[start:len(hashes)] as reusable once their K/V are computed."""
        if not self.enable_prefix_caching:
            return
        stored = []
        for i in range(start, len(hashes)):
            b, h = block_ids[i], hashes[i]
            if self.block_hash[b] is not None:
                continue
            self.block_hash[b] = h
            if h not in self._cached:
                self._cached[h] = b
                stored.append(h)
        if stored and self.on_event:
            self.on_event(KVEvent("stored", stored, hashes[start - 1] if start > 0 else None))
