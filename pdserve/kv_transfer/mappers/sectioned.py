"""Sectioned: each buffer is [Sec0 | Sec1 | ...], every section TP-sharded on its own.

A Mamba2 conv state is one such buffer per layer, ``[x | B | C]`` channel-major: x is cut by SSM
heads, B and C by groups, and with fewer groups than TP ranks each group is copied on several ranks.
Re-cutting between TP layouts is per section: the units (heads, groups, channels) both ranks hold of
each section are one contiguous run on both sides, at different offsets.

    ctx TP1 buffer:  [x: u0 u1 u2 u3 | B: g0 g1 | C: g0 g1]
    gen TP2 rank 1:                  [x: u2 u3 | B: g1 | C: g1]
                      fragments:  x u2..u3 -> x+0,  B g1 -> B+0,  C g1 -> C+0

The write plan elects the writer of each section's units (``write_plan._section_runs``) and hands
the runs here as offsets relative to the buffer (``PairGeometry.sections``); this mapper adds the
buffer offsets. A recurrent state has no token axis: a request's state is one slot, so the token
strides are 0.
"""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.mappers.base import PairGeometry, RegionMapper


class SectionedMapper(RegionMapper):
    name = "Sectioned"

    def _fragments(self, geom: PairGeometry) -> tuple[np.ndarray, ...]:
        assert geom.sections is not None, "a SECTIONED pair needs its section runs"
        buffer, src_rel, dst_rel, sizes = geom.sections  # each [F]
        zero = np.zeros(sizes.size, dtype=np.uint64)
        return geom.src_offsets[buffer] + src_rel, geom.dst_offsets[buffer] + dst_rel, sizes, zero, zero
