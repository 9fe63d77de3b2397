"""HND head mismatch: the two ranks hold different head sets; storage is head-major.

One buffer (the K or the V of one layer) in HND storage, 4 heads x T tokens:

    src buffer: [h0: t0..tT][h1: t0..tT][h2: t0..tT][h3: t0..tT]
                            \\_____ shared heads h1..h2 _____/
    dst buffer:             [h1: t0..tT][h2: t0..tT]

The shared heads are one contiguous byte range on both sides, so each buffer is one fragment
of ``shared_heads * T * head_token_bytes``. Local head offsets come from the global head index
modulo the per-rank head count (``PairGeometry.src_local_head``), which also covers head
duplication (total_kv_heads < tp: each rank holds one head shared by several ranks).

With different tokens_per_block (e.g. 16 -> 32) a head's row is only contiguous for one
sub-block of ``min(T_src, T_dst)`` tokens, so each (buffer, shared head) is one fragment per
sub-block and the sub-block's token offset moves it along the row:

    src block (T=16):  [h1: t0..t15][h2: t0..t15]
    dst block (T=32):  [h1: t0..t15 | t16..t31][h2: t0..t15 | t16..t31]
                        ^ sub-block 0  ^ sub-block 1
"""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.mappers.base import PairGeometry, RegionMapper, head_token_bytes


def hnd_head_rows(geom: PairGeometry) -> tuple[np.ndarray, ...]:
    """Fragments of the shared head range in HND buffers (see the module docstring)."""
    row = head_token_bytes(geom)  # [N]
    ts, td = geom.src_tokens_per_block, geom.dst_tokens_per_block
    src_head = geom.src_offsets + np.uint64(geom.src_local_head * ts) * row
    dst_head = geom.dst_offsets + np.uint64(geom.dst_local_head * td) * row
    if ts == td:
        return src_head, dst_head, np.uint64(geom.shared_heads * ts) * row, row, row
    k = np.arange(geom.shared_heads, dtype=np.uint64)  # [H] shared head index
    src = src_head[:, None] + np.multiply.outer(row, k * np.uint64(ts))  # [N, H]
    dst = dst_head[:, None] + np.multiply.outer(row, k * np.uint64(td))
    sizes = np.broadcast_to((np.uint64(geom.min_tokens_per_block) * row)[:, None], src.shape)
    strides = np.broadcast_to(row[:, None], src.shape)
    return src.ravel(), dst.ravel(), sizes.ravel(), strides.ravel(), strides.ravel()


class HNDHeadMismatchMapper(RegionMapper):
    name = "HNDHeadMismatch"

    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        return hnd_head_rows(geom)
