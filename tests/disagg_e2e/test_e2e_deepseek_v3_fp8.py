"""DeepSeek-V3 published in FP8 (block scales, its MTP layer beside; pdserve/testing/fp8_checkpoint.py),
disaggregated through real workers: a context TP1 instance prefills, a generation TP2 instance, each rank
cutting its shard from the weights dequantized at load, decodes; an orchestrator and the official openai client
in front. The greedy answers equal the context instance's own aggregated ones, which
tests/engine/test_engine_deepseek_v3_fp8.py holds to transformers' on the dequantized weights."""

from __future__ import annotations

import pytest
from e2e_checks import Reference, check_split
from e2e_cluster import TINY_BASE, Spec, openai_client, start_instances, stop_instances

from pdserve.testing.fp8_checkpoint import make_tiny_deepseek_v3_fp8

SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": 6000}, "tokens_per_block": 16}


@pytest.fixture(scope="module")
def fp8_group(e2e_dir):
    pytest.importorskip("transformers")
    fp8, _ = make_tiny_deepseek_v3_fp8(e2e_dir / "tiny-deepseek_v3-fp8", max_position_embeddings=1024)
    specs = [Spec("fp8-tp1", str(fp8), SHM), Spec("fp8-tp2", str(fp8), {**SHM, "tensor_parallel_size": 2})]
    insts = start_instances(specs, e2e_dir / "deepseek_v3_fp8", TINY_BASE)
    yield insts
    stop_instances(insts.values())


def test_context_tp1_to_generation_tp2_equals_aggregated(fp8_group, e2e_dir):
    reference = Reference(openai_client(fp8_group["fp8-tp1"].url))
    check_split(fp8_group, "fp8-tp1", "fp8-tp2", reference, e2e_dir / "deepseek_v3_fp8")
