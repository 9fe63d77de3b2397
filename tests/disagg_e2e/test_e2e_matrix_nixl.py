"""Topology matrix over NIXL (UCX), NHD layout, 32 tokens per block: through `pdserve disaggregated` and
the official openai client, greedy output equals one aggregated instance token for token for tp2->tp1,
tp1->tp2, tp2->pp2 and pp2->tp2; and generation_first with a pipelined context instance (its prefill
runs in chunks of 32 tokens, each chunk's KV sent while the next is computed) for tp2->pp2.

Kept to 5 ranks: each NIXL agent runs a progress thread that costs about a fifth of a core even when
idle, and this machine has two."""

from __future__ import annotations

import pytest
from e2e_checks import check_split
from e2e_cluster import TINY_BASE, Spec, start_instances, stop_instances

NHD32 = {"cache_transceiver_config": {"backend": "nixl"}, "kv_layout": "NHD", "tokens_per_block": 32}


@pytest.fixture(scope="module")
def nixl_group(tiny_kv2, e2e_dir, plain):
    specs = [
        Spec("nixl-tp1", tiny_kv2, NHD32),
        # Chunked prefill (32-token chunks) and pipelined sends for generation_first requests.
        Spec("nixl-tp2", tiny_kv2, {**NHD32, "tensor_parallel_size": 2, "max_num_tokens": 32,
                                    "cache_transceiver_config": {"backend": "nixl", "pipelined_transfer": True}}),
        Spec("nixl-pp2", tiny_kv2, {**NHD32, "pipeline_parallel_size": 2}),
    ]
    insts = start_instances(specs, e2e_dir / "nixl", TINY_BASE)
    yield insts
    stop_instances(insts.values())


PAIRS = [("nixl-tp2", "nixl-tp1"), ("nixl-tp1", "nixl-tp2"), ("nixl-tp2", "nixl-pp2"), ("nixl-pp2", "nixl-tp2")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_pair_equals_aggregated(nixl_group, reference_kv2, e2e_dir, ctx, gen):
    check_split(nixl_group, ctx, gen, reference_kv2, e2e_dir / "nixl")


def test_generation_first_pipelined_equals_aggregated(nixl_group, reference_kv2, e2e_dir):
    check_split(nixl_group, "nixl-tp2", "nixl-pp2", reference_kv2, e2e_dir / "nixl", schedule_style="generation_first")
