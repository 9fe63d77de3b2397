"""Fixtures: the tiny model, real `pdserve serve` workers (plain ones now; transceiver-enabled ones once
the worker side supports them), and orchestrator configs pointing at them."""

from __future__ import annotations

import pytest
from harness import start_workers

from pdserve.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("disagg-tiny") / "tiny", num_layers=2, num_heads=4,
                           num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def workers(tiny_model_dir, tmp_path_factory):
    """Three plain workers: 0 and 1 stay up for the whole session; tests may kill 2."""
    ws = start_workers(tiny_model_dir, tmp_path_factory.mktemp("workers"), 3)
    yield ws
    for w in ws:
        w.stop()
