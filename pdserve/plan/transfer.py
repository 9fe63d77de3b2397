"""The KV transfer plan between a context and a generation layout, before anything is deployed.

Builds each rank's RankInfo the way the engine does (model_runner.py: one block-major pool per rank,
its pipeline stage's layers, its share of the KV heads, or MLA's whole latent pool, REPLICATED) over made-up
addresses, and runs the real
write planner (kv_transfer/write_plan.py) for one request of N prompt tokens: which context rank
owns (writes) which generation rank's bytes, in how many descriptors, and whether the bounce buffer
would gather them (its gate: BounceConfig.kv_passes) or they go direct.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.page_table import MapperKind, page_table_for_block_major_pool, page_table_for_latent_pool
from pdserve.kv_transfer.rank_info import RankInfo, flat_rank
from pdserve.kv_transfer.write_plan import plan_write, writers_for
from pdserve.models.llama import stage_layers


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'tp2', 'pp2', 'tp2pp2' or '1' (one rank)."""
        t = text.strip().lower()
        if t == "1":
            return cls()
        m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", t)
        tp, pp = (int(m.group(1) or 1), int(m.group(2) or 1)) if m and t else (0, 0)
        if tp < 1 or pp < 1:
            raise ValueError(f"layout {text!r} must look like tp2, pp2 or tp2pp2 (sizes >= 1)")
        return cls(tp, pp)

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp}"


@dataclass
class PairRow:
    ctx_rank: int
    gen_rank: int
    owner: bool
    descriptors: int
    nbytes: int
    path: str  # "direct" or "bounce"
    gate_passes: bool = False  # the bounce gate (BounceConfig.kv_passes) takes these fragments
    pool: str = "HND"  # the pool's mapper kind: HND, NHD, or REPLICATED (MLA's latent)

    @property
    def written(self) -> int:
        """Descriptors the transfer agent writes: the plan's fragments, or one gathered write when bounced
        (on the pool's device: GPU memory for a VRAM pool, kv_transfer/bounce.py)."""
        return 1 if self.path == "bounce" else self.descriptors


def rank_infos(name: str, layout: Layout, num_layers: int, kv_heads: int, head_dim: int, element_bytes: int,
               tokens_per_block: int, num_blocks: int, kv_layout: str = "HND", latent: bool = False) -> list[RankInfo]:
    """`latent`: MLA, one latent of `head_dim` per token and layer (kv_heads 1), whole on every TP rank."""
    per_stage = stage_layers(num_layers, layout.pp)
    if min(per_stage) < 1:
        raise ValueError(f"{layout} cannot split {num_layers} layers into {layout.pp} stages")
    if kv_heads % layout.tp and layout.tp % kv_heads:
        raise ValueError(f"{layout}: {kv_heads} KV heads and TP {layout.tp}: one must divide the other")
    heads = max(1, kv_heads // layout.tp)
    out = []
    for pp in range(layout.pp):
        first = sum(per_stage[:pp])
        for tp in range(layout.tp):
            rank = flat_rank(pp, tp, 0, layout.tp, 1)
            base = (1 << 40) * (rank + 1) + (1 << 36) * (name == "gen")
            layers = range(first, first + per_stage[pp])
            if latent:
                table = page_table_for_latent_pool(base, num_blocks, per_stage[pp], tokens_per_block,
                                                   head_dim * element_bytes, layers)
            else:
                table = page_table_for_block_major_pool(base, num_blocks, per_stage[pp], heads, tokens_per_block,
                                                        head_dim, element_bytes, MapperKind[kv_layout], layers)
            out.append(RankInfo(name, rank, layout.tp, tp, layout.pp, pp, 1, 0, 1, 0, tuple(per_stage), kv_heads, heads,
                                head_dim, element_bytes, tokens_per_block, table, b"", f"tcp://127.0.0.1:{rank}"))
    return out


def transfer_plan(ctx: Layout, gen: Layout, *, num_layers: int, kv_heads: int, head_dim: int, element_bytes: int,
                  prompt_tokens: int, tokens_per_block: int = 32, kv_layout: str = "HND",
                  bounce: BounceConfig | None = None, latent: bool = False, on_device: bool = False) -> list[PairRow]:
    """One row per (context rank, generation rank) pair for a request of `prompt_tokens` tokens.
    `on_device`: the KV pools are in GPU memory, where the bounce gate takes any prompt length."""
    blocks = -(-prompt_tokens // tokens_per_block)
    ids = {0: np.arange(blocks, dtype=np.int64)}
    geometry = (num_layers, kv_heads, head_dim, element_bytes, tokens_per_block, blocks + 1, kv_layout, latent)
    pool = "REPLICATED" if latent else kv_layout
    ctx_ranks = rank_infos("ctx", ctx, *geometry)
    rows = []
    for g in rank_infos("gen", gen, *geometry):
        owners = set(writers_for(g, ctx_ranks))
        for c in ctx_ranks:
            plan = plan_write(c, g, ids, ids) if c.rank in owners else None
            if plan is None:
                rows.append(PairRow(c.rank, g.rank, False, 0, 0, "-", pool=pool))
                continue
            passes = (bounce or BounceConfig()).kv_passes(blocks, plan.sizes, on_device)
            path = "bounce" if bounce is not None and passes else "direct"
            rows.append(PairRow(c.rank, g.rank, True, len(plan), plan.num_bytes, path, passes, pool))
    return rows


def format_transfer_plan(ctx: Layout, gen: Layout, rows: list[PairRow], prompt_tokens: int,
                         bounce: BounceConfig | None) -> str:
    total = sum(r.nbytes for r in rows)
    lines = [f"KV transfer plan, context {ctx} -> generation {gen}, one request of {prompt_tokens} prompt tokens "
             f"({total / 2**20:.2f} MiB in all; bounce {'on' if bounce else 'off'}):",
             f"  {'ctx rank':>8}  {'gen rank':>8}  {'owner':>5}  {'descriptors':>11}  {'written':>7}  {'bytes':>12}  "
             f"{'pool':>10}  path"]
    for r in rows:
        lines.append(f"  {r.ctx_rank:>8}  {r.gen_rank:>8}  {'yes' if r.owner else 'no':>5}  {r.descriptors:>11}  "
                     f"{r.written:>7}  {r.nbytes:>12}  {r.pool:>10}  {r.path}")
    owned = [r for r in rows if r.owner]
    lines.append(f"  per request: {sum(r.descriptors for r in owned)} fragments, {sum(r.written for r in owned)} "
                 "descriptors written")
    if any(r.pool == "REPLICATED" for r in rows):
        lines.append("  REPLICATED: MLA's latent cache, the same bytes on every context TP rank; each generation rank "
                     "takes its blocks whole from one elected context rank")
    if bounce is None:
        would = [r for r in rows if r.gate_passes]
        if would:
            lines.append(f"  {len(would)} pair(s) write many small fragments: cache_transceiver_config.bounce."
                         "enabled: true (on both sides) would gather each pair's into one write")
    return "\n".join(lines)
