"""Optional end-to-end check of transferred KV: a CRC32 per destination block.

Off by default (`TransceiverConfig.checksum`). When a receiver asks for it (REQUEST_DATA's
`checksum`) or the sender has it on, the sender digests the bytes each write will copy, grouped by
the destination block they land in, and sends the digests with the write's notification together
with its own block ids. The receiver re-runs the same `plan_write` (so both sides walk the same
fragments in the same order), digests the bytes that landed, and fails the request on a mismatch,
naming the block. The data path is untouched: a corrupted byte becomes a failed transfer (which the
serving layer retries with a fresh prefill), never a generation that reads wrong KV.

A "block" is one slot of one pool: on a block-major pool the slot's bytes over every layer, on a
layer-major pool the slot's bytes in each layer (so a layer-major block is several ranges, digested
in plan order). Fragments that span blocks (merged by `merge_contiguous`) are split at block edges,
so the per-block byte stream does not depend on how a side merged its fragments.

Host memory only: digests read the KV through its address. Device pools cannot use it (refused
when the transceiver starts).
"""

from __future__ import annotations

import ctypes
import math
import zlib
from typing import Sequence

import numpy as np

from pdserve.kv_transfer.agents.memcopy import _Rows
from pdserve.kv_transfer.page_table import PhysicalPool

BlockKey = tuple[int, int]  # (pool index, slot id) on the destination rank

# Small equal-sized pieces (the NHD head-mismatch shape) are gathered into a packed buffer by rows
# and digested one block at a time; anything else is digested piece by piece.
_ROWS_MIN_PIECES = 256
_ROWS_MAX_PIECE_BYTES = 4096
_BATCH_BYTES = 32 << 20  # bytes gathered per packed batch


def _split_at_blocks(read: np.ndarray, dst: np.ndarray, size: np.ndarray, pools: Sequence[PhysicalPool]):
    """Pieces that each lie in one destination block: (read, dst, size, pool, slot), in plan order."""
    bases = np.array([p.base for p in pools], dtype=np.uint64)
    order = np.argsort(bases, kind="stable")
    which = order[np.clip(np.searchsorted(bases[order], dst, side="right") - 1, 0, None)]
    if (dst < bases[which]).any():
        raise ValueError(f"address {int(dst[dst < bases[which]][0]):#x} lies in no pool of the destination rank")
    ss = np.array([p.effective_slot_stride for p in pools], dtype=np.uint64)[which]
    ls = np.array([p.effective_layer_stride for p in pools], dtype=np.uint64)[which]
    ns = np.array([p.num_slots for p in pools], dtype=np.uint64)[which]
    rel = dst - bases[which]
    layer_major = ls >= ns * ss  # each layer holds every slot; else a slot holds every layer
    safe_ls = np.maximum(ls, np.uint64(1))  # a one-layer block-major pool may say layer_stride 0
    layer = np.where(layer_major, rel // safe_ls, 0)
    slot = np.where(layer_major, (rel % safe_ls) // ss, rel // ss)
    if (slot >= ns).any():
        raise ValueError(f"address {int(dst[slot >= ns][0]):#x} lies past the last slot of its pool")
    end = bases[which] + layer * ls + (slot + np.uint64(1)) * ss
    crossing = np.flatnonzero(dst + size > end)
    if not crossing.size:
        return read, dst, size, which, slot
    # Rare (fragments merged across contiguous blocks): cut those few at their block edges.
    pieces = []
    for i in crossing.tolist():
        r, d, n = int(read[i]), int(dst[i]), int(size[i])
        while n > 0:
            index, block, left = _locate(pools, d)
            piece = min(n, left)
            pieces.append((i, r, d, piece, index, block))
            r, d, n = r + piece, d + piece, n - piece
    keep = np.ones(size.size, dtype=bool)
    keep[crossing] = False
    ordinal = np.concatenate([np.flatnonzero(keep), np.array([p[0] for p in pieces])])
    cols = [np.concatenate([a[keep], np.array([p[j] for p in pieces], dtype=a.dtype)])
            for j, a in enumerate((read, dst, size, which, slot), start=1)]
    back = np.argsort(ordinal, kind="stable")
    return tuple(c[back] for c in cols)


def _locate(pools: Sequence[PhysicalPool], dst: int) -> tuple[int, int, int]:
    """(pool index, slot, bytes from `dst` to the end of that block's range) of one address."""
    index = max((i for i, p in enumerate(pools) if p.base <= dst), key=lambda i: pools[i].base)
    pool = pools[index]
    ss, ls = pool.effective_slot_stride, pool.effective_layer_stride
    rel = dst - pool.base
    within = rel % ls if ls >= pool.num_slots * ss else rel
    return index, within // ss, ss - within % ss


def block_digests(read_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray,
                  dst_pools: Sequence[PhysicalPool]) -> tuple[list[BlockKey], np.ndarray]:
    """CRC32 of the bytes at `read_ptrs` (the source on the sender, the destination on the receiver),
    grouped by the destination block each fragment lands in, in plan order within a block; keys sorted."""
    read, dst, size = (np.asarray(a, dtype=np.uint64) for a in (read_ptrs, dst_ptrs, sizes))
    if not size.size:
        return [], np.zeros(0, dtype=np.uint32)
    read, dst, size, pool, slot = _split_at_blocks(read, dst, size, dst_pools)
    order = np.lexsort((slot, pool))  # stable: plan order within a block
    read, size, pool, slot = read[order], size[order], pool[order], slot[order]
    starts = np.flatnonzero(np.r_[True, (pool[1:] != pool[:-1]) | (slot[1:] != slot[:-1])])
    keys = list(zip(pool[starts].tolist(), slot[starts].tolist()))
    bounds = np.r_[starts, size.size]
    uniform = int(size[0])
    if size.size >= _ROWS_MIN_PIECES and uniform <= _ROWS_MAX_PIECE_BYTES and bool((size == uniform).all()):
        crcs = _digest_rows(read, uniform, bounds)
    else:
        crcs = []
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            crc = 0
            for r, n in zip(read[lo:hi].tolist(), size[lo:hi].tolist()):
                crc = zlib.crc32((ctypes.c_char * n).from_address(r), crc)
            crcs.append(crc)
    return keys, np.array(crcs, dtype=np.uint32)


def _digest_rows(read: np.ndarray, size: int, bounds: np.ndarray) -> list[int]:
    """Per-block CRC32 of equal-sized pieces: gather a batch of whole blocks into packed rows, then one
    CRC call per block over its contiguous rows."""
    rows = _Rows(read, size)
    word = math.gcd(rows.pitch, size, rows.lo, 8)
    view = rows.view(size, word)
    per_batch = max(1, _BATCH_BYTES // size)
    crcs, block, num_blocks = [], 0, bounds.size - 1
    while block < num_blocks:
        last = int(np.searchsorted(bounds, bounds[block] + per_batch, side="right")) - 1
        last = min(max(last, block + 1), num_blocks)
        lo, hi = int(bounds[block]), int(bounds[last])
        packed = np.take(view, rows.index[lo:hi], axis=0, mode="clip")  # [pieces, size // word], contiguous
        flat = packed.reshape(-1).view(np.uint8)
        for b in range(block, last):
            crcs.append(zlib.crc32(flat[(int(bounds[b]) - lo) * size:(int(bounds[b + 1]) - lo) * size]))
        block = last
    return crcs


def first_mismatch(keys: list[BlockKey], ours: np.ndarray, theirs: bytes) -> str | None:
    """None when the sender's digests (`theirs`, little-endian uint32) equal ours; else what differs."""
    sent = np.frombuffer(theirs, dtype="<u4")
    if sent.size != ours.size:
        return f"the sender digested {sent.size} blocks, this rank expected {ours.size}"
    bad = np.flatnonzero(sent != ours)
    if not bad.size:
        return None
    pool, slot = keys[int(bad[0])]
    return (f"KV checksum mismatch in {bad.size} of {ours.size} blocks (first: block {slot} of pool {pool}): "
            "the bytes that landed differ from the bytes sent")


def to_wire(crcs: np.ndarray) -> bytes:
    return crcs.astype("<u4").tobytes()
