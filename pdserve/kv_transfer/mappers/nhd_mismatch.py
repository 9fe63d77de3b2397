"""NHD head mismatch: the two ranks hold different head sets; storage is token-major.

One buffer (the K or the V of one layer) in NHD storage, T tokens x 4 heads:

    src buffer: [t0: h0 h1 h2 h3][t1: h0 h1 h2 h3] ... [tT: h0 h1 h2 h3]
                       \\___/            \\___/                 \\___/   shared heads h1..h2
    dst buffer: [t0: h1 h2]      [t1: h1 h2]       ... [tT: h1 h2]

The shared heads are contiguous only inside one token, so this mapper emits one fragment per
(layer, buffer, token): layers x 2 x tokens fragments per peer for K/V. Token indices inside a
block only line up when both sides use the same tokens_per_block, which is required.
"""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.mappers.base import (
    PairGeometry,
    RegionMapper,
    head_token_bytes,
    require_equal_tokens_per_block,
)


class NHDHeadMismatchMapper(RegionMapper):
    name = "NHDHeadMismatch"

    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        require_equal_tokens_per_block(geom, self.name)
        row = head_token_bytes(geom)  # [N] bytes of one (head, token)
        t = np.arange(geom.src_tokens_per_block, dtype=np.uint64)  # [T]
        src_first = np.uint64(geom.src_local_head)
        dst_first = np.uint64(geom.dst_local_head)
        src = geom.src_offsets[:, None] + np.multiply.outer(row, t * np.uint64(geom.src_heads) + src_first)
        dst = geom.dst_offsets[:, None] + np.multiply.outer(row, t * np.uint64(geom.dst_heads) + dst_first)
        sizes = np.broadcast_to((np.uint64(geom.shared_heads) * row)[:, None], src.shape)
        src_stride = np.broadcast_to((np.uint64(geom.src_heads) * row)[:, None], src.shape)
        dst_stride = np.broadcast_to((np.uint64(geom.dst_heads) * row)[:, None], src.shape)
        return src.ravel(), dst.ravel(), sizes.ravel(), src_stride.ravel(), dst_stride.ravel()
