"""KV head replication: a model with one KV head, so every rank of a tp2 instance holds a replica of it.
A replicated context side must send one copy; a replicated generation side must receive it on every
rank. Shared memory, NHD, 16 tokens per block; greedy output equals one aggregated instance."""

from __future__ import annotations

import pytest
from e2e_checks import check_split
from e2e_cluster import TINY_BASE, Spec, start_instances, stop_instances

NHD16 = {"cache_transceiver_config": {"backend": "shm"}, "kv_layout": "NHD", "tokens_per_block": 16}
TP2, PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def kv1_group(tiny_kv1, e2e_dir, plain):
    specs = [
        Spec("kv1-tp1", tiny_kv1, NHD16),
        Spec("kv1-tp2", tiny_kv1, {**NHD16, **TP2}),
        Spec("kv1-tp2pp2", tiny_kv1, {**NHD16, **TP2, **PP2}),
    ]
    insts = start_instances(specs, e2e_dir / "kv1", TINY_BASE)
    yield insts
    stop_instances(insts.values())


PAIRS = [("kv1-tp2", "kv1-tp1"), ("kv1-tp1", "kv1-tp2"), ("kv1-tp2pp2", "kv1-tp1"), ("kv1-tp1", "kv1-tp2pp2")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_replicated_pair_equals_aggregated(kv1_group, reference_kv1, e2e_dir, ctx, gen):
    check_split(kv1_group, ctx, gen, reference_kv1, e2e_dir / "kv1")
