"""KV exchange: move a prompt's KV cache between instances that cut it differently.

Data path: page_table -> write_plan (pairing, ownership) -> mappers (bytes) -> agents/ (writes),
with control/ (ZeroMQ) beside it and transceiver/ (the API an executor drives) over them all. This
package has no HTTP in it.
"""

from pdserve.kv_transfer.errors import AlignmentError, KVTransferError, SchemaError
from pdserve.kv_transfer.page_table import (
    BufferEntry,
    LayerGroup,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
    Section,
    page_table_for_block_major_pool,
    page_table_for_layer_major_pools,
)
from pdserve.kv_transfer.rank_info import RankInfo, flat_rank
from pdserve.kv_transfer.write_plan import TransferPlan, overlapping_ranks, plan_write, writers_for

__all__ = [
    "AlignmentError",
    "BufferEntry",
    "KVTransferError",
    "LayerGroup",
    "MapperKind",
    "PageTable",
    "PhysicalPool",
    "PoolView",
    "Section",
    "RankInfo",
    "SchemaError",
    "TransferPlan",
    "flat_rank",
    "overlapping_ranks",
    "page_table_for_block_major_pool",
    "page_table_for_layer_major_pools",
    "plan_write",
    "writers_for",
]
