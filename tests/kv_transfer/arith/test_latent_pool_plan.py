"""The write plan over MLA's latent pool (the engine's page table for DeepSeek-V3: page_table_for_latent_pool,
REPLICATED): every context TP rank holds the same latents, and each generation rank gets every byte of its
blocks exactly once, from one elected context rank.

Real plans over numpy memory: each context rank's pool is filled with the same latents (what MLA's replicated
cache holds), plan_write's fragments are copied with memmove, and every destination byte is counted.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.page_table import MapperKind, page_table_for_latent_pool
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.write_plan import plan_write, writers_for
from pdserve.testing.kv_oracle import SimRank, count_writes, execute_plan

LAYERS, T, LATENT, ELT = 3, 8, 40, 2  # the tiny DeepSeek-V3: 3 layers of a 40-wide latent, bf16
BLOCKS = 6


def _instance(name: str, tp: int, pp: int = 1) -> list[SimRank]:
    stages = [LAYERS // pp + (p < LAYERS % pp) for p in range(pp)]
    ranks = []
    for rank in range(tp * pp):
        p, t = divmod(rank, tp)
        first = sum(stages[:p])
        mem = np.zeros(BLOCKS * stages[p] * T * LATENT * ELT, np.uint8)
        table = page_table_for_latent_pool(mem.ctypes.data, BLOCKS, stages[p], T, LATENT * ELT,
                                           range(first, first + stages[p]))
        info = RankInfo(instance_name=name, rank=rank, tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=p, cp_size=1,
                        cp_rank=0, dp_size=1, dp_rank=0, layers_per_pp_stage=tuple(stages), total_kv_heads=1,
                        kv_heads_per_rank=1, head_dim=LATENT, element_bytes=ELT, tokens_per_block=T,
                        page_table=table, agent_descriptor=b"", control_endpoint=f"tcp://127.0.0.1:{rank}")
        ranks.append(SimRank(info, [mem]))
    return ranks


def _latents(rank: SimRank) -> np.ndarray:
    """The rank's pool as [blocks, local layers, T, latent bytes]."""
    return rank.pools[0].reshape(BLOCKS, -1, T, LATENT * ELT)


@pytest.mark.parametrize("ctx_tp, gen_tp, gen_pp, owners", [
    (2, 1, 1, [[0]]),
    (1, 2, 1, [[0], [0]]),
    (2, 4, 1, [[0], [0], [1], [1]]),
    (2, 1, 2, [[0], [0]]),
], ids=["ctx TP2 -> gen TP1", "TP1 -> TP2", "TP2 -> TP4", "TP2 -> gen PP2"])
def test_each_destination_byte_is_written_once_by_one_elected_rank(ctx_tp, gen_tp, gen_pp, owners):
    ctx, gen = _instance("ctx", ctx_tp), _instance("gen", 1 if gen_pp > 1 else gen_tp, gen_pp)
    assert all(r.info.page_table.kind_of(r.info.page_table.layer_groups[0].views[0]) == MapperKind.REPLICATED
               for r in ctx + gen)
    rng = np.random.default_rng(0)
    tokens = 21  # three blocks, the last partial
    latents = rng.integers(0, 256, (LAYERS, tokens, LATENT * ELT), dtype=np.uint8)
    ctx_ids, gen_ids = np.array([4, 1, 3]), np.array([0, 5, 2])
    for c in ctx:  # every context TP rank keeps the same latents
        for i, b in enumerate(ctx_ids):
            n = min(T, tokens - i * T)
            _latents(c)[b, :, :n] = latents[:, i * T:i * T + n]
    for g, want_writers in zip(gen, owners):
        writers = writers_for(g.info, [c.info for c in ctx])
        assert writers == want_writers
        plans = [plan_write(c.info, g.info, {0: ctx_ids}, {0: gen_ids}) for c in ctx]
        assert [c.info.rank for c, p in zip(ctx, plans) if p is not None] == writers
        plans = [p for p in plans if p is not None]
        for p in plans:
            execute_plan(p)
        counts = count_writes(g, plans)[0].reshape(BLOCKS, -1, T, LATENT * ELT)
        first = sum(g.info.layers_per_pp_stage[:g.info.pp_rank])
        local = g.info.layers_per_pp_stage[g.info.pp_rank]
        assert (counts[gen_ids] == 1).all()  # whole blocks move (the partial block's tail too), once each
        assert counts[np.setdiff1d(np.arange(BLOCKS), gen_ids)].sum() == 0
        for i, b in enumerate(gen_ids):
            n = min(T, tokens - i * T)
            assert (_latents(g)[b, :, :n] == latents[first:first + local, i * T:i * T + n]).all()
