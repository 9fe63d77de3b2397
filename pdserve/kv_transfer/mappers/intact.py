"""Intact: both ranks hold the same heads, so every buffer is copied whole.

    src slot: [L0.K][L0.V][L1.K][L1.V] ...      each buffer -> the same buffer on dst
    dst slot: [L0.K][L0.V][L1.K][L1.V] ...

Buffers contiguous on BOTH sides merge into one static fragment (``RegionMapper._merge_static``)
and consecutive blocks contiguous on both sides merge in ``merge_contiguous``, so a fully
contiguous block-major pool becomes one fragment per run of consecutive blocks. With different
tokens_per_block (HND only) a head's row is contiguous for one sub-block only, and the buffer is
cut per head as in ``hnd_mismatch``.
"""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.errors import AlignmentError
from pdserve.kv_transfer.mappers.base import PairGeometry, RegionMapper, head_token_bytes
from pdserve.kv_transfer.mappers.hnd_mismatch import hnd_head_rows
from pdserve.kv_transfer.page_table import MapperKind


class IntactMapper(RegionMapper):
    name = "Intact"

    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        assert geom.src_heads == geom.dst_heads == geom.shared_heads, "Intact needs identical head sets"
        if geom.src_tokens_per_block != geom.dst_tokens_per_block:
            if geom.kind != MapperKind.HND:
                raise AlignmentError(
                    f"{geom.label}: {geom.kind.name} buffers need equal tokens_per_block, got source "
                    f"{geom.src_tokens_per_block} and destination {geom.dst_tokens_per_block}"
                )
            return hnd_head_rows(geom)
        row = head_token_bytes(geom)  # also checks that the registered sizes agree
        stride = row if geom.kind == MapperKind.HND else row * np.uint64(geom.src_heads)
        return geom.src_offsets, geom.dst_offsets, geom.src_sizes, stride, stride
