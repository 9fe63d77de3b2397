"""Replicated: the pool's bytes are identical on every TP rank (e.g. an index-key side cache).

    src slot: [L0 buffer][L1 buffer] ...    copied whole; no head slicing applies
    dst slot: [L0 buffer][L1 buffer] ...

One sender per destination is chosen by the write plan's fan-in election. Bytes inside a block
are addressed by token, so both sides need the same tokens_per_block and buffer sizes.
"""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.errors import AlignmentError
from pdserve.kv_transfer.mappers.base import PairGeometry, RegionMapper, require_equal_tokens_per_block


class ReplicatedMapper(RegionMapper):
    name = "Replicated"

    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        require_equal_tokens_per_block(geom, self.name)
        if not np.array_equal(geom.src_sizes, geom.dst_sizes):
            n = int(np.flatnonzero(geom.src_sizes != geom.dst_sizes)[0])
            raise AlignmentError(
                f"{geom.label}: replicated buffer sizes differ: source {int(geom.src_sizes[n])} bytes, "
                f"destination {int(geom.dst_sizes[n])} bytes (buffer {n})"
            )
        # Token stride is only used with sub-blocks, which equal tokens_per_block rules out.
        stride = geom.src_sizes // np.uint64(geom.src_tokens_per_block)
        return geom.src_offsets, geom.dst_offsets, geom.src_sizes, stride, stride
