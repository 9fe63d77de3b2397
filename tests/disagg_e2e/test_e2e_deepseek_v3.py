"""DeepSeek-V3 disaggregated across TP layouts, through real workers, an orchestrator and the official openai
client: greedy output equals one aggregated instance token for token, and neither side keeps a KV block
afterwards. Its cache is MLA's latent, one vector per token and layer and the same on every TP rank, so the
exchange moves it as a REPLICATED pool: a TP1 context instance's rank writes both generation ranks of a TP2
instance, and of a TP2 context instance one elected rank writes the TP1 generation rank. The TP2 instances cut
the heads and every expert's intermediate dimension; the shm TP2 context instance prefills in 24-token chunks and
ships each chunk's blocks as it goes (pipelined)."""

from __future__ import annotations

import pytest
from e2e_checks import Reference, check_split
from e2e_cluster import TINY_BASE, Spec, openai_client, start_instances, stop_instances

from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": 6000}, "tokens_per_block": 16}
NIXL = {"cache_transceiver_config": {"backend": "nixl"}, "kv_layout": "NHD", "tokens_per_block": 16}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def ds_model(e2e_dir) -> str:
    """3 layers (0 dense, 1-2 MoE), 4 heads over a 40-wide latent: the heads split at TP2."""
    return str(make_tiny_deepseek_v3(e2e_dir / "tiny-deepseek_v3", max_position_embeddings=1024))


@pytest.fixture(scope="module")
def ds_group(ds_model, e2e_dir):
    specs = [
        Spec("ds-plain", ds_model),
        Spec("ds-tp1", ds_model, SHM),
        Spec("ds-tp2", ds_model, {**SHM, **TP2, "max_num_tokens": 24,
                                  "cache_transceiver_config": {**SHM["cache_transceiver_config"],
                                                               "pipelined_transfer": True}}),
    ]
    insts = start_instances(specs, e2e_dir / "deepseek_v3", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.fixture(scope="module")
def ds_reference(ds_group) -> Reference:
    return Reference(openai_client(ds_group["ds-plain"].url))


PAIRS = [("ds-tp1", "ds-tp2"), ("ds-tp2", "ds-tp1")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_pair_equals_aggregated(ds_group, ds_reference, e2e_dir, ctx, gen):
    check_split(ds_group, ctx, gen, ds_reference, e2e_dir / "deepseek_v3")


def test_generation_first_equals_aggregated(ds_group, ds_reference, e2e_dir):
    check_split(ds_group, "ds-tp1", "ds-tp2", ds_reference, e2e_dir / "deepseek_v3", schedule_style="generation_first")


@pytest.fixture(scope="module")
def nixl_ds_group(ds_model, e2e_dir):
    specs = [Spec("ds-nixl-tp1", ds_model, NIXL), Spec("ds-nixl-tp2", ds_model, {**NIXL, **TP2})]
    insts = start_instances(specs, e2e_dir / "deepseek_v3_nixl", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.mark.parametrize("ctx,gen", [("ds-nixl-tp1", "ds-nixl-tp2"), ("ds-nixl-tp2", "ds-nixl-tp1")],
                         ids=["tp1->tp2", "tp2->tp1"])
def test_nixl_pair_equals_aggregated(nixl_ds_group, ds_reference, e2e_dir, ctx, gen):
    check_split(nixl_ds_group, ctx, gen, ds_reference, e2e_dir / "deepseek_v3_nixl")
