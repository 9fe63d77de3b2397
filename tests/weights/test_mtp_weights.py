"""Multi-token-prediction weights in a published checkpoint are recognised and skipped with one log line
(pdserve/weights/mtp.py), never refused as unknown tensors nor taken for decoder layers. DeepSeek-V3's MTP
layer (model.layers.{num_hidden_layers}) rides in the FP8 test's checkpoint (tests/engine/
test_engine_deepseek_v3_fp8.py); here Qwen3.5's mtp.* beside the text model, and the recognition rules."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model
from pdserve.testing.fp8_checkpoint import read_tensors, write_checkpoint
from pdserve.weights.mtp import MtpWeights


def test_deepseek_mtp_layers_follow_the_decoder_and_qwen_mtp_is_its_prefix():
    mtp = MtpWeights({"num_hidden_layers": 61, "num_nextn_predict_layers": 1}, 61)
    assert mtp.claims("model.layers.61.eh_proj.weight") and mtp.claims("model.layers.61.mlp.experts.3.up_proj.weight")
    assert not mtp.claims("model.layers.60.mlp.gate.weight") and not mtp.claims("model.layers.62.enorm.weight")
    assert mtp.claims("mtp.layers.0.self_attn.q_proj.weight") and mtp.skipped == 3
    assert not MtpWeights({"num_hidden_layers": 61}, 61).claims("model.layers.61.enorm.weight")
    nested = MtpWeights({"text_config": {"num_hidden_layers": 4, "num_nextn_predict_layers": 2}}, 4)
    assert nested.claims("model.layers.5.enorm.weight")


def test_qwen3_5_mtp_weights_are_skipped_and_the_model_serves_transformers_tokens(tmp_path, hf_greedy, caplog):
    """The tiny Qwen3.5 with Qwen3.5's MTP module beside it as the published checkpoint holds it (mtp.fc over
    the embedding and hidden state, one full-attention layer mtp.layers.0, its norms), in 3 shards."""
    transformers = pytest.importorskip("transformers")
    src = make_tiny_model(tmp_path / "src", arch="qwen3_5", num_layers=4)
    tensors = read_tensors(src)
    h = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(3)
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.3."):  # the text model's full-attention layer, as MTP's shape
            tensors[name.replace("model.layers.3.", "mtp.layers.0.")] = torch.randn(t.shape, generator=g)
    for name, shape in {"fc.weight": (h, 2 * h), "norm.weight": (h,), "pre_fc_norm_embedding.weight": (h,),
                        "pre_fc_norm_hidden.weight": (h,)}.items():
        tensors["mtp." + name] = torch.randn(shape, generator=g)
    config = json.loads((src / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    d = write_checkpoint(src, tmp_path / "published", tensors, config)

    oracle = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompts = [[5, 9, 33, 70, 2, 101], list(range(3, 30))]
    ref = hf_greedy(oracle, prompts, 12)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="pdserve.weights.mtp"):
        with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
            assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.weights.mtp"]
    assert lines == ["skipped 15 multi-token-prediction tensors (the checkpoint's MTP layers): pdserve decodes one "
                     "token per step and does not use them"]
