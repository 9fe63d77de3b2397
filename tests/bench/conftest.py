"""Fixtures: a tiny random-weight model and its tokenizer."""

from __future__ import annotations

import pytest

from pdserve.testing import make_tiny_model
from pdserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny-bench", num_layers=2, num_heads=4,
                           num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def bench_tokenizer(bench_model_dir):
    return Tokenizer.from_dir(bench_model_dir)
