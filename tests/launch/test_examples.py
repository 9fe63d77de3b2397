"""Every example cluster file parses, and every worker config in it validates, as `pdserve launch`
would check it before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.orchestrator.config import DisaggConfig
from pdserve.launch.config import load_cluster_config, worker_configs

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("cluster*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_cluster_is_valid(path):
    cfg = load_cluster_config(str(path))
    confs = worker_configs(cfg)
    assert len(confs) == len(cfg.context) + len(cfg.generation)
    assert all(c["cache_transceiver_config"]["backend"] in ("nixl", "shm") for c in confs)
    urls = {"urls": ["http://127.0.0.1:1"]}
    DisaggConfig(**{**cfg.orchestrator, "context_servers": {**cfg.orchestrator.get("context_servers", {}), **urls},
                    "generation_servers": {**cfg.orchestrator.get("generation_servers", {}), **urls}})


def test_the_generation_first_example_pipelines():
    cfg = load_cluster_config(str(Path(__file__).parents[2] / "examples" / "cluster_generation_first.yaml"))
    ctx = worker_configs(cfg)[0]
    assert ctx["cache_transceiver_config"] == {"backend": "shm", "pipelined_transfer": True,
                                               "cluster_token": cfg.cluster_token}  # launch's own
    assert cfg.orchestrator["schedule_style"] == "generation_first"
