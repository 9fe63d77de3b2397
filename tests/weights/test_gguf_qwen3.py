"""Qwen3 and Qwen3-MoE GGUF files (llama.cpp's `qwen3` and `qwen3moe`): converted to an HF directory with
the original tensors and config, and served with transformers' greedy tokens on the same file.

Two shapes of each tiny model. The first is what pdserve must read whatever transformers does: q/k/v and
o_proj biases (attention_bias), a head_dim that is not hidden / heads, a dense layer among the sparse ones
(mlp_only_layers), 32-wide experts whose top-k is not renormalised (expert_weights_norm false); F32, so
the conversion must give back every tensor bit for bit.
The second is one transformers' GGUF loader can read too (it takes Qwen3's head_dim and biases, and
Qwen3-MoE's expert width, from its config class's defaults: 128, none, 768), Q8_0: the oracle."""

import json

import pytest
import torch
from gguf_writers import write_tiny_gguf
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.weights.gguf_convert import convert_gguf
from pdserve.weights.hf_dir import open_tensors, read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 10
ORIGINAL_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "rope_parameters", "rms_norm_eps",
                 "tie_word_embeddings", "attention_bias")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
            "decoder_sparse_step")


def _without_attention_biases(hf):
    """Real Qwen3 checkpoints have none, and transformers' GGUF loader cannot express them."""
    cfg = read_config(hf)
    (hf / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    weights = load_file(str(hf / "model.safetensors"))
    save_file({n: w for n, w in weights.items() if not n.endswith(".bias")}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_f32_gguf_gives_back_the_original_tensors_and_config(arch, tmp_path):
    moe = {"moe_intermediate_size": 32, "norm_topk_prob": False}  # (the oracle's MoE renormalises)
    hf = make_tiny_model(tmp_path / "hf", arch=arch, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                         hidden_size=80, moe_shape=moe if arch == "qwen3_moe" else None)
    out = convert_gguf(write_tiny_gguf(hf, tmp_path / "f32.gguf", quant="F32", pre="qwen2"), tmp_path / "out",
                       progress=False)
    original, converted = load_file(str(hf / "model.safetensors")), {n: t.load() for n, t in open_tensors(out).items()}
    assert converted.keys() == original.keys()
    for name in original:
        assert torch.equal(converted[name], original[name]), name  # q/k norms, biases, each expert of a stack
    # both read as transformers reads them (the original as transformers 5 saved it: rope_parameters,
    # num_local_experts)
    cfg, ref = (transformers.AutoConfig.from_pretrained(d) for d in (out, hf))
    keys = ORIGINAL_KEYS + (MOE_KEYS if arch == "qwen3_moe" else ())
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(ref, k) for k in keys}
    assert ModelConfig.from_hf(read_config(out)) == ModelConfig.from_hf(read_config(hf))
    assert cfg.attention_bias is (arch == "qwen3")  # the tiny dense model carries biases, the MoE none
    if arch == "qwen3_moe":
        assert cfg.mlp_only_layers == [1]  # the layer without a router in the file
        assert cfg.norm_topk_prob is False  # the file's expert_weights_norm


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def oracle_gguf(request, tmp_path_factory):
    """A Q8_0 GGUF transformers can load, and its greedy tokens for some prompts (transformers, gguf_file=)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    if arch == "qwen3":
        hf = _without_attention_biases(make_tiny_model(root / "hf", arch=arch, num_layers=3, num_heads=2,
                                                       num_kv_heads=1, head_dim=128, hidden_size=64, seed=5))
    else:
        hf = make_tiny_model(root / "hf", arch=arch, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             hidden_size=80, seed=5,
                             moe_shape={"num_experts": 4, "moe_intermediate_size": 768, "mlp_only_layers": []})
    path = write_tiny_gguf(hf, root / "m.q8_0.gguf", pre="qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 27)]
    return path, model, prompts


def test_converted_weights_equal_transformers_gguf_loading(oracle_gguf, tmp_path):
    path, model, _ = oracle_gguf
    ours = transformers.AutoModelForCausalLM.from_pretrained(convert_gguf(path, tmp_path / "out", progress=False))
    a, b = model.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_gguf_served_gives_transformers_greedy_tokens(oracle_gguf, hf_greedy, pdserve_cache):
    """`model: x.gguf` converts on first use; batched, the greedy tokens equal transformers' on the file."""
    path, model, prompts = oracle_gguf
    ref = hf_greedy(model, prompts, MAX_NEW)
    assert all(len(set(r)) >= 4 for r in ref), ref  # varied streams: a stuck model would prove little
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig(model=str(path), cache_dir=str(pdserve_cache), tokens_per_block=8)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref
