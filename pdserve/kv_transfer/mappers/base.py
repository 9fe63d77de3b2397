"""Mapper interface: which bytes inside a block go where.

The write plan matches one source pool view with one destination pool view and describes the
pair as a ``PairGeometry``: for each (common layer, buffer) the buffer's offset from its slot
address and its registered size on both sides, plus the heads both sides hold. A mapper turns
that into *static* fragments, the same for every block, so that a transfer is one outer sum:

    src[s, f] = src_slot[s] + src_token[s] * src_token_stride[f] + src_offset[f]
    dst[s, f] = dst_slot[s] + dst_token[s] * dst_token_stride[f] + dst_offset[f]
    size[s, f] = size[f]

``s`` runs over sub-blocks (``min(tokens_per_block)`` tokens each; one per block when both
sides use the same block size) and ``src_token[s]`` is the sub-block's first token inside its
block. No Python loop per block.

Byte geometry comes from the registered entry sizes, never from element_bytes x dims, so
sub-byte dtypes stay exact: ``head_token_bytes = size / (heads * tokens_per_block)`` must divide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pdserve.kv_transfer.errors import AlignmentError
from pdserve.kv_transfer.page_table import MapperKind


@dataclass(frozen=True, eq=False)
class PairGeometry:
    """One matched (source view, destination view) pair; index n runs over (common layer, buffer)."""

    label: str  # names the pair in error messages, e.g. "layer group 0 -> 0, role ['kv']"
    kind: MapperKind
    src_offsets: np.ndarray  # uint64 [N] bytes from the source slot address to the buffer
    dst_offsets: np.ndarray  # uint64 [N]
    src_sizes: np.ndarray  # uint64 [N] registered buffer sizes
    dst_sizes: np.ndarray  # uint64 [N]
    src_heads: int  # KV heads per rank
    dst_heads: int
    head_lo: int  # global heads both sides hold: [head_lo, head_hi)
    head_hi: int
    src_tokens_per_block: int
    dst_tokens_per_block: int
    # SECTIONED pairs: the runs of section units this pair moves, per (layer, buffer) index n:
    # (n [F] int64, src offset in the buffer [F], dst offset in the buffer [F], size [F]) uint64
    sections: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def min_tokens_per_block(self) -> int:
        return min(self.src_tokens_per_block, self.dst_tokens_per_block)

    @property
    def src_local_head(self) -> int:
        # A rank's heads start at a multiple of its head count (or it holds one duplicated
        # head), so the modulo gives the local index of the first shared global head.
        return self.head_lo % self.src_heads

    @property
    def dst_local_head(self) -> int:
        return self.head_lo % self.dst_heads

    @property
    def shared_heads(self) -> int:
        return self.head_hi - self.head_lo


def head_token_bytes(geom: PairGeometry) -> np.ndarray:
    """Bytes of one (head, token) row per buffer, equal on both sides; uint64 [N]."""
    sides = (("source", geom.src_sizes, geom.src_heads, geom.src_tokens_per_block),
             ("destination", geom.dst_sizes, geom.dst_heads, geom.dst_tokens_per_block))
    rows = []
    for side, sizes, heads, tpb in sides:
        per = np.uint64(heads * tpb)
        bad = np.flatnonzero(sizes % per)
        if bad.size:
            raise AlignmentError(
                f"{geom.label}: {side} buffer of {int(sizes[bad[0]])} bytes does not split into "
                f"{heads} heads x {tpb} tokens; head slicing would not be byte-aligned"
            )
        rows.append(sizes // per)
    if not np.array_equal(rows[0], rows[1]):
        n = int(np.flatnonzero(rows[0] != rows[1])[0])
        raise AlignmentError(
            f"{geom.label}: bytes per (head, token) differ: source {int(rows[0][n])}, destination "
            f"{int(rows[1][n])} (buffer {n}); head_dim or dtype differ between the instances"
        )
    return rows[0]


def require_equal_tokens_per_block(geom: PairGeometry, mapper: str) -> None:
    if geom.src_tokens_per_block != geom.dst_tokens_per_block:
        raise AlignmentError(
            f"{geom.label}: {mapper} needs equal tokens_per_block, got source "
            f"{geom.src_tokens_per_block} and destination {geom.dst_tokens_per_block}; "
            "configure the same tokens_per_block on both instances"
        )


class RegionMapper(ABC):
    """Static fragments of one pool-view pair; see the module docstring."""

    name: ClassVar[str]

    def __init__(self, geom: PairGeometry) -> None:
        self.geom = geom
        src_off, dst_off, sizes, src_stride, dst_stride = self._fragments(geom)
        as_u64 = lambda a, n: np.broadcast_to(np.asarray(a, dtype=np.uint64), (n,)).copy()  # noqa: E731
        n = np.asarray(src_off).size
        self.src_offsets = as_u64(src_off, n)
        self.dst_offsets = as_u64(dst_off, n)
        self.sizes = as_u64(sizes, n)
        self.src_token_stride = as_u64(src_stride, n)
        self.dst_token_stride = as_u64(dst_stride, n)
        assert self.dst_offsets.size == n and int(self.sizes.min(initial=1)) > 0
        self._merge_static()

    def _merge_static(self) -> None:
        """Merge neighbouring static fragments contiguous on both sides for every sub-block.

        That holds when offsets are contiguous and both token strides agree, so a whole
        contiguous slot becomes one static fragment before the per-block expansion.
        """
        if self.sizes.size <= 1:
            return
        end_src, end_dst = self.src_offsets[:-1] + self.sizes[:-1], self.dst_offsets[:-1] + self.sizes[:-1]
        follows = (
            (self.src_offsets[1:] == end_src) & (self.dst_offsets[1:] == end_dst)
            & (self.src_token_stride[1:] == self.src_token_stride[:-1])
            & (self.dst_token_stride[1:] == self.dst_token_stride[:-1])
        )
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        self.sizes = np.add.reduceat(self.sizes, starts)
        for name in ("src_offsets", "dst_offsets", "src_token_stride", "dst_token_stride"):
            setattr(self, name, getattr(self, name)[starts])

    @abstractmethod
    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        """(src_offsets, dst_offsets, sizes, src_token_stride, dst_token_stride), each [F]."""

    @property
    def fragments_per_subblock(self) -> int:
        return int(self.sizes.size)

    def map(
        self, src_slots: np.ndarray, src_tokens: np.ndarray | None, dst_slots: np.ndarray,
        dst_tokens: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expand to absolute (src, dst, size) for sub-blocks [S]; each output is uint64 [S*F]. Tokens
        None: every sub-block starts at its block's token 0 (one block size on both sides)."""
        src = np.add.outer(src_slots, self.src_offsets)
        dst = np.add.outer(dst_slots, self.dst_offsets)
        if src_tokens is not None:
            src += np.multiply.outer(src_tokens, self.src_token_stride)
        if dst_tokens is not None:
            dst += np.multiply.outer(dst_tokens, self.dst_token_stride)
        sizes = np.broadcast_to(self.sizes, src.shape)
        return src.ravel(), dst.ravel(), sizes.ravel()


def merge_contiguous(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge fragments that are contiguous on BOTH sides into one fragment, in source order.

    src: [a][b]     a and b merge iff src_b == src_a + size_a and dst_b == dst_a + size_a
    dst: [a][b]

    Within one plan no two fragments read the same source byte, so after sorting by source
    address every mergeable pair is adjacent: one fragment per run contiguous on both sides
    (a block-major pool merges across layers and consecutive blocks, a layer-major pool
    across consecutive blocks of a layer).
    """
    if src.size <= 1:
        return src, dst, sizes
    if not bool((src[1:] >= src[:-1]).all()):  # mappers emit source order already: skip the sort
        order = np.argsort(src, kind="stable")
        src, dst, sizes = src[order], dst[order], sizes[order]
    follows = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
    if not follows.any():  # nothing merges (the NHD shape): skip three gathers and a reduceat
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)
