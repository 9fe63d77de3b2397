"""Session fixtures: the two tiny models and one plain (aggregated, no transceiver) instance of each,
which is both the reference every disaggregated pair is compared with and the worker that must refuse
disaggregated requests."""

from __future__ import annotations

import pytest
from e2e_checks import Reference
from e2e_cluster import TINY_BASE, Spec, openai_client, start_instances, stop_instances

from pdserve.testing import make_tiny_model


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disagg-e2e")


@pytest.fixture(scope="session")
def tiny_kv2(e2e_dir) -> str:
    """8 query heads over 2 KV heads: split at tp2, replicated at tp4."""
    return str(make_tiny_model(e2e_dir / "tiny-kv2", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
                               max_position_embeddings=1024))


@pytest.fixture(scope="session")
def tiny_kv1(e2e_dir) -> str:
    """One KV head: every rank of a tp2 instance holds a replica of it."""
    return str(make_tiny_model(e2e_dir / "tiny-kv1", num_layers=4, num_heads=8, num_kv_heads=1, head_dim=16,
                               max_position_embeddings=1024))


@pytest.fixture(scope="session")
def plain(tiny_kv2, tiny_kv1, e2e_dir):
    """Aggregated tp1 instances without cache_transceiver_config, one per tiny model."""
    insts = start_instances([Spec("plain-kv2", tiny_kv2), Spec("plain-kv1", tiny_kv1)], e2e_dir / "plain", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.fixture(scope="session")
def reference_kv2(plain) -> Reference:
    return Reference(openai_client(plain["plain-kv2"].url))


@pytest.fixture(scope="session")
def reference_kv1(plain) -> Reference:
    return Reference(openai_client(plain["plain-kv1"].url))
