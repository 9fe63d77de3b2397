"""Every candidate the planner weighs is a cluster.yaml `pdserve launch` accepts, on cores of its own."""

from __future__ import annotations

import pytest

from pdserve.launch.config import ClusterConfig, worker_configs
from pdserve.plan.candidates import enumerate_candidates


@pytest.mark.parametrize("units,total", [([1, 2], 2), ([1, 2, 4, 8], 8), ([1], 1)])
def test_every_candidate_launches_on_disjoint_cores_that_fill_the_machine(units, total):
    cands = enumerate_candidates(units, total, input_len=1024, tpot_slo_ms=40)
    assert len({c.name for c in cands}) == len(cands)
    kinds = {c.kind for c in cands}
    assert kinds == ({"aggregated"} if total == 1 else {"aggregated", "disaggregated"})
    for c in cands:
        doc = c.cluster_yaml(model=None, backend="shm")
        cfg = ClusterConfig(**doc)
        worker_configs(cfg)  # every instance's worker config validates
        cores = [core for inst in cfg.context + cfg.generation for core in inst.cpus]
        assert sorted(cores) == list(range(total)), c.name
        budgets = {inst.config.get("tpot_slo_ms") for inst in cfg.generation}
        assert budgets == ({40} if c.name.endswith("-t40") else {None}), c.name
        if c.kind == "aggregated":
            assert cfg.context == []
        else:
            assert cfg.context and cfg.generation
            style = (doc.get("orchestrator") or {}).get("schedule_style", "context_first")
            assert style == c.schedule_style
            pipelined = [i.config.get("cache_transceiver_config", {}).get("pipelined_transfer") for i in cfg.context]
            assert all(pipelined) == (c.schedule_style == "generation_first")


def test_a_gpu_plan_pins_no_cores():
    [c, *_] = enumerate_candidates([1], 2, input_len=512)
    doc = c.cluster_yaml(model="m", backend="nixl", device="cuda")
    assert all("cpus" not in inst and "num_threads" not in inst["config"] for inst in doc["generation"])


def test_each_aggregated_layout_comes_with_and_without_the_tpot_budget():
    plain = {c.name for c in enumerate_candidates([1, 2], 2, input_len=512) if c.kind == "aggregated"}
    both = {c.name for c in enumerate_candidates([1, 2], 2, input_len=512, tpot_slo_ms=30) if c.kind == "aggregated"}
    assert both == plain | {f"{name}-t30" for name in plain}
