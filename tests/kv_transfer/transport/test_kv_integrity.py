"""KV checksums (integrity.py) and the corrupt-byte fault: a flipped byte is a failed transfer naming
the block, never KV that silently differs; without corruption the checksum changes nothing."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from kvt_instance import Topology, ctx_block_ids, fill, gen_block_ids, mismatches, offer_and_ask, pump_until
from pdserve.kv_transfer.agents.faults import FaultPlan
from pdserve.kv_transfer.integrity import block_digests, first_mismatch, to_wire
from pdserve.kv_transfer.page_table import PhysicalPool

pytestmark = pytest.mark.faults
CORRUPT_EVERY_WRITE = FaultPlan(corrupt_rate=1.0, seed=3)


def _transfer(ctx_ranks, gen_ranks, rid: int, num_tokens: int):
    ids_g = offer_and_ask(ctx_ranks, gen_ranks, rid, num_tokens)
    results = pump_until(gen_ranks, "gen", 1, 10, also=ctx_ranks)
    deadline = time.monotonic() + 10
    while any(r.tx.send_sessions for r in ctx_ranks) and time.monotonic() < deadline:
        for r in ctx_ranks:
            r.tx.check_context_transfer_status()
        time.sleep(0.001)
    return results, ids_g


@pytest.mark.parametrize("ctx_topo, gen_topo", [
    (Topology("ctx"), Topology("gen")),
    (Topology("ctx", tp=2, layout="NHD"), Topology("gen", pp=2, layout="NHD")),
    (Topology("ctx", tokens_per_block=8), Topology("gen", tp=2, tokens_per_block=4)),
])
def test_checksummed_transfer_completes_byte_exact(pair, ctx_topo, gen_topo):
    ctx, gen = pair(ctx_topo, gen_topo, gen_options={"checksum": True})
    results, ids_g = _transfer(ctx, gen, 1, 21)
    assert all(done == [1] and not failed for done, failed in results.values()), results
    assert [mismatches(r, ids_g, 21) for r in gen] == [0] * len(gen)
    assert all(r.tx.stage_seconds["checksum"] > 0 for r in ctx + gen)
    assert not any(r.tx.has_inflight_transfer() for r in ctx + gen)


def test_corrupted_byte_lands_silently_without_checksum(pair):
    """The fault is real: without the checksum the transfer 'succeeds' with one wrong value."""
    ctx, gen = pair(ctx_options={"faults": CORRUPT_EVERY_WRITE})
    results, ids_g = _transfer(ctx, gen, 2, 21)
    assert results[0] == ([2], {})
    assert mismatches(gen[0], ids_g, 24) == 1
    assert ctx[0].tx.agent.injected["corrupted_writes"] == 1


@pytest.mark.parametrize("who_asks", ["gen", "ctx"])
def test_corrupted_byte_fails_the_transfer_naming_the_block(pair, who_asks):
    ctx, gen = pair(ctx_options={"faults": CORRUPT_EVERY_WRITE, "checksum": who_asks == "ctx"},
                    gen_options={"checksum": who_asks == "gen"})
    results, _ = _transfer(ctx, gen, 3, 21)
    done, failed = results[0]
    assert done == [] and "KV checksum mismatch in 1 of 6 blocks (first: block" in failed[3], failed
    assert "ctx rank 0" in failed[3]
    assert not any(r.tx.has_inflight_transfer() for r in ctx + gen)
    # The pair keeps serving: the next (clean) transfer of the same pair is checked and passes.
    ctx[0].tx.agent.plan = FaultPlan()
    results, ids_g = _transfer(ctx, gen, 4, 21)
    assert results[0] == ([4], {}) and mismatches(gen[0], ids_g, 21) == 0


def test_pipelined_corruption_fails_only_after_the_last_write_landed(pair):
    """The receiver's blocks are not released while later chunks of the same writer may still land."""
    ctx, gen = pair(ctx_options={"faults": CORRUPT_EVERY_WRITE}, gen_options={"checksum": True})
    ids_c, ids_g = ctx_block_ids(Topology("ctx"), 16), gen_block_ids(Topology("gen"), 16)
    fill(ctx[0], ids_c)
    gen[0].tx.request_and_receive_async(5, ctx[0].tx.endpoint, {0: ids_g})
    first = np.where(np.arange(ids_c.size) < 2, ids_c, -1)
    ctx[0].tx.respond_and_send_async(5, {0: first}, token_range=(0, 8), last=False)
    deadline = time.monotonic() + 10
    while not gen[0].tx.recv_sessions[5].chunks_seen and time.monotonic() < deadline:
        ctx[0].tx.check_context_transfer_status()
        gen[0].tx.check_gen_transfer_status()
        time.sleep(0.001)
    session = gen[0].tx.recv_sessions.get(5)
    assert session is not None and session.corrupted and not session.errors  # still waiting for chunk 2
    rest = np.where(np.arange(ids_c.size) >= 2, ids_c, -1)
    ctx[0].tx.agent.plan = FaultPlan()
    ctx[0].tx.respond_and_send_async(5, {0: rest}, token_range=(8, 16), last=True)
    results = pump_until(gen, "gen", 1, 10, also=ctx)
    assert "write 0: KV checksum mismatch" in results[0][1][5]


def test_block_digests_do_not_depend_on_how_fragments_were_merged():
    """A fragment spanning blocks is split at block edges: the per-block stream is the same either way."""
    memory = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)
    base = memory.ctypes.data
    pools = [PhysicalPool(base=base, slot_bytes=256, num_slots=16)]
    dst = np.array([base + 100, base + 256, base + 700], dtype=np.uint64)
    sizes = np.array([156, 300, 40], dtype=np.uint64)
    keys, merged = block_digests(dst, dst, sizes, pools)
    pieces = np.array([base + 100, base + 256, base + 512, base + 700], dtype=np.uint64)
    keys2, split = block_digests(pieces, pieces, np.array([156, 256, 44, 40], dtype=np.uint64), pools)
    assert keys == keys2 == [(0, 0), (0, 1), (0, 2)] and (merged == split).all()
    memory[520] ^= 1  # inside the merged fragment, past the edge of block 1
    keys3, after = block_digests(dst, dst, sizes, pools)
    assert first_mismatch(keys3, after, to_wire(merged)).startswith("KV checksum mismatch in 1 of 3 blocks "
                                                                     "(first: block 2 of pool 0)")
    assert first_mismatch(keys3, after[:2], to_wire(merged)) == "the sender digested 3 blocks, this rank expected 2"


@pytest.mark.parametrize("piece", [64, 100])  # equal small pieces take the packed-rows path; 100 B ones do not
def test_block_digests_equal_a_plain_per_piece_crc(piece):
    rng = np.random.default_rng(1)
    memory = rng.integers(0, 255, 2 * 64 * 1024, dtype=np.uint8)  # 2 layer-major layers x 64 slots x 1 KiB
    base = memory.ctypes.data
    pools = [PhysicalPool(base=base, slot_bytes=1024, num_slots=64)]
    starts = rng.permutation(np.arange(0, memory.size - piece, 512))[:600]  # in random plan order
    dst = (base + starts).astype(np.uint64)
    keys, crcs = block_digests(dst, dst, np.full(dst.size, piece, np.uint64), pools)
    want: dict = {}
    for start in starts.tolist():  # plan order within each block, any piece may cross a block edge
        for at in range(start, start + piece):
            key = (0, (at % (64 * 1024)) // 1024)
            want[key] = zlib.crc32(memory[at:at + 1].tobytes(), want.get(key, 0))
    assert keys == sorted(want) and crcs.tolist() == [want[k] for k in keys]


def test_layer_major_blocks_gather_every_layer():
    """On a layer-major pool a block is one range per layer; all of them go into its one digest."""
    memory = np.zeros(2 * 4 * 64, dtype=np.uint8)  # 2 layers x 4 slots x 64 bytes
    base = memory.ctypes.data
    pools = [PhysicalPool(base=base, slot_bytes=64, num_slots=4)]
    dst = np.array([base + 64, base + 256 + 64], dtype=np.uint64)  # slot 1 in layer 0 and in layer 1
    keys, _ = block_digests(dst, dst, np.array([64, 64], dtype=np.uint64), pools)
    assert keys == [(0, 1)]
