"""Plain factories for the arithmetic tests: RankInfo over fake (never dereferenced) addresses."""

from __future__ import annotations

from dataclasses import replace

from pdserve.kv_transfer import BufferEntry, LayerGroup, MapperKind, PageTable, PhysicalPool, PoolView, RankInfo
from pdserve.testing.kv_oracle import ModelShape, Topology, make_rank_info, pool_sizes

GiB = 1 << 30


def info(name: str, topo: Topology, model: ModelShape, rank: int) -> RankInfo:
    """RankInfo of one rank; pool i of rank r sits at a distinct fake address."""
    n = len(pool_sizes(topo, model, rank))
    bases = [(1 + 64 * rank + i) * GiB for i in range(n)]
    return make_rank_info(name, topo, model, rank, bases)


def instance(name: str, topo: Topology, model: ModelShape) -> list[RankInfo]:
    return [info(name, topo, model, r) for r in range(topo.world_size)]


def with_table(ri: RankInfo, table: PageTable, **changes) -> RankInfo:
    return replace(ri, page_table=table, tokens_per_block=table.tokens_per_block, **changes)


def replicated_instance(name: str, tp: int, dp: int = 1, layers: int = 2, tpb: int = 16,
                        row: int = 8) -> list[RankInfo]:
    """tp ranks whose only pool is REPLICATED (identical bytes on every TP rank)."""
    out = []
    for r in range(tp):
        pool = PhysicalPool((1 + r) * GiB, tpb * row, 8)
        view = PoolView(0, frozenset({"index"}), tuple(BufferEntry(layer, 0, tpb * row) for layer in range(layers)))
        table = PageTable((pool,), (LayerGroup(0, tuple(range(layers)), None, (view,)),), MapperKind.REPLICATED, tpb)
        out.append(RankInfo(
            instance_name=name, rank=r, tp_size=tp, tp_rank=r, pp_size=1, pp_rank=0, cp_size=1, cp_rank=0,
            dp_size=dp, dp_rank=r // (tp // dp), layers_per_pp_stage=(layers,), total_kv_heads=8,
            kv_heads_per_rank=max(1, 8 // (tp // dp)), head_dim=row, element_bytes=1, tokens_per_block=tpb,
            page_table=table,
            agent_descriptor=b"", control_endpoint="tcp://127.0.0.1:1",
        ))
    return out
