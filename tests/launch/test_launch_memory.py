"""`pdserve launch` adds up the memory of the instances that share this host's CPU before starting any of them
(launch/config.py, too_big_for_memory, over engine/footprint.py): each instance alone checks only its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pdserve.engine.footprint import GIB, footprint
from pdserve.launch.config import ClusterConfig, too_big_for_memory, worker_configs
from pdserve.config import WorkerConfig
from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.weights.hf_dir import read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m"), num_layers=2))


def test_the_instances_on_one_host_are_added_up(tiny):
    cluster = ClusterConfig(model=tiny, backend="shm", context=[{"config": {"device": "cpu"}}],
                            generation=[{"config": {"device": "cpu", "kv_cache_memory_gb": 0.01}}])
    model = ModelConfig.from_hf(read_config(tiny))
    each = [footprint(model, WorkerConfig(**conf), "cpu") for conf in worker_configs(cluster)]
    total = sum(fp.total for fp in each)
    assert max(fp.total for fp in each) < total  # either fits alone
    assert too_big_for_memory(cluster, available=total) is None
    why = too_big_for_memory(cluster, available=total - 1)
    assert f"need {total / GIB:.2f} GiB together" in why and f"ctx0 {each[0].total / GIB:.2f} GiB" in why
    assert f"gen0 {each[1].total / GIB:.2f} GiB" in why and "start fewer instances" in why


def test_launch_refuses_a_cluster_the_host_cannot_hold_before_starting_anything(tmp_path, tiny):
    path = tmp_path / "cluster.yaml"
    pool = {"device": "cpu", "kv_cache_memory_gb": 4096}  # never allocated: refused first
    path.write_text(yaml.safe_dump({"model": tiny, "log_dir": str(tmp_path / "logs"), "backend": "shm",
                                    "context": [{"config": pool}], "generation": [{"config": pool}]}))
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "launch", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "the instances on this host's CPU need 8192." in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()  # no instance was started
