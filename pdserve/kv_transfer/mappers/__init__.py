"""Mappers: one matched pool-view pair -> (src_ptrs, dst_ptrs, sizes)."""

from pdserve.kv_transfer.mappers.base import PairGeometry, RegionMapper, merge_contiguous
from pdserve.kv_transfer.mappers.hnd_mismatch import HNDHeadMismatchMapper
from pdserve.kv_transfer.mappers.intact import IntactMapper
from pdserve.kv_transfer.mappers.nhd_mismatch import NHDHeadMismatchMapper
from pdserve.kv_transfer.mappers.replicated import ReplicatedMapper
from pdserve.kv_transfer.mappers.sectioned import SectionedMapper
from pdserve.kv_transfer.page_table import MapperKind


def build_mapper(geom: PairGeometry) -> RegionMapper:
    """Choose the mapper of a pair: with equal head sets every layout collapses to Intact."""
    if geom.kind == MapperKind.REPLICATED:
        return ReplicatedMapper(geom)
    if geom.kind == MapperKind.SECTIONED:
        return SectionedMapper(geom)
    if geom.src_heads == geom.dst_heads:
        return IntactMapper(geom)
    if geom.kind == MapperKind.NHD:
        return NHDHeadMismatchMapper(geom)
    return HNDHeadMismatchMapper(geom)


__all__ = [
    "HNDHeadMismatchMapper",
    "IntactMapper",
    "NHDHeadMismatchMapper",
    "PairGeometry",
    "RegionMapper",
    "ReplicatedMapper",
    "SectionedMapper",
    "build_mapper",
    "merge_contiguous",
]
