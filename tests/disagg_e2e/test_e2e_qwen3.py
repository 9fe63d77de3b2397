"""Qwen3-MoE disaggregated across TP layouts, through real workers, an orchestrator and the official openai
client: greedy output equals one aggregated instance token for token, and neither side keeps a KV block
afterwards. Its KV is standard K/V heads (the q/k norms act before the cache, the experts after
attention), so the exchange re-cuts heads between TP1 and TP2 as for Llama; the TP2 instances cut every
expert's intermediate dimension. The shm TP2 context instance prefills in 24-token chunks and ships each
chunk's blocks as it goes (pipelined)."""

from __future__ import annotations

import pytest
from e2e_checks import Reference, check_split
from e2e_cluster import TINY_BASE, Spec, openai_client, start_instances, stop_instances

from pdserve.testing import make_tiny_model

SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": 6000}, "tokens_per_block": 16}
NIXL = {"cache_transceiver_config": {"backend": "nixl"}, "kv_layout": "NHD", "tokens_per_block": 16}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def moe_model(e2e_dir) -> str:
    """3 layers (0 and 2 sparse: 8 experts of 32, top 2), 4 query heads over 2 KV heads: split at TP2."""
    return str(make_tiny_model(e2e_dir / "tiny-qwen3_moe", arch="qwen3_moe", num_layers=3, num_heads=4,
                               num_kv_heads=2, head_dim=16, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def moe_group(moe_model, e2e_dir):
    specs = [
        Spec("moe-plain", moe_model),
        Spec("moe-tp1", moe_model, SHM),
        Spec("moe-tp2", moe_model, {**SHM, **TP2, "max_num_tokens": 24,
                                    "cache_transceiver_config": {**SHM["cache_transceiver_config"],
                                                                 "pipelined_transfer": True}}),
    ]
    insts = start_instances(specs, e2e_dir / "qwen3_moe", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.fixture(scope="module")
def moe_reference(moe_group) -> Reference:
    return Reference(openai_client(moe_group["moe-plain"].url))


PAIRS = [("moe-tp1", "moe-tp2"), ("moe-tp2", "moe-tp1")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_pair_equals_aggregated(moe_group, moe_reference, e2e_dir, ctx, gen):
    check_split(moe_group, ctx, gen, moe_reference, e2e_dir / "qwen3_moe")


def test_generation_first_equals_aggregated(moe_group, moe_reference, e2e_dir):
    check_split(moe_group, "moe-tp2", "moe-tp1", moe_reference, e2e_dir / "qwen3_moe",
                schedule_style="generation_first")


@pytest.fixture(scope="module")
def nixl_moe_group(moe_model, e2e_dir):
    specs = [Spec("moe-nixl-tp1", moe_model, NIXL), Spec("moe-nixl-tp2", moe_model, {**NIXL, **TP2})]
    insts = start_instances(specs, e2e_dir / "qwen3_moe_nixl", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.mark.parametrize("ctx,gen", [("moe-nixl-tp1", "moe-nixl-tp2"), ("moe-nixl-tp2", "moe-nixl-tp1")],
                         ids=["tp1->tp2", "tp2->tp1"])
def test_nixl_pair_equals_aggregated(nixl_moe_group, moe_reference, e2e_dir, ctx, gen):
    check_split(nixl_moe_group, ctx, gen, moe_reference, e2e_dir / "qwen3_moe_nixl")
