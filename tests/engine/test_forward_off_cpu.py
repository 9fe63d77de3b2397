"""The forward step with the model and its KV pool off the CPU, on PyTorch's `meta` device standing in
for CUDA (no task so far was lent a GPU): every off-CPU branch runs (SDPA, PyTorch RoPE and cache
writes, no native kernel), and a tensor made on the CPU by mistake, then combined with the model's,
stops the step. Values do not exist on `meta`, so the weights are not loaded and nothing is sampled;
what the forward computes is checked on the CPU against transformers (test_engine_tiny)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import model_runner
from pdserve.engine.model_runner import ModelRunner, SeqStep, StepSpec
from pdserve.engine.sampler import SampleSpec
from pdserve.models.config import ModelConfig
from pdserve.parallel.state import ParallelState
from pdserve.testing import make_tiny_model
from pdserve.weights.hf_dir import read_config

GREEDY = SampleSpec(temperature=0.0)
STEPS = {
    "whole prompt": [SeqStep(list(range(3, 23)), 0, [0, 1, 2], GREEDY)],
    "chunk after a cached prefix, with decodes": [SeqStep(list(range(3, 10)), 20, [0, 1, 2, 3], None),
                                                  SeqStep([5], 17, [4, 5, 6], GREEDY),
                                                  SeqStep([7], 9, [7, 8], GREEDY)],
    "decodes only": [SeqStep([5], 17, [4, 5, 6], GREEDY), SeqStep([7], 9, [7, 8], GREEDY)],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Its second layer attends through a sliding window, so the windowed masks run too."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, tie_word_embeddings=True, sliding_window=8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_every_tensor_of_a_step_stays_on_the_device(tiny, dtype, layout, monkeypatch):
    monkeypatch.setattr(model_runner, "load_weights", lambda *args, **kwargs: None)
    ecfg = EngineConfig(model=str(tiny), tokens_per_block=8, num_kv_blocks=16, dtype=dtype, kv_layout=layout)
    runner = ModelRunner(ecfg, ModelConfig.from_hf(read_config(Path(tiny))), Path(tiny), ParallelState(),
                         torch.device("meta"), 256, "off-cpu")
    assert runner.pool.is_meta and all(p.is_meta for p in runner.model.parameters())
    vocab = runner.model.cfg.vocab_size
    for name, seqs in STEPS.items():
        ids, positions, md, rows = runner._prepare(StepSpec(seqs))
        out_rows = torch.tensor(rows, device=runner.device) if len(rows) < len(ids) else None
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(ids, positions, runner.cache, md, out_rows))
        assert logits.is_meta and tuple(logits.shape) == (len(rows), vocab), name


def test_a_cpu_tensor_in_a_meta_step_is_caught():
    """What the test above relies on: meta refuses to combine with a CPU tensor."""
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(2, device="meta") + torch.ones(2)
