"""The planner's sizes of a hybrid model come from what the engine allocates: KV bytes per token count
the attention layers only, and the recurrent state one request holds is priced per request."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.models.config import ModelConfig
from pdserve.plan.profile import kv_bytes_per_token, state_bytes_per_request
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.weights.hf_dir import read_config


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sizes_are_the_engines_own(tmp_path, family, dtype):
    d = (make_tiny_model(tmp_path / "m", arch="qwen3_5", num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16)
         if family == "qwen3_5" else make_tiny_nemotron_h(tmp_path / "m", pattern="M-*-M-M*"))
    cfg = ModelConfig.from_hf(read_config(d))
    elt = getattr(torch, dtype).itemsize
    with LLM(EngineConfig(model=str(d), dtype=dtype, tokens_per_block=8, num_kv_blocks=4, max_num_seqs=2)) as llm:
        runner = llm.engine.runner
        state = runner.model.state
        per_slot = state.conv[0].numel() * state.conv.element_size() + state.ssm[0].numel() * state.ssm.element_size()
        kv_per_token = runner.pool[0].numel() * runner.pool.element_size() // 8
    assert state_bytes_per_request(cfg, elt) == per_slot
    # 2 attention layers of 8: the rest keep a state (or nothing: Nemotron-H's MLP layers)
    assert kv_bytes_per_token(cfg, elt) == kv_per_token == 2 * 2 * cfg.num_kv_heads * cfg.head_dim * elt
