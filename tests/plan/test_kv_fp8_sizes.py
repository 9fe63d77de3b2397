"""The planner prices an FP8 KV cache by what the engine allocates: half a bf16 cache's bytes per token,
in the profile's model entry, its key (a profile measured with one KV dtype is not reused for another),
and the cluster the plan writes."""

from __future__ import annotations

from argparse import Namespace

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.models.config import ModelConfig
from pdserve.plan.profile import model_sizes, profile_key
from pdserve.testing import make_tiny_model
from pdserve.weights.hf_dir import read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), num_layers=2, num_heads=4, num_kv_heads=2)


def test_kv_bytes_per_token_are_the_fp8_pools_own(tiny):
    cfg = ModelConfig.from_hf(read_config(tiny))
    sizes = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        with LLM(EngineConfig(model=str(tiny), tokens_per_block=8, num_kv_blocks=4, kv_cache_dtype=kv)) as llm:
            pool = llm.engine.runner.pool
            per_token = pool[0].numel() * pool.element_size() // 8
        sizes[kv] = model_sizes(cfg, "float32", kv)
        assert sizes[kv]["kv_bytes_per_token"] == per_token
        assert sizes[kv]["element_bytes"] == pool.element_size()
    assert 2 * sizes["fp8_e4m3"]["kv_bytes_per_token"] == sizes["bfloat16"]["kv_bytes_per_token"]
    assert model_sizes(cfg, "bfloat16") == sizes["bfloat16"]  # auto: the weights' dtype


def test_the_kv_dtype_keys_the_profile_and_reaches_the_cluster(tiny):
    assert "kv_cache_dtype" not in profile_key(tiny, "float32", "cpu")  # older cached profiles keep their key
    assert profile_key(tiny, "float32", "cpu", "fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    from pdserve.plan.candidates import Candidate, Role
    from pdserve.plan.run import cluster_of

    cand = Candidate("ctx 1 + gen 1", "disaggregated", Role(1, 1, 512), Role(1, 1, 512))
    args = Namespace(model=str(tiny), backend="shm", port=8000, dtype="float32", kv_cache_dtype="fp8_e4m3")
    doc = cluster_of(cand, args, Namespace(key={"device": "cpu"}))
    assert [i["config"]["kv_cache_dtype"] for i in doc["context"] + doc["generation"]] == ["fp8_e4m3"] * 2
