"""First-contact canary: before a generation rank takes KV from a context instance it has not seen,
a known pattern is written through the real mapping and checked.

    gen rank G                                  ctx ranks C0..Cn (G's writers)
      zero G's canary blocks
      REQUEST_DATA(canary, tokens [0, T)) ──>   fill their canary blocks with the pattern
                                        <══     one-sided write, plan_write as for any request
      check every byte G holds against the pattern; only then send the held-back requests

The canary blocks are the last `RankInfo.canary_slots` slots of every pool, which the owner keeps
out of its cache manager. So the canary runs through the real page tables, the real agent
registration and the real mapper, while no request's KV is touched.

The pattern is a hash of each byte's logical coordinates (global layer, K/V, global KV head,
token, byte in the head's vector), so it is the same wherever the bytes sit. Each side reads its
own pools by the layout its page table declares (the buffer convention of pdserve's page-table
builders: K then V per layer in one view, or views whose role is exactly {"k"} or {"v"}). The
receiver's check is therefore independent of the sender's address arithmetic: a mapper that
puts a head, a layer, a token or a K/V buffer in the wrong place, or a transport that lands bytes
elsewhere, fails the canary with the first wrong coordinate, before any request reads that KV.

Host memory only (the pattern is written and read through the CPU); ranks with device pools
advertise `canary_slots = 0`, and a pair where either side does is not checked.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from pdserve.kv_transfer.page_table import MapperKind, PageTable, kv_buffer_index
from pdserve.kv_transfer.rank_info import RankInfo

CANARY_SLOTS = 2  # slots an engine reserves at the end of its pool for the canary
_CANARY_ID_BASE = 1 << 63  # canary request ids live above every request id (those are below 2**63)

BlockIds = dict[int, np.ndarray]


def is_canary(disagg_id: int) -> bool:
    return disagg_id >= _CANARY_ID_BASE


def canary_disagg_id(gen_instance: str, ctx_endpoint: str) -> int:
    """One id per (generation instance, context instance): every rank of the generation instance
    uses the same one, so the context side counts them as one request's requesters."""
    digest = hashlib.blake2b(f"{gen_instance}\0{ctx_endpoint}".encode(), digest_size=8).digest()
    return _CANARY_ID_BASE | (int.from_bytes(digest, "little") >> 1)


def canary_tokens(ctx: RankInfo, gen: RankInfo) -> int:
    """Tokens the canary of this pair carries; 0 when either side reserved no canary blocks (device
    memory, or the canary turned off) or runs context parallelism (its token split is not modelled)."""
    if min(ctx.canary_slots, gen.canary_slots) == 0 or max(ctx.cp_size, gen.cp_size) > 1:
        return 0
    return min(ctx.canary_slots * ctx.tokens_per_block, gen.canary_slots * gen.tokens_per_block)


def canary_block_ids(info: RankInfo, num_tokens: int) -> BlockIds:
    """This rank's canary slot ids per layer group, enough for `num_tokens` tokens; -1 (nothing) for a
    recurrent group: the canary checks the KV pattern, and a state pool reserves no canary slot."""
    pt = info.page_table
    used = -(-num_tokens // pt.tokens_per_block)
    if not 0 < used <= info.canary_slots:
        raise ValueError(f"{num_tokens} canary tokens need {used} blocks; {info.key} reserved {info.canary_slots}")
    out = {}
    for g in pt.layer_groups:
        if g.recurrent:
            out[g.group_id] = np.array([-1], dtype=np.int64)
            continue
        first = min(pt.pools[v.pool_index].num_slots for v in g.views) - info.canary_slots
        out[g.group_id] = np.arange(first, first + used, dtype=np.int64)
    return out


@dataclass
class Gate:
    """A generation rank's first contact with one context instance: requests to it are held (their
    REQUEST_DATA unsent) until the canary passed. One canary runs at a time per rank, because every
    canary of a rank lands in the same canary blocks."""

    endpoint: str  # the context instance's rank-0 control endpoint
    disagg_id: int
    num_tokens: int  # 0: this pair is not checked (see canary_tokens)
    ctx_ranks: tuple[RankInfo, ...]  # the DP group that is asked
    held: list[int] = field(default_factory=list)  # request ids waiting for the canary
    started: bool = False
    passed: bool = False


def pattern(num_layers: int, num_heads: int, num_tokens: int, head_token_bytes: int) -> np.ndarray:
    """[num_layers, 2 (K, V), num_heads, num_tokens, head_token_bytes] uint8, a hash of the coordinates."""
    axes = np.ix_(*(np.arange(n, dtype=np.uint32) for n in (num_layers, 2, num_heads, num_tokens, head_token_bytes)))
    mult = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
    with np.errstate(over="ignore"):
        x = sum((a * np.uint32(m) for a, m in zip(axes, mult)), np.zeros((), np.uint32)) + np.uint32(0x3C6EF372)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x2C1B3C6D)
        x ^= x >> np.uint32(12)
    return (x >> np.uint32(24)).astype(np.uint8)


def fill(info: RankInfo, ids: BlockIds, num_tokens: int) -> None:
    """Write the pattern into this rank's canary blocks (the bytes it holds of tokens [0, num_tokens))."""
    want = _pattern_for(info, num_tokens)
    for buf, kv, layer, heads, tokens, kind in _walk(info, ids, num_tokens):
        buf[...] = _cut(want[layer, kv, heads[0]:heads[1], tokens[0]:tokens[1]], kind)


def zero(info: RankInfo, ids: BlockIds, num_tokens: int) -> None:
    """Clear this rank's canary blocks, so a pattern left by an earlier canary cannot pass for a new one."""
    for buf, *_ in _walk(info, ids, num_tokens):
        buf[...] = 0


def check(info: RankInfo, ids: BlockIds, num_tokens: int) -> str | None:
    """None when every byte this rank holds of the canary tokens equals the pattern; else the first
    coordinate that differs."""
    want = _pattern_for(info, num_tokens)
    for buf, kv, layer, heads, tokens, kind in _walk(info, ids, num_tokens):
        expected = _cut(want[layer, kv, heads[0]:heads[1], tokens[0]:tokens[1]], kind)
        bad = np.argwhere(buf != expected)
        if bad.size:
            h, tok = (bad[0][0], bad[0][1]) if kind == MapperKind.HND else (bad[0][1], bad[0][0])
            return (f"{len(bad)} of {buf.size} canary bytes differ in layer {layer} {'KV'[kv]} of tokens "
                    f"[{tokens[0]}, {tokens[1]}), first at KV head {heads[0] + int(h)} token {tokens[0] + int(tok)}")
    return None


def _pattern_for(info: RankInfo, num_tokens: int) -> np.ndarray:
    return pattern(info.num_layers, info.total_kv_heads, num_tokens, info.head_dim * info.element_bytes)


def _cut(logical: np.ndarray, kind: MapperKind) -> np.ndarray:
    """logical [heads, n, head_bytes] laid out as `buf` holds it ([heads, n, hb] HND, [n, heads, hb] NHD)."""
    return logical if kind == MapperKind.HND else logical.transpose(1, 0, 2)



def _walk(info: RankInfo, ids: BlockIds, num_tokens: int) -> Iterator[tuple]:
    """(buffer view [heads, n, hb] or [n, heads, hb], kv, global layer, heads, tokens, kind) for
    every K/V buffer of every canary block of this rank."""
    pt: PageTable = info.page_table
    t, hb = pt.tokens_per_block, info.head_dim * info.element_bytes
    heads = info.head_range
    for g in pt.layer_groups:
        for v in g.views:
            kind = pt.kind_of(v)
            if kind not in (MapperKind.HND, MapperKind.NHD):
                continue  # replicated side state has no heads: not part of the pattern
            pool = pt.pools[v.pool_index]
            for local, entries in v.entries_by_layer().items():
                for b, e in enumerate(entries):
                    for i, blk in enumerate(ids[g.group_id][: -(-num_tokens // t)].tolist()):
                        addr = pool.base + local * pool.effective_layer_stride + blk * pool.effective_slot_stride
                        raw = np.ctypeslib.as_array((ctypes.c_uint8 * e.size).from_address(addr + e.offset))
                        n = min(t, num_tokens - i * t)
                        shape = (heads[1] - heads[0], t, hb) if kind == MapperKind.HND else (t, heads[1] - heads[0], hb)
                        full = raw.reshape(shape)
                        buf = full[:, :n] if kind == MapperKind.HND else full[:n]
                        yield buf, kv_buffer_index(v, b), g.global_layer_ids[local], heads, (i * t, i * t + n), kind
