"""The block allocator on its own: allocation, reference counts, prefix reuse by chained hashes,
eviction order and the KV events it publishes."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager, KVEvent, block_hashes, hash_block


def _blocks(n: int = 4, tpb: int = 2, prefix: bool = True) -> tuple[BlockManager, list[KVEvent]]:
    events: list[KVEvent] = []
    return BlockManager(n, tpb, prefix, events.append), events


def test_blocks_needed_rounds_up():
    bm, _ = _blocks(tpb=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_hands_out_the_lowest_free_ids_and_free_returns_them():
    bm, events = _blocks(4)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.ref_counts == [1, 1, 1, 0] and bm.num_free_blocks == 1
    bm.free([0, 1, 2])
    assert bm.ref_counts == [0, 0, 0, 0] and bm.num_free_blocks == 4
    assert events == []  # nothing was ever published


def test_allocating_more_than_is_free_fails_and_takes_nothing():
    bm, _ = _blocks(4)
    bm.allocate(3)
    with pytest.raises(MemoryError, match="need 2 KV blocks, 1 free"):
        bm.allocate(2)
    assert bm.num_free_blocks == 1


def test_a_block_freed_twice_is_an_invariant_violation():
    bm, _ = _blocks(2)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(AssertionError, match="block 0 freed twice"):
        bm.free(ids)


def test_block_hashes_chain_full_blocks_only():
    tokens = [1, 2, 3, 4, 5]
    h = block_hashes(tokens, 2)
    assert h == [hash_block(None, [1, 2]), hash_block(hash_block(None, [1, 2]), [3, 4])]  # [5] is partial
    assert all(0 <= x < 2**63 for x in h)
    assert block_hashes([3, 4], 2) != h[1:]  # same tokens, another parent: another hash
    assert block_hashes(tokens[:1], 2) == []


def test_committed_blocks_are_matched_by_prefix_and_published_once():
    bm, events = _blocks(4)
    ids = bm.allocate(3)
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    bm.commit_full_blocks(ids, hashes[:1], 0)
    bm.commit_full_blocks(ids, hashes, 1)
    bm.commit_full_blocks(ids, hashes, 0)  # already published: no new event
    assert events == [KVEvent("stored", hashes[:1], None), KVEvent("stored", hashes[1:], hashes[0])]
    assert bm.match_prefix(hashes) == ids
    assert bm.match_prefix([hashes[0], 12345, hashes[2]]) == ids[:1]  # the longest leading run
    assert bm.match_prefix([12345]) == []


def test_a_freed_cached_block_is_evictable_and_can_be_revived():
    bm, events = _blocks(3)
    ids = bm.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    bm.commit_full_blocks(ids, hashes, 0)
    bm.free(ids)
    assert bm.num_free_blocks == 3  # evictable blocks count as free
    assert bm.match_prefix(hashes) == ids  # but keep their contents
    bm.take(ids)
    assert bm.ref_counts == [1, 1, 0] and bm.num_free_blocks == 1
    bm.take(ids[:1])  # a second sharer
    assert bm.ref_counts == [2, 1, 0]
    assert len(events) == 1  # reviving publishes nothing


def test_allocation_evicts_the_never_used_first_then_the_tail_before_the_prefix():
    bm, events = _blocks(3)
    ids = bm.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    bm.commit_full_blocks(ids, hashes, 0)
    bm.free(ids)  # in reverse: the tail (block 1) becomes evictable before the prefix (block 0)
    assert bm.allocate(1) == [2]  # never used: nothing evicted
    assert bm.allocate(1) == [1]
    assert events[-1] == KVEvent("removed", [hashes[1]])
    assert bm.match_prefix(hashes) == [0]
    assert bm.allocate(1) == [0]
    assert events[-1] == KVEvent("removed", [hashes[0]])
    assert bm.match_prefix(hashes) == [] and bm.block_hash == [None, None, None]


def test_without_prefix_caching_nothing_is_matched_or_published():
    bm, events = _blocks(2, prefix=False)
    ids = bm.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    bm.commit_full_blocks(ids, hashes, 0)
    assert bm.match_prefix(hashes) == [] and events == [] and bm.block_hash == [None, None]
